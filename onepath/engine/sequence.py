"""Sequence: one request's tokens, its place in the KV cache and its state in the scheduler."""
from __future__ import annotations

from enum import Enum, auto

import torch

from onepath.engine.sampling_params import SamplingParams
from onepath.ops.sampling import request_key


# The token a sequence holds for a sampled token still on its way to the host (Scheduler.advance).
PLACEHOLDER = -1


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), sample_id: int | None = None):
        """sample_id: the id the sampling noise is keyed by, with the seed and the position (default request_id):
        a server keys a request by its own place (choice, episode turn), not by the order it arrived in."""
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id} has an empty prompt: a prompt needs at least one token (e.g. BOS)")
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.params = params
        # sampling keys: one mix per token from here
        self.request_key = request_key(params.seed, request_id if sample_id is None else sample_id)
        self.eos_token_ids = tuple(eos_token_ids)
        self.block_table: list[int] = []
        self.state_slot: int | None = None  # a hybrid model's recurrent state slot while running (Scheduler)
        self.block_hashes: list[bytes] = []  # prefix-cache keys of the full blocks of token_ids, filled lazily
        self.status = SequenceStatus.WAITING
        self.logprobs: list[float] = []
        self.routing: dict[int, torch.Tensor] = {}  # first position -> MoE experts [n, layers, k] (record_routing)
        self.finish_reason: str | None = None
        self.error: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(request_id={self.request_id}, status={self.status.name}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens}, finish_reason={self.finish_reason})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def routing_by_position(self) -> torch.Tensor | None:
        """The recorded experts [positions fed, layers, k] over prompt + completion[:-1] (the last token is
        never fed), -1 where this sequence ran no forward (prefix-cache hits); None when nothing was recorded."""
        if not self.routing:
            return None
        shape = next(iter(self.routing.values())).shape[1:]
        out = torch.full((self.num_tokens - 1, *shape), -1, dtype=torch.long)
        # a position recorded twice (recomputed after a preemption) was computed by the same kernels
        for start, choices in sorted(self.routing.items()):
            out[start:start + len(choices)] = choices
        return out

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)

    def set_last_token(self, token_id: int, logprob: float) -> None:
        self.token_ids[-1] = token_id
        self.logprobs[-1] = logprob
