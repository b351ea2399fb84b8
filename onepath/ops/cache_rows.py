"""cache_rows: rows written into a paged cache and read back, the one read path of every phase.

A paged cache holds one row per slot, [blocks, block_size, *row]: a plain tensor, or an FP8Tensor written by
the spec's attention.kv rule (quant.py, per row). `write` stores a step's rows at their slots; `read` gathers
the rows at any slots ([...] slot ids, -1 for none: exact zeros) dequantised as ops/attention.py's
`load_slots` does (code.float() * scale, one rounding). `stage` stores a forward's own rows in a cache's format
(a block per row, quantised by the same rule), and `read` takes a position from the stage where `rows` points
into it, from the cache elsewhere: a row read from the stage has the bits it has once `copy` moves it into the
cache (a per-sequence ring, say) for a later forward. A model that reads everything it attends to through
`read` (DeepSeek-V4's sliding window, compressed entries and compressor state) computes on the same bits in
prefill, chunked prefill, decode and the trainer's private cache: the workspace the recipe gathers and
dequantises before its one attention kernel.

Backward: a read's gradient goes to `fresh` (this forward's rows [N, *row]) at `rows` (the slots' shape, -1
where the row is not in this forward), the quantisation straight-through. A trainer forward holds whole
sequences, so every row it reads is one of its own. The same torch code runs every (mode, device): a
gather and a scatter compute nothing (KERNELS).
"""
from __future__ import annotations

import torch

from onepath.numerics.quant import FP8Tensor
from onepath.numerics.spec import ExecutionSpec, QuantSpec
from onepath.ops.attention import load_slots, write_slots
from onepath.ops.autograd import apply_kernel


def paged(blocks: int, block_size: int, width: int, dtype: torch.dtype, kv: QuantSpec | None, device="cpu"):
    """An empty cache of blocks x block_size rows [1, width]: dtype, or FP8 codes and one FP32 scale per row
    (kv: the spec's attention.kv)."""
    shape = (blocks, block_size, 1, width)
    # zeros, not empty: unread slots are masked, but 0 * NaN would still poison a masked sum
    if kv is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return FP8Tensor(torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
                     torch.zeros(*shape[:-1], 1, dtype=torch.float32, device=device), (1, width), kv)


def write(spec: ExecutionSpec, cache, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [N, *row] into `cache` at slots [N]; an FP8 cache quantises by the rule it was built with, one of the
    spec's (attention.kv, or indexer.kv for DeepSeek-V4's indexer keys)."""
    kv = cache.rule if isinstance(cache, FP8Tensor) else None
    if isinstance(cache, FP8Tensor) and (kv is None or kv not in (spec.op("attention").kv, spec.op("indexer").kv)):
        raise TypeError(f"an FP8 cache under a spec without attention.kv or indexer.kv equal to its rule {kv}: build "
                        "the cache from the model's spec")
    WRITES[spec.mode, spec.device](cache, x.detach(), slots, kv)


def stage(spec: ExecutionSpec, x: torch.Tensor, quantised: bool):
    """x [N, 1, width] stored as a cache of N one-row blocks (one row per token) in the format of a cache
    `quantised` (FP8 by the spec's attention.kv) or not: what a write would store, row for row."""
    store = paged(x.shape[0], 1, x.shape[-1], x.dtype, spec.op("attention").kv if quantised else None, x.device)
    write(spec, store, torch.arange(x.shape[0], device=x.device), x)
    return store


def copy(cache, slots: torch.Tensor, source, rows: torch.Tensor) -> None:
    """source's rows `rows` [N] into cache's slots [N] as stored (codes and scales of an FP8 cache): no rounding."""
    pairs = [(cache.codes, source.codes), (cache.scales, source.scales)] if isinstance(cache, FP8Tensor) \
        else [(cache, source)]
    for dst, src in pairs:
        dst.view(-1, *dst.shape[2:])[slots] = src.view(-1, *src.shape[2:])[rows]


def gather(cache, slots: torch.Tensor, dtype: torch.dtype, staged=None, rows: torch.Tensor | None = None):
    """The rows at `slots` [...] -> [..., *row] in dtype, or where rows >= 0 the stage's rows `rows`; exact zeros
    where neither points. cache None: the stage's alone (a forward of whole sequences keeps no earlier rows)."""
    out = present = None
    for store, index in ((cache, slots), (staged, rows)):
        if store is None:
            continue
        here = index >= 0
        got = load_slots(store, index.clamp(min=0), dtype)
        out = got if out is None else torch.where(expand(here, got), got, out)
        present = here if present is None else present | here
    return torch.where(expand(present, out), out, out.new_zeros(()))


def gather_stored(cache, slots: torch.Tensor):
    """The one-head rows [1, width] at `slots` [...] as stored: a plain cache's [..., width], an FP8 cache's codes
    [..., width] and row scales [..., 1] (an FP8Tensor, no dequantisation); -1 slots give zeros (codes and scales)."""
    here = slots >= 0
    if isinstance(cache, FP8Tensor):
        codes = cache.codes.view(-1, cache.codes.shape[-1])[slots.clamp(min=0)]
        scales = cache.scales.view(-1, 1)[slots.clamp(min=0)]
        codes = torch.where(expand(here, codes), codes.view(torch.uint8), 0).view(torch.float8_e4m3fn)
        return FP8Tensor(codes, torch.where(expand(here, scales), scales, 0.0), cache.block, cache.rule)
    rows = cache.view(-1, cache.shape[-1])[slots.clamp(min=0)]
    return torch.where(expand(here, rows), rows, rows.new_zeros(()))


def expand(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.view(*mask.shape, *[1] * (like.dim() - mask.dim()))


def reference(fresh: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = fresh[rows.clamp(min=0)]
    return torch.where(expand(rows >= 0, out), out, out.new_zeros(()))


def read(spec: ExecutionSpec, cache, slots: torch.Tensor, dtype: torch.dtype, fresh: torch.Tensor | None = None,
         rows: torch.Tensor | None = None, staged=None) -> torch.Tensor:
    """gather(cache, slots, dtype, staged, rows): staged (this forward's rows, `stage`) where rows >= 0, the cache
    elsewhere; differentiable towards `fresh` (the staged rows' source) at `rows` when fresh needs a gradient."""
    kernel = READS[spec.mode, spec.device]
    if fresh is None or not (torch.is_grad_enabled() and fresh.requires_grad):
        return kernel(cache, slots, dtype, staged, rows)
    if bool(((rows < 0) & (slots >= 0)).any()):
        raise RuntimeError("a cache read with a gradient reaches rows of an earlier forward: the backward needs "
                           "whole sequences in the batch (no cached prefix)")
    return apply_kernel(lambda f: kernel(cache, slots, dtype, staged, rows), lambda f: reference(f, rows).to(dtype),
                        fresh)


# (mode, device) -> write(cache, x, slots, kv) / read(cache, slots, dtype, staged, rows): data movement only
WRITES = dict.fromkeys([("consistent", "cpu"), ("baseline", "cpu"), ("consistent", "cuda"), ("baseline", "cuda")],
                       write_slots)
READS = dict.fromkeys([("consistent", "cpu"), ("baseline", "cpu"), ("consistent", "cuda"), ("baseline", "cuda")],
                      gather)
