"""Sampling by an exponential race with a per-request generator.

token = argmax_i p_i / E_i with E_i ~ Exp(1) drawn from a generator keyed by
(seed, request id, position): an exact draw from p whose noise is a function of the request
alone, so a request's tokens never depend on its batch. Ties go to the larger position.
"""
from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1


def _mix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def sample_key(seed: int, request_id: int, position: int) -> int:
    return _mix(_mix(_mix(seed) ^ request_id) ^ position) >> 1


def exponential_noise(key: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(key)
    u = torch.rand(vocab, generator=g, dtype=torch.float64)
    return -torch.log1p(-u)


def sample(probs: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """probs [N, V] (zeros outside the allowed set), one key per row -> token ids [N]."""
    vocab = probs.shape[-1]
    tokens = []
    for row, key in zip(probs, keys):
        race = row.double() / exponential_noise(key, vocab)
        tokens.append(vocab - 1 - int(torch.argmax(race.flip(0))))
    return torch.tensor(tokens, dtype=torch.long)
