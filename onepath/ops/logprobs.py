"""Log-probabilities and entropy of sampled tokens under the distribution the engine sampled from.

The distribution is softmax(logits / temperature) restricted to `keep` (top-k / top-p) and
renormalised. The engine's sampler and the trainer call this same function, so a token's
log-prob is computed by one formula on both sides.

Backends, from KERNELS (token_logprobs) and PROBS (probs) by (mode, device): consistent CPU: exp/log on
fixed-shape pieces, the vocabulary sum as a fixed tree, no step depending on the number of rows; consistent CUDA:
the Triton kernels of ops/cuda/logprobs.py (the same recipe, chunked by a fixed BLOCK_V); baseline:
torch.log_softmax / torch.softmax. Backward: `reference`. Design notes and measurements: docs/ops/logprobs.md.
"""
from __future__ import annotations

import math

import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import pinned_unary, tree_sum
from onepath.ops.softmax import consistent_softmax_parts
from onepath.ops.topk import sort_descending


def _scaled(logits, temperature, keep):
    x = logits.float() / temperature[:, None]
    return x if keep is None else x.masked_fill(~keep, -math.inf)


def reference(logits, tokens, temperature, keep):
    logp = torch.log_softmax(_scaled(logits, temperature, keep), dim=-1)
    token_lp = logp.gather(-1, tokens[:, None])[:, 0]
    safe = logp if keep is None else logp.masked_fill(~keep, 0.0)
    entropy = -(safe.exp() * safe).sum(-1)
    return token_lp, entropy


def consistent(logits, tokens, temperature, keep):
    shifted, total, e = consistent_softmax_parts(_scaled(logits, temperature, keep))
    log_total = pinned_unary(torch.log, total)
    token_lp = shifted.gather(-1, tokens[:, None])[:, 0] - log_total
    logp = shifted - log_total[:, None]
    p = e / total[:, None]
    terms = torch.where(p > 0, p * logp, 0.0)
    return token_lp, -tree_sum(terms)


def token_logprobs(spec: ExecutionSpec, logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor,
                   keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V], tokens [N], temperature [N], keep [N, V] bool or None -> (logprob [N], entropy [N]), FP32."""
    if keep is not None:
        picked = keep.gather(-1, tokens[:, None])[:, 0]
        if spec.mode != "consistent":
            # the baseline trainer's logits differ from the engine's, so its top-k/top-p set can miss
            # the sampled token: let the token in rather than give it -inf
            keep = keep.scatter(-1, tokens[:, None], True)
        elif not bool(picked.all()):
            row = int((~picked).nonzero()[0])
            raise ValueError(f"token {int(tokens[row])} of row {row} lies outside its top-k/top-p set: "
                             "the trainer must use the sampling parameters the engine sampled with")
    kernel = KERNELS[spec.mode, spec.device]()
    return apply_kernel(lambda lg: kernel(lg, tokens, temperature, keep),
                        lambda lg: reference(lg, tokens, temperature, keep), logits)


def cuda_token_logprobs():
    from onepath.ops.cuda.logprobs import token_logprobs
    return token_logprobs


# (mode, device) -> kernel factory () -> kernel(logits, tokens, temperature, keep) -> (logprob, entropy)
KERNELS = {
    ("consistent", "cpu"): lambda: consistent,
    ("consistent", "cuda"): cuda_token_logprobs,
    ("baseline", "cpu"): lambda: reference,
    ("baseline", "cuda"): lambda: reference,
}


def consistent_probs(logits, temperature, keep):
    _, total, e = consistent_softmax_parts(_scaled(logits, temperature, keep))
    return e / total[:, None]


def reference_probs(logits, temperature, keep):
    return torch.softmax(_scaled(logits, temperature, keep), dim=-1)


def cuda_probs(logits, temperature, keep):
    from onepath.ops.cuda.logprobs import probs as triton_probs
    return triton_probs(logits, temperature, keep)


# (mode, device) -> probs(logits, temperature, keep) [N, V] FP32
PROBS = {
    ("consistent", "cpu"): consistent_probs,
    ("consistent", "cuda"): cuda_probs,
    ("baseline", "cpu"): reference_probs,
    ("baseline", "cuda"): reference_probs,
}


def probs(spec: ExecutionSpec, logits, temperature, keep=None) -> torch.Tensor:
    return PROBS[spec.mode, spec.device](logits, temperature, keep)


# top-p's running mass counts in units of 2^-52: exact integers for every float32 probability >= 2^-29
MASS_UNITS = 2.0 ** 52


def sampling_mask(spec: ExecutionSpec, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor | None:
    """The tokens each row may sample: its top_k largest (0 = all), then the smallest prefix of
    the rest, by descending probability, whose mass reaches top_p (1.0 = all). None when no row filters."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    if bool((k == vocab).all()) and bool((top_p >= 1.0).all()):
        return None
    order = sort_descending(spec, logits.float() / temperature[:, None])
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(vocab, device=order.device).expand_as(order))
    keep = rank < k[:, None]
    if bool((top_p < 1.0).any()):
        # The running mass in integer units of 2^-52 (a float32 probability times 2^52 is exact; below 2^-29
        # the fraction is dropped, the same way in every row): an integer sum is the same whatever the scan's
        # association, and torch.cumsum's CUDA scan associates a float row's sums by the tensor's shape
        # (tests/ops/test_logprobs_gpu.py shows a row's float prefix sums move with its batch).
        fixed = (probs(spec, logits, temperature, keep).gather(-1, order).double() * MASS_UNITS).long()
        mass_before = torch.cumsum(fixed, dim=-1) - fixed
        # rows without top-p keep everything: a running sum can reach 1.0 before the tail ends
        keep_sorted = (mass_before.double() < top_p.double()[:, None] * MASS_UNITS) | (top_p[:, None] >= 1.0)
        keep &= keep_sorted.gather(-1, rank)
    return keep
