"""Sampling by an exponential race with a per-request counter-based generator.

token = argmax_i p_i / E_i with E_i ~ Exp(1). E_i is a pure function of (seed, request id,
position, i): splitmix64 of a 64-bit key and the token index, so the draw is exact sampling from p
and a request's tokens never depend on its batch. Ties go to the larger position. On CUDA the race
runs fused in one Triton pass (ops/cuda/sampling.py), on the same noise.

sample_with_logprobs is the engine's sampler in one call: probs -> sample -> token_logprobs. On CUDA
(consistent) it is one fused path whose probabilities stay in registers, with the same tokens and
log-probs bit for bit; elsewhere it is those three ops.

Greedy rows (temperature 0) take the largest logit among the kept tokens instead, ties to the larger
index as the race's; their temperature row is 1 (SamplingParams), so the log-prob reported is the
untempered distribution's, which the trainer's token_logprobs recomputes.
"""
from __future__ import annotations

import math

import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops import logprobs as LP
from onepath.ops.host import to_device
from onepath.ops.pinned import pinned_unary
from onepath.ops.splitmix import GOLDEN, MASK64, MIX1, MIX2, mix, signed64


def request_key(seed: int, request_id: int) -> int:
    """The part of every sample_key of one request that does not depend on the position."""
    return mix(mix(seed & MASK64) ^ (request_id & MASK64))


def position_key(request: int, position: int) -> int:
    """sample_key from its request_key: one mix per sampled token."""
    return mix(request ^ (position & MASK64)) >> 1


def sample_key(seed: int, request_id: int, position: int) -> int:
    return position_key(request_key(seed, request_id), position)


def _shift_right(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def uniform_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """U[0, 1) float64 [N, vocab] for keys [N]: splitmix64(key + (i + 1) * golden) in wrapping int64 arithmetic."""
    z = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device) * signed64(GOLDEN) + keys[:, None]
    z = (z ^ _shift_right(z, 30)) * signed64(MIX1)
    z = (z ^ _shift_right(z, 27)) * signed64(MIX2)
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).double() * 2.0 ** -53


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    return pinned_unary(lambda u: -torch.log1p(-u), uniform_noise(keys, vocab))


def sample(probs: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """probs [N, V] (zeros outside the allowed set), one key per row -> token ids [N] on probs' device."""
    return RACES["cuda" if probs.is_cuda else "cpu"](probs, to_device(keys, torch.int64, probs.device))


def torch_race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    vocab = probs.shape[-1]
    race = probs.double() / exponential_noise(keys, vocab)
    return vocab - 1 - torch.argmax(race.flip(-1), dim=-1)


def cuda_race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    from onepath.ops.cuda.sampling import sample as fused_race
    return fused_race(probs, keys)


# device -> the race (probs, keys tensor) -> tokens: exact sampling, the same tokens in both modes
RACES = {"cpu": torch_race, "cuda": cuda_race}


def greedy_tokens(logits: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The largest logit's index per row among keep (all when None), ties to the larger index. [N] int64."""
    x = logits.float() if keep is None else logits.float().masked_fill(~keep, -math.inf)
    return x.shape[-1] - 1 - torch.argmax(x.flip(-1), dim=-1)   # argmax returns the first of equal maxima


def sample_with_logprobs(spec: ExecutionSpec, logits: torch.Tensor, temperature: torch.Tensor, keys: list[int],
                         keep: torch.Tensor | None = None,
                         greedy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V], temperature [N], one key per row, keep [N, V] bool or None, greedy [N] bool or None ->
    (tokens [N] int64, logprobs [N] FP32): a draw from softmax(logits / temperature) restricted to keep (the
    argmax where greedy), and its log-prob."""
    return SAMPLERS[spec.mode, spec.device](spec, logits, temperature, keys, keep, greedy)


def unfused(spec: ExecutionSpec, logits, temperature, keys, keep, greedy=None):
    tokens = sample(LP.probs(spec, logits, temperature, keep), keys)
    if greedy is not None:
        tokens = torch.where(greedy, greedy_tokens(logits, keep), tokens)
    return tokens, LP.token_logprobs(spec, logits, tokens, temperature, keep)[0]


def fused(spec: ExecutionSpec, logits, temperature, keys, keep, greedy=None):
    from onepath.ops.cuda.sampling import sample_with_logprobs as fused_sampler
    return fused_sampler(logits, temperature, to_device(keys, torch.int64, logits.device), keep, greedy)


# (mode, device) -> sampler (spec, logits, temperature, keys, keep, greedy) -> (tokens, logprobs)
SAMPLERS = {
    ("consistent", "cpu"): unfused,
    ("consistent", "cuda"): fused,
    ("baseline", "cpu"): unfused,
    ("baseline", "cuda"): unfused,
}
