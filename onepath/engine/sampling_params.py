"""SamplingParams: how one request draws its tokens.

temperature 0 decodes greedily: the token of largest logit among the top-k / top-p set (ties to the
larger token id, the sampler's rule), and its reported log-prob is that of the untempered distribution
(temperature 1, restricted to the same set), which the trainer recomputes bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from onepath.ops.host import to_device


@dataclass(slots=True, frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __post_init__(self):
        if not _is_number(self.temperature) or not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature {self.temperature!r} must be a finite number >= 0: 0 decodes greedily, "
                             "1.0 samples from the model")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k {self.top_k!r} must be an int >= 1, or 0 to turn it off")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p!r} must be in (0, 1]: use 1.0 to turn it off")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens {self.max_tokens!r} must be an int >= 1")
        if isinstance(self.stop_token_ids, (int, str)):
            raise ValueError(f"stop_token_ids {self.stop_token_ids!r} must be a sequence of token ids, e.g. (2,)")
        stop = tuple(self.stop_token_ids)
        bad = [t for t in stop if not _is_int(t) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids {self.stop_token_ids!r} holds {bad}: token ids are ints >= 0")
        object.__setattr__(self, "stop_token_ids", stop)  # a list would make the frozen params unhashable
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos {self.ignore_eos!r} must be True or False")
        if not _is_int(self.seed):
            raise ValueError(f"seed {self.seed!r} must be an int")


def sampling_tensors(params: list[SamplingParams], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """temperature [N] FP32, top_k [N] int64, top_p [N] FP32, one row per params entry: the engine's sampler and
    the trainer's log-probs read the same tensors, so they draw from and score one distribution. A greedy
    row's distribution is temperature 1's."""
    return (to_device([p.temperature or 1.0 for p in params], torch.float32, device),
            to_device([p.top_k for p in params], torch.long, device),
            to_device([p.top_p for p in params], torch.float32, device))


def greedy_rows(params: list[SamplingParams], device) -> torch.Tensor | None:
    """[N] bool, True where the row decodes greedily; None when no row does."""
    if not any(p.greedy for p in params):
        return None
    return to_device([p.greedy for p in params], torch.bool, device)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
