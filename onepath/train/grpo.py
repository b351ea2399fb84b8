"""GRPO: group-normalised advantages, the clipped-ratio policy loss (verl's defaults), and verl's
rollout corrections: truncated importance sampling (TIS) and masked importance sampling (MIS).

The corrections weigh or mask tokens by r = pi_old / pi_rollout. In consistent mode old == rollout
bit for bit, so r = 1 exactly and both are exact no-ops; they exist for the baseline mode and for
comparisons.
"""
from __future__ import annotations

import torch

LEVELS = ("token", "sequence")
# verl's safety bound: log-ratios are clamped to +-20 before exp, so a weight is never inf
LOG_RATIO_BOUND = 20.0


class NonFiniteError(ValueError):
    """A step met a NaN or inf (or a reward that is no number) and stopped before the weights
    changed, so the last checkpoint stays the run's state; the message names the value's source."""


def group_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [B] ordered group by group -> one advantage per response [B] (verl's GRPO outcome advantage)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.double().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if norm_by_std and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1).float()


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_ratio: float, weights: torch.Tensor | None = None,
                count: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio loss, token-mean over valid tokens. logprobs/old/mask [B, T], advantages [B].
    `weights` [B, T] (detached) multiply each token's loss (TIS); tokens off `mask` leave the mean.
    `count` is the mean's denominator when these rows are one micro-batch of a step: the step's
    valid tokens, so that the micro-batches' losses and stats add up to the step's (default: mask's)."""
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights.detach()
    valid = mask.float()
    count = valid.sum().clamp(min=1.0) if count is None else max(count, 1.0)
    loss = (per_token * valid).sum() / count
    clipfrac = ((clipped > unclipped).float() * valid).sum() / count
    ppo_kl = ((old_logprobs - logprobs) * valid).sum() / count
    return loss, {"actor/pg_loss": loss.item(), "actor/pg_clipfrac": clipfrac.item(), "actor/ppo_kl": ppo_kl.item()}


def rollout_log_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                      level: str) -> torch.Tensor:
    """log(pi_old / pi_rollout) [B, T], detached: each token's own (`token`), or its sequence's sum over
    valid tokens on each of its tokens (`sequence`); clamped to +-20 after the sum as verl does; 0 off the mask."""
    if level not in LEVELS:
        raise ValueError(f"rollout correction level {level!r}: use one of {', '.join(LEVELS)}")
    old, rollout, valid = old_logprobs.detach(), rollout_logprobs.detach(), mask.bool()
    # equal values give exactly 0, even at -inf where old - rollout is NaN
    d = torch.where(valid & (old != rollout), old - rollout, torch.zeros_like(old))
    if level == "sequence":
        d = torch.where(valid, d.sum(dim=1, keepdim=True), torch.zeros_like(d))
    return d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def rollout_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, level: str,
                       threshold: float) -> torch.Tensor:
    """TIS weights [B, T]: min(r, threshold), r = pi_old / pi_rollout per token or per sequence (detached);
    1 off the mask."""
    return rollout_log_ratio(old_logprobs, rollout_logprobs, mask, level).exp().clamp(max=threshold)


def rollout_rs_mask(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, level: str,
                    threshold: float) -> torch.Tensor:
    """MIS: `mask` [B, T] without the tokens (`token`) or whole sequences (`sequence`) whose
    r = pi_old / pi_rollout lies outside [1 / threshold, threshold]."""
    ratio = rollout_log_ratio(old_logprobs, rollout_logprobs, mask, level).exp()
    return mask.bool() & (ratio >= 1.0 / threshold) & (ratio <= threshold)


def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       rollout_is: str | None = None, rollout_is_threshold: float = 2.0,
                       rollout_rs: str | None = None, rollout_rs_threshold: float = 2.0,
                       ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(TIS weights or None, the loss mask after MIS, rollout_corr/* metrics) for policy_loss.

    rollout_is_{mean,max} are over valid tokens (a sequence's weight counts once per token);
    rollout_rs_masked_fraction is the share of valid tokens MIS took out of the loss."""
    valid = mask.bool()
    weights, keep, metrics = None, valid, {}
    n = int(valid.sum())
    if rollout_is is not None:
        weights = rollout_is_weights(old_logprobs, rollout_logprobs, valid, rollout_is, rollout_is_threshold)
        on_valid = weights[valid]
        metrics["rollout_corr/rollout_is_mean"] = on_valid.mean().item() if n else 1.0
        metrics["rollout_corr/rollout_is_max"] = on_valid.max().item() if n else 1.0
    if rollout_rs is not None:
        keep = rollout_rs_mask(old_logprobs, rollout_logprobs, valid, rollout_rs, rollout_rs_threshold)
        metrics["rollout_corr/rollout_rs_masked_fraction"] = (n - int(keep.sum())) / n if n else 0.0
    return weights, keep, metrics
