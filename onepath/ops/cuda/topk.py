"""index_topk on Hopper: each row's k best valid entries by the 64-bit key (score bits, position), emitted by
descending position with -1 last: ops/topk.py's keyed_index_topk, bit for bit (the selection is a set of
integers, so the GPU and the CPU agree exactly).

One program per row, five passes over it. The score becomes its order-preserving unsigned 32-bit image (-0.0 as
+0.0, the CPU key's high half); a radix select over it, four passes of RADIX bits each histogramming the valid
entries whose higher digits match the prefix found so far, finds s*, the value of the k-th best entry, and how
many entries lie above it (exact integer counts: no order to fix, nothing depends on other rows). The last pass
walks the row from its end in blocks: it keeps every entry above s* and, of those equal to s*, the ones of
largest position until k are kept (the key's tie rule: the larger position wins), and writes each kept position
at its rank, so the output is sorted by descending position with no sort; the slots no valid entry fills get -1.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

RADIX = 8        # bits of the key resolved per pass: 4 passes over 32 bits
# (longest row, entries a pass reads at a time, warps): the first whose row length covers the call's. A row is one
# program, its passes a loop over blocks: wider blocks with more warps take fewer steps on long rows (measured at
# 8192 and 32768 entries, k = 2048: bench/results/deepseek_v4/topk-sweep-h200.json); a row shorter than a block
# reads it masked
LAUNCH_SHAPES = ((1024, 1024, 4), (2048, 2048, 8), (16384, 4096, 8), (None, 8192, 16))


def launch_shape(length: int) -> tuple[int, int]:
    """(block, num_warps) of the kernel for rows of `length` entries (LAUNCH_SHAPES)."""
    return next((block, warps) for longest, block, warps in LAUNCH_SHAPES if longest is None or length <= longest)


@triton.jit
def _ordered(x):
    """The score's order-preserving unsigned 32-bit image (as int64): -0.0 as +0.0, negatives below positives."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return mono.to(tl.int64) + 2147483648


@triton.jit(do_not_specialize=["L", "K", "s_stride", "v_stride", "o_stride"])
def _index_topk_kernel(s_ptr, v_ptr, o_ptr, L, K, s_stride, v_stride, o_stride,
                       BLOCK: tl.constexpr, RADIX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s_row, v_row, o_row = s_ptr + row * s_stride, v_ptr + row * v_stride, o_ptr + row * o_stride
    cols = tl.arange(0, BLOCK)
    bins = tl.arange(0, 1 << RADIX)
    prefix = tl.zeros([], dtype=tl.int64)   # the digits of s* found so far
    above = tl.zeros([], dtype=tl.int32)    # entries known to lie above s*
    want = tl.zeros([], dtype=tl.int32)     # min(K, valid entries): the rank of s*
    for p in tl.static_range(32 // RADIX):
        shift = 32 - RADIX * (p + 1)  # a constexpr: p and RADIX are
        hist = tl.zeros([1 << RADIX], dtype=tl.int32)
        for start in range(0, L, BLOCK):
            offs = start + cols
            inside = offs < L
            u = _ordered(tl.load(s_row + offs, mask=inside, other=0.0))
            match = inside & (tl.load(v_row + offs, mask=inside, other=0) != 0)
            if p > 0:
                match = match & ((u >> (shift + RADIX)) == (prefix >> (shift + RADIX)))
            hist += tl.histogram(((u >> shift) & ((1 << RADIX) - 1)).to(tl.int32), 1 << RADIX, mask=match)
        if p == 0:
            want = tl.minimum(K, tl.sum(hist, axis=0))
        need = want - above
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist   # matching entries with digit >= bin
        digit = tl.max(tl.where(at_least >= need, bins, 0), axis=0)
        above += tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        prefix = prefix | (digit.to(tl.int64) << shift)
    need_equal = want - above
    written = tl.zeros([], dtype=tl.int32)
    taken = tl.zeros([], dtype=tl.int32)
    for start in range(0, L, BLOCK):
        offs = L - 1 - (start + cols)   # descending positions
        inside = offs >= 0
        u = _ordered(tl.load(s_row + offs, mask=inside, other=0.0))
        valid = inside & (tl.load(v_row + offs, mask=inside, other=0) != 0)
        equal = valid & (u == prefix)
        keep = (valid & (u > prefix)) | (equal & (tl.cumsum(equal.to(tl.int32), axis=0) + taken <= need_equal))
        rank = written + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(o_row + rank, offs.to(tl.int64), mask=keep)
        written += tl.sum(keep.to(tl.int32), axis=0)
        taken += tl.sum(equal.to(tl.int32), axis=0)
    for start in range(0, K, BLOCK):
        offs = start + cols
        tl.store(o_row + offs, tl.full([BLOCK], -1, tl.int64), mask=(offs >= written) & (offs < K))


def index_topk(scores: torch.Tensor, valid: torch.Tensor, k: int, block: int | None = None,
               num_warps: int | None = None) -> torch.Tensor:
    """scores [..., L] FP32, valid [..., L] bool -> [..., k] int64 positions, descending, -1 where none. block and
    num_warps (default: launch_shape(L)) move the time, never the result: the selection is exact integer logic in
    any block (the bench's sweep, python -m onepath.bench.deepseek_v4 topk --sweep)."""
    length, rows = scores.shape[-1], math.prod(scores.shape[:-1])
    shape = launch_shape(length)
    block, num_warps = block or shape[0], num_warps or shape[1]
    # (rows, not -1: a context with no compressed entry yet has length 0)
    s = scores.reshape(rows, length).float().contiguous()
    v = valid.reshape(rows, length).to(torch.int8).contiguous()
    out = torch.empty(s.shape[0], k, dtype=torch.int64, device=scores.device)
    if s.shape[0] and k:
        _index_topk_kernel[(s.shape[0],)](s, v, out, length, k, s.stride(0), v.stride(0), out.stride(0),
                                          BLOCK=block, RADIX=RADIX, num_warps=num_warps)
    return out.view(*scores.shape[:-1], k)
