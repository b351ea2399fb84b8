"""Does splitting a row over many programs bring index_topk (ops/cuda/topk.py) toward the recipe's 5.9 us at
k = 2048? The shipped kernel gives a row one program that walks the row's blocks five times: one row of 32768
entries took 135 us at its best launch shape on an H200, as long as 64 rows (bench/results/deepseek_v4/
topk-sweep-h200.json): latency, not bandwidth.

Here a row is cut into slices of SLICE entries, one program each. The radix select's four passes become two
launches each: every slice's program histograms the entries of its slice whose higher digits match the prefix
found so far and adds its histogram into the row's with integer atomics (integer counts add up the same in any
order: the selection stays exact), then one program per row picks the digit as the shipped kernel does. The walk
that writes the positions becomes a count of each slice's entries above s* and equal to it, the slices' offsets
from the row's end (suffix sums of those integers, in torch), and a second walk per slice writing its kept entries
at their ranks. The positions are the shipped kernel's, bit for bit (checked on every call below).

    TRITON_INTERPRET=1 python lab/topk_split.py --check       (the CPU: equal to the key on ties, few valid, k > L)
    python lab/topk_split.py --build                           (the CPU: the four kernels build for sm_90)
    python lab/topk_split.py [--slice N]                       (a GPU: times against index_topk and torch.topk)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from onepath.ops.cuda.topk import RADIX, _ordered, index_topk  # noqa: E402

BINS = 1 << RADIX


@triton.jit
def _slice_hist(s_ptr, v_ptr, hist_ptr, prefix_ptr, L, s_stride, v_stride, SHIFT: tl.constexpr,
                FIRST: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr, RADIX: tl.constexpr):
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    prefix = tl.load(prefix_ptr + row)
    hist = tl.zeros([1 << RADIX], dtype=tl.int32)
    for start in range(0, SLICE, BLOCK):
        offs = part * SLICE + start + cols
        inside = offs < L
        u = _ordered(tl.load(s_ptr + row * s_stride + offs, mask=inside, other=0.0))
        match = inside & (tl.load(v_ptr + row * v_stride + offs, mask=inside, other=0) != 0)
        if not FIRST:
            match = match & ((u >> (SHIFT + RADIX)) == (prefix >> (SHIFT + RADIX)))
        hist += tl.histogram(((u >> SHIFT) & ((1 << RADIX) - 1)).to(tl.int32), 1 << RADIX, mask=match)
    tl.atomic_add(hist_ptr + row * (1 << RADIX) + tl.arange(0, 1 << RADIX), hist, sem="relaxed")


@triton.jit
def _pick_digit(hist_ptr, prefix_ptr, above_ptr, want_ptr, K, SHIFT: tl.constexpr, FIRST: tl.constexpr,
                RADIX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, 1 << RADIX)
    hist = tl.load(hist_ptr + row * (1 << RADIX) + bins)
    if FIRST:
        want = tl.minimum(K, tl.sum(hist, axis=0))
        tl.store(want_ptr + row, want)
    else:
        want = tl.load(want_ptr + row)
    above = tl.load(above_ptr + row)
    need = want - above
    at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    digit = tl.max(tl.where(at_least >= need, bins, 0), axis=0)
    tl.store(above_ptr + row, above + tl.sum(tl.where(bins > digit, hist, 0), axis=0))
    tl.store(prefix_ptr + row, tl.load(prefix_ptr + row) | (digit.to(tl.int64) << SHIFT))
    tl.store(hist_ptr + row * (1 << RADIX) + bins, tl.zeros([1 << RADIX], dtype=tl.int32))


@triton.jit
def _slice_counts(s_ptr, v_ptr, prefix_ptr, counts_ptr, L, s_stride, v_stride, parts,
                  SLICE: tl.constexpr, BLOCK: tl.constexpr):
    """counts[row, part] = (entries above s*, entries equal to it) in the slice."""
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    prefix = tl.load(prefix_ptr + row)
    above = tl.zeros([], dtype=tl.int32)
    equal = tl.zeros([], dtype=tl.int32)
    for start in range(0, SLICE, BLOCK):
        offs = part * SLICE + start + cols
        inside = offs < L
        u = _ordered(tl.load(s_ptr + row * s_stride + offs, mask=inside, other=0.0))
        valid = inside & (tl.load(v_ptr + row * v_stride + offs, mask=inside, other=0) != 0)
        above += tl.sum((valid & (u > prefix)).to(tl.int32), axis=0)
        equal += tl.sum((valid & (u == prefix)).to(tl.int32), axis=0)
    tl.store(counts_ptr + (row * parts + part) * 2, above)
    tl.store(counts_ptr + (row * parts + part) * 2 + 1, equal)


@triton.jit
def _slice_emit(s_ptr, v_ptr, o_ptr, prefix_ptr, start_ptr, L, s_stride, v_stride, o_stride, parts,
                SLICE: tl.constexpr, BLOCK: tl.constexpr):
    """The shipped kernel's last walk over one slice, from the slice's end: written and taken start at the counts
    of the slices above it (start[row, part] = (rank of its first kept entry, equal entries above it, equal
    entries the row keeps))."""
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    prefix = tl.load(prefix_ptr + row)
    base = start_ptr + (row * parts + part) * 3
    written, taken, need_equal = tl.load(base), tl.load(base + 1), tl.load(base + 2)
    end = tl.minimum((part + 1) * SLICE, L)
    for start in range(0, SLICE, BLOCK):
        offs = end - 1 - (start + cols)
        inside = offs >= part * SLICE
        u = _ordered(tl.load(s_ptr + row * s_stride + offs, mask=inside, other=0.0))
        valid = inside & (tl.load(v_ptr + row * v_stride + offs, mask=inside, other=0) != 0)
        equal = valid & (u == prefix)
        keep = (valid & (u > prefix)) | (equal & (tl.cumsum(equal.to(tl.int32), axis=0) + taken <= need_equal))
        rank = written + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(o_ptr + row * o_stride + rank, offs.to(tl.int64), mask=keep)
        written += tl.sum(keep.to(tl.int32), axis=0)
        taken += tl.sum(equal.to(tl.int32), axis=0)


def split_index_topk(scores: torch.Tensor, valid: torch.Tensor, k: int, slice_len: int = 2048,
                     block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """index_topk's positions for scores, valid [R, L] by slices of slice_len entries."""
    rows, length = scores.shape
    s, v = scores.float().contiguous(), valid.to(torch.int8).contiguous()
    out = torch.full((rows, k), -1, dtype=torch.int64, device=s.device)
    if not rows or not k or not length:
        return out
    parts = triton.cdiv(length, slice_len)
    hist = torch.zeros(rows, BINS, dtype=torch.int32, device=s.device)
    prefix = torch.zeros(rows, dtype=torch.int64, device=s.device)
    above = torch.zeros(rows, dtype=torch.int32, device=s.device)
    want = torch.zeros(rows, dtype=torch.int32, device=s.device)
    common = dict(SLICE=slice_len, BLOCK=min(block, slice_len), num_warps=num_warps)
    for p in range(32 // RADIX):
        shift = 32 - RADIX * (p + 1)
        _slice_hist[(rows, parts)](s, v, hist, prefix, length, s.stride(0), v.stride(0), SHIFT=shift, FIRST=p == 0,
                                   RADIX=RADIX, **common)
        _pick_digit[(rows,)](hist, prefix, above, want, k, SHIFT=shift, FIRST=p == 0, RADIX=RADIX)
    counts = torch.empty(rows, parts, 2, dtype=torch.int32, device=s.device)
    _slice_counts[(rows, parts)](s, v, prefix, counts, length, s.stride(0), v.stride(0), parts, **common)
    # the slices above a slice (higher positions) come first: exclusive suffix sums of their counts
    equal_above = counts[..., 1].flip(1).cumsum(1).flip(1) - counts[..., 1]
    need_equal = (want - above)[:, None]
    kept = counts[..., 0] + (need_equal - equal_above).clamp(min=0).minimum(counts[..., 1])
    written = kept.flip(1).cumsum(1).flip(1) - kept
    start = torch.stack([written, equal_above, need_equal.expand(-1, parts)], -1).to(torch.int32).contiguous()
    _slice_emit[(rows, parts)](s, v, out, prefix, start, length, s.stride(0), v.stride(0), out.stride(0), parts,
                               **common)
    return out


def check() -> None:
    from onepath.ops.topk import keyed_index_topk
    gen = torch.Generator().manual_seed(0)
    length = 5000
    ties = torch.relu(torch.randn(4, length, generator=gen)) * (torch.rand(4, length, generator=gen) < 0.3)
    ties[1] = -ties[1]
    ties[2, ::7] = 1.5
    cases = [(torch.randn(3, length, generator=gen), torch.rand(3, length, generator=gen) < 0.9),
             (ties, torch.ones_like(ties, dtype=torch.bool)),
             (torch.randn(2, length, generator=gen), torch.rand(2, length, generator=gen) < 0.01)]
    for scores, valid in cases:
        for k in (1, 300, 1200):
            for slice_len in (1024, 2048):
                got = split_index_topk(scores, valid, k, slice_len, block=512)
                want = keyed_index_topk(scores, valid, k)
                print(f"k {k} slice {slice_len}: {'equal' if torch.equal(got, want) else 'DIFFERENT'}", flush=True)


def build() -> None:
    from onepath.ops.cuda import sm90
    ptrs = dict(s_ptr="*fp32", v_ptr="*i8")
    kernels = [
        (_slice_hist, {**ptrs, "hist_ptr": "*i32", "prefix_ptr": "*i64", "L": "i32", "s_stride": "i32",
                       "v_stride": "i32"}, dict(SHIFT=16, FIRST=False, SLICE=2048, BLOCK=1024, RADIX=RADIX)),
        (_pick_digit, {"hist_ptr": "*i32", "prefix_ptr": "*i64", "above_ptr": "*i32", "want_ptr": "*i32", "K": "i32"},
         dict(SHIFT=16, FIRST=True, RADIX=RADIX)),
        (_slice_counts, {**ptrs, "prefix_ptr": "*i64", "counts_ptr": "*i32", "L": "i32", "s_stride": "i32",
                         "v_stride": "i32", "parts": "i32"}, dict(SLICE=2048, BLOCK=1024)),
        (_slice_emit, {**ptrs, "o_ptr": "*i64", "prefix_ptr": "*i64", "start_ptr": "*i32", "L": "i32",
                       "s_stride": "i32", "v_stride": "i32", "o_stride": "i32", "parts": "i32"},
         dict(SLICE=2048, BLOCK=1024))]
    for kernel, sig, consts in kernels:
        built = sm90.build(kernel, sig, consts, [n for n in sig if n.endswith("_ptr")], 4, 1, True)
        print(f"{kernel.fn.__name__}: built for sm_90, {built.metadata.shared} bytes of shared memory", flush=True)


def timings(slice_lens: list[int], repeats: int = 50) -> list[dict]:
    results = []
    for rows, length in ((1, 32768), (64, 32768), (256, 8192)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        scores = torch.relu(torch.randn(rows, length, device="cuda", generator=gen))
        valid = torch.ones(rows, length, dtype=torch.bool, device="cuda")
        shipped = index_topk(scores, valid, 2048)
        calls = {"index_topk": lambda: index_topk(scores, valid, 2048),
                 "torch_topk": lambda: torch.topk(scores, 2048, dim=-1)}
        for n in slice_lens:
            if not torch.equal(split_index_topk(scores, valid, 2048, n), shipped):
                raise RuntimeError(f"slices of {n} selected other positions than index_topk at {rows} x {length}")
            calls[f"split_{n}"] = lambda n=n: split_index_topk(scores, valid, 2048, n)
        out = {"rows": rows, "length": length, "k": 2048}
        for name, call in calls.items():
            for graph in (False, True):
                fn = call
                if graph:  # the launches' host cost out of the way, as a decode step's CUDA graph has it
                    call()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        call()
                    fn = g.replay
                fn()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(repeats):
                    fn()
                torch.cuda.synchronize()
                out[f"{name}{'_graph' if graph else ''}_us"] = (time.perf_counter() - t) / repeats * 1e6
        print(json.dumps(out), flush=True)
        results.append(out)
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--slice", type=int, nargs="+", default=[1024, 2048, 4096])
    args = ap.parse_args()
    check() if args.check else build() if args.build else timings(args.slice)
