"""GRPO: group-normalised advantages and the clipped-ratio policy loss (verl's defaults)."""
from __future__ import annotations

import torch


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
                clip_ratio: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio loss, token-mean over valid tokens. logprobs/old/mask [B, T], advantages [B]."""
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    per_token = torch.maximum(unclipped, clipped)
    valid = mask.float()
    count = valid.sum().clamp(min=1.0)
    loss = (per_token * valid).sum() / count
    clipfrac = ((clipped > unclipped).float() * valid).sum() / count
    ppo_kl = ((old_logprobs - logprobs) * valid).sum() / count
    return loss, {"actor/pg_loss": loss.item(), "actor/pg_clipfrac": clipfrac.item(), "actor/ppo_kl": ppo_kl.item()}
