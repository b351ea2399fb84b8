"""SeqSpans: the sequences of a flattened batch as the recurrent operators (ops/conv1d.py, ops/ssd.py) see them.

A sequence brings rows [cu_seqlens[b], cu_seqlens[b + 1]) of the batch, its new tokens from position starts[b] on,
and the slot of its recurrent state (the engine's cache) or none: then it must start at position 0 (the trainer's
whole sequences) and nothing is kept.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SeqSpans:
    cu_seqlens: tuple[int, ...]
    starts: tuple[int, ...]
    slots: tuple[int, ...] | None = None

    def __post_init__(self):
        if len(self.cu_seqlens) != len(self.starts) + 1:
            raise ValueError(f"{len(self.cu_seqlens)} sequence offsets for {len(self.starts)} sequences: give one more")
        if self.slots is not None and len(self.slots) != len(self.starts):
            raise ValueError(f"{len(self.slots)} state slots for {len(self.starts)} sequences: give one per sequence")
        if self.slots is None:
            late = [(b, p) for b, p in enumerate(self.starts) if p]
            if late:
                b, p = late[0]
                raise ValueError(f"sequence {b} starts at position {p} but there is no recurrent state to continue: "
                                 "run whole sequences from position 0, or give each a state slot (HybridCache)")

    @classmethod
    def of(cls, cu_seqlens, context_lens, slots=None) -> "SeqSpans":
        """From a batch's offsets and each sequence's length once this pass is done (AttentionMetadata's)."""
        starts = tuple(end - (b - a) for a, b, end in zip(cu_seqlens, cu_seqlens[1:], context_lens))
        return cls(tuple(cu_seqlens), starts, None if slots is None else tuple(slots))

    @property
    def num_seqs(self) -> int:
        return len(self.starts)

    def rows(self, b: int) -> slice:
        return slice(self.cu_seqlens[b], self.cu_seqlens[b + 1])
