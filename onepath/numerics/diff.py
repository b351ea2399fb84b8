"""rollout_diff: how far the trainer's log-probs are from the rollout's, under verl's metric names.

The contract is that every metric here is exactly 0 on every step (not below a threshold).
Means and the std are over all valid tokens of the batch together (token-level, not per sequence).
Below train (which logs them) and consistency (whose gates check them), so both import one definition.
"""
from __future__ import annotations

import torch

PROBS_DIFF_MAX = "training/rollout_probs_diff_max"
PROBS_DIFF_MEAN = "training/rollout_probs_diff_mean"
PROBS_DIFF_STD = "training/rollout_probs_diff_std"
K3_KL = "rollout_corr/k3_kl"
LOGPROB_ABS_DIFF_MAX = "rollout_corr/logprob_abs_diff_max"
TOKENS_DIFFERING_FRAC = "rollout_corr/tokens_differing_frac"
VALID_TOKENS = "rollout_corr/valid_tokens"

DIFF_METRICS = (PROBS_DIFF_MAX, PROBS_DIFF_MEAN, PROBS_DIFF_STD, K3_KL, LOGPROB_ABS_DIFF_MAX,
                TOKENS_DIFFERING_FRAC)


def rollout_diff(rollout_logprobs: torch.Tensor, train_logprobs: torch.Tensor,
                 mask: torch.Tensor) -> dict[str, float]:
    """rollout_logprobs, train_logprobs: [B, T] log-probs of the sampled tokens (any float dtype);
    mask: [B, T], true (or 1) on valid response tokens.

    training/rollout_probs_diff_{max,mean,std}: |exp(train) - exp(rollout)|, in probability space as
    verl does; the std is the population std (unbiased=False), so one token gives 0, not NaN.
    rollout_corr/k3_kl: mean of r - 1 - log r, r = exp(train - rollout), computed as exp(d) - d - 1
    with d = train - rollout clamped to [-20, 20] as verl does.
    """
    if rollout_logprobs.shape != train_logprobs.shape or mask.shape != rollout_logprobs.shape:
        raise ValueError(f"rollout_logprobs {tuple(rollout_logprobs.shape)}, train_logprobs "
                         f"{tuple(train_logprobs.shape)} and mask {tuple(mask.shape)} must have one shape: "
                         "pass the log-probs of the same sampled tokens, aligned with the response mask")
    valid = mask.bool()
    rollout = rollout_logprobs.detach()[valid].to(torch.float64)
    train = train_logprobs.detach()[valid].to(torch.float64)
    n = rollout.numel()
    if n == 0:
        return {**dict.fromkeys(DIFF_METRICS, 0.0), VALID_TOKENS: 0}
    differs = train != rollout
    # Equal values give d = 0 even at -inf, where train - rollout would be NaN.
    d = torch.where(differs, train - rollout, torch.zeros_like(train))
    d_clamped = d.clamp(-20.0, 20.0)
    probs_diff = (train.exp() - rollout.exp()).abs()
    values = torch.stack([
        probs_diff.max(),
        probs_diff.mean(),
        probs_diff.std(correction=0),
        (d_clamped.exp() - d_clamped - 1).mean(),
        d.abs().max(),
        differs.to(torch.float64).mean(),
    ]).tolist()  # one device-to-host copy
    return {**dict(zip(DIFF_METRICS, values)), VALID_TOKENS: n}


def is_exact(metrics: dict[str, float]) -> bool:
    """True when every diff metric is exactly 0: the contract, not a tolerance."""
    missing = [k for k in DIFF_METRICS if k not in metrics]
    if missing:
        raise ValueError(f"metrics hold no {', '.join(missing)}: pass the dict rollout_diff returned")
    return all(metrics[k] == 0.0 for k in DIFF_METRICS)
