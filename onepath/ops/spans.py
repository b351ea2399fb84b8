"""SeqSpans: the sequences of a flattened batch as the recurrent operators (ops/conv1d.py, ops/ssd.py) see them.

A sequence brings rows [cu_seqlens[b], cu_seqlens[b + 1]) of the batch, its new tokens from position starts[b] on,
and the slot of its recurrent state (the engine's cache) or none: then it must start at position 0 (the trainer's
whole sequences) and nothing is kept.

The host tuples serve the CPU paths; the GPU kernels read the same on the device (SpanTensors). A captured decode
step (`SeqSpans.decode`) has only the device form on CUDA: its positions and slots sit in the graph's static buffers
and change at every replay, so nothing on the host may depend on them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onepath.ops.host import to_device


@dataclass(frozen=True, slots=True)
class SpanTensors:
    """The spans on the device (int64): what a kernel reads, with shapes fixed by the batch alone."""
    cu_seqlens: torch.Tensor  # [B + 1]
    starts: torch.Tensor      # [B]
    slots: torch.Tensor       # [B] (zeros where there is no state)
    row_seq: torch.Tensor     # [T]: each row's sequence


@dataclass(frozen=True, slots=True)
class SeqSpans:
    cu_seqlens: tuple[int, ...]
    starts: tuple[int, ...] | None   # None: on the device only (a captured decode step)
    slots: tuple[int, ...] | None = None
    tensors: SpanTensors | None = None
    decode_only: bool = False        # one token a sequence, every one continuing its slot (a static decode batch)

    def __post_init__(self):
        if self.starts is None:
            if self.tensors is None:
                raise ValueError("SeqSpans without host starts needs its SpanTensors")
            return
        if len(self.cu_seqlens) != len(self.starts) + 1:
            raise ValueError(f"{len(self.cu_seqlens)} sequence offsets for {len(self.starts)} sequences: give one more")
        if self.slots is not None and len(self.slots) != len(self.starts):
            raise ValueError(f"{len(self.slots)} state slots for {len(self.starts)} sequences: give one per sequence")
        if self.slots is None:
            late = [(b, p) for b, p in enumerate(self.starts) if p]
            if late:
                b, p = late[0]
                raise ValueError(f"sequence {b} starts at position {p} but there is no recurrent state to continue: "
                                 "run whole sequences from position 0, or give each a state slot (a cache from "
                                 "model.make_cache with num_slots)")

    @classmethod
    def of(cls, cu_seqlens, context_lens, slots=None, device: torch.device | str | None = None) -> "SeqSpans":
        """From a batch's offsets and each sequence's length once this pass is done (AttentionMetadata's); with a
        CUDA device, the device form too (one copy for every layer of the pass)."""
        starts = tuple(end - (b - a) for a, b, end in zip(cu_seqlens, cu_seqlens[1:], context_lens))
        spans = cls(tuple(cu_seqlens), starts, None if slots is None else tuple(slots))
        if device is not None and torch.device(device).type == "cuda":
            spans = cls(spans.cu_seqlens, spans.starts, spans.slots, spans.on(device))
        return spans

    @classmethod
    def decode(cls, positions: torch.Tensor, slots: torch.Tensor) -> "SeqSpans":
        """One decode token a sequence at `positions` [B], continuing state `slots` [B] (a static decode batch's
        buffers). On the CPU the host form is read from them; on CUDA there is none (the step may be captured)."""
        b = positions.shape[0]
        seq = torch.arange(b, dtype=torch.long, device=positions.device)
        tensors = SpanTensors(torch.arange(b + 1, dtype=torch.long, device=positions.device), positions, slots, seq)
        if positions.is_cuda:
            return cls(tuple(range(b + 1)), None, None, tensors, decode_only=True)
        return cls(tuple(range(b + 1)), tuple(positions.tolist()), tuple(slots.tolist()), tensors, decode_only=True)

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    def rows(self, b: int) -> slice:
        return slice(self.cu_seqlens[b], self.cu_seqlens[b + 1])

    def on(self, device: torch.device | str) -> SpanTensors:
        """The device form: the one given, else built from the host tuples."""
        if self.tensors is not None:
            return self.tensors
        n = self.num_seqs
        row_seq = [b for b in range(n) for _ in range(self.cu_seqlens[b + 1] - self.cu_seqlens[b])]
        flat = to_device(list(self.cu_seqlens) + list(self.starts) + list(self.slots or (0,) * n) + row_seq,
                         torch.long, device)
        return SpanTensors(flat[:n + 1], flat[n + 1:2 * n + 1], flat[2 * n + 1:3 * n + 1], flat[3 * n + 1:])
