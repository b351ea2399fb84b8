"""cache_rows: rows written into a paged cache and read back, the one read path of every phase.

A paged cache holds one row per token slot, [blocks, block_size, *row]: a plain tensor, or an FP8Tensor
written by the spec's attention.kv rule (quant.py, per row). `write` stores a step's rows at their slots;
`read` gathers the rows at any slots ([...] slot ids, -1 for none: exact zeros) dequantised as
ops/attention.py's `load_slots` does (code.float() * scale, one rounding). A model that reads everything it
attends to through `read` (DeepSeek-V4's sliding window, compressed entries and compressor state) computes
on the same bits in prefill, chunked prefill, decode and the trainer's private cache: the workspace the
recipe gathers and dequantises before its one attention kernel.

Backward: a read's gradient goes to `fresh` (this forward's rows [N, *row]) at `rows` (the slots' shape, -1
where the row is not in this forward), the quantisation straight-through. A trainer forward holds whole
sequences, so every row it reads is one of its own. The same torch code runs every (mode, device): a
gather and a scatter compute nothing (KERNELS).
"""
from __future__ import annotations

import torch

from onepath.numerics.quant import FP8Tensor
from onepath.numerics.spec import ExecutionSpec
from onepath.ops.attention import load_slots, write_slots
from onepath.ops.autograd import apply_kernel


def write(spec: ExecutionSpec, cache, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [N, *row] into `cache` at slots [N]; an FP8 cache quantises by the spec's attention.kv."""
    kv = spec.op("attention").kv
    if isinstance(cache, FP8Tensor) and kv is None:
        raise TypeError("an FP8 cache under a spec without attention.kv: build the cache from the model's spec")
    WRITES[spec.mode, spec.device](cache, x.detach(), slots, kv if isinstance(cache, FP8Tensor) else None)


def gather(cache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows at `slots` [...] -> [..., *row] in dtype; exact zeros where a slot is -1."""
    present = slots >= 0
    out = load_slots(cache, slots.clamp(min=0), dtype)
    return torch.where(present.view(*present.shape, *[1] * (out.dim() - present.dim())), out, out.new_zeros(()))


def reference(fresh: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    present = rows >= 0
    out = fresh[rows.clamp(min=0)]
    return torch.where(present.view(*present.shape, *[1] * (out.dim() - present.dim())), out, out.new_zeros(()))


def read(spec: ExecutionSpec, cache, slots: torch.Tensor, dtype: torch.dtype, fresh: torch.Tensor | None = None,
         rows: torch.Tensor | None = None) -> torch.Tensor:
    """gather(cache, slots, dtype), differentiable towards `fresh` at `rows` when fresh needs a gradient."""
    kernel = READS[spec.mode, spec.device]
    if fresh is None or not (torch.is_grad_enabled() and fresh.requires_grad):
        return kernel(cache, slots, dtype)
    if bool(((rows < 0) & (slots >= 0)).any()):
        raise RuntimeError("a cache read with a gradient reaches rows of an earlier forward: the backward needs "
                           "whole sequences in the batch (no cached prefix)")
    return apply_kernel(lambda f: kernel(cache, slots, dtype), lambda f: reference(f, rows).to(dtype), fresh)


# (mode, device) -> write(cache, x, slots, kv) / read(cache, slots, dtype): data movement only
WRITES = dict.fromkeys([("consistent", "cpu"), ("baseline", "cpu"), ("consistent", "cuda"), ("baseline", "cuda")],
                       write_slots)
READS = dict.fromkeys([("consistent", "cpu"), ("baseline", "cpu"), ("consistent", "cuda"), ("baseline", "cuda")],
                      gather)
