"""Which formulation of the block-FP8 GEMM's K loop Triton runs fast on Hopper: the data behind
ops/cuda/linear_fp8.py's Triton tiles. "Shipped" here is that Triton kernel, forced to its tile: on Hopper
linear_fp8 now takes the warp-specialized Gluon kernel (ops/cuda/linear_fp8_ws.py, lab/fp8_gluon.py).

    python lab/fp8_variants.py [--out lab/results/fp8-variants.json]

Every variant keeps each output element's chain of the shipped kernel: per K block in ascending
order, a fresh tensor-core partial over the same 128 K values, then one FP32 FMA with the scale
product into the element's accumulator (the W8A8 contract). They differ in what may overlap the
wait for each block's wgmma:
  persistent       min(#SMs, #tiles) programs walking tiles vs one program per tile
  split_n/split_m  the tile as two halves with their own accumulators: both halves' dots issued, then
                   both FMAs, so half 1's MMA could run while half 0 is promoted
  pipeline         block ki+1's dot issued before block ki's FMA (its partial kept in registers)
  num_stages, maxnreg  fewer shared-memory stages, a register cap: more CTAs per SM, so one CTA's
                   FMAs overlap another's MMAs
  gluon_wait1      a Gluon kernel (cp.async ring, async wgmma) that issues block kb's MMA, waits with
                   `wgmma.wait_group 1` for block kb-1's only, and promotes kb-1 while kb's MMA runs
Built for sm_90 (tests/ops/test_fp8_variants_interpret.py), Triton 3.6 puts `wgmma.wait_group 0`
right after every tl.dot in split and pipeline alike: it keeps a wgmma in flight only when its result
feeds another dot's accumulator, never an FMA. Those two variants are timed to confirm that on the
H200; the overlap within a CTA needs the Gluon kernel. tl.range(..., warp_specialize=True) on the K
loop compiles to the very same PTX as without it on sm_90, so it is not a variant.
fma=False (acc + partial * s, two roundings) is the negative control of the bit checks.
Per variant: median microseconds at training shapes, and whether its bits equal the shipped kernel's.
(Earlier runs: scales loaded before the dot and fma vs mul+add moved nothing at 64x128; 128x256 was
2-3x slower; both are in this file's git history.)
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.results import environment, kernel_us, save_json  # noqa: E402
from onepath.ops.cuda.linear import tile_coords, sm_count  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 6144, 2048), (8192, 2048, 8192)]  # (M, N, K)
# the Gluon kernel's masks and K tail have no interpreter check: its bits are also compared here
# (K a multiple of 16, as that kernel needs; the last K block still ragged)
AWKWARD = [(1, 200, 208), (37, 72, 384), (130, 200, 208)]


@triton.jit
def _partial(a_ptr, w_ptr, rows, row_ok, cols, ki, K, stride_am, stride_wn, BLOCK_K: tl.constexpr):
    """The fresh FP32 tensor-core partial of K block ki: rows x cols over its 128 K values."""
    offs_k = ki * BLOCK_K + tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :],
                mask=row_ok[:, None] & (offs_k[None, :] < K), other=0.0)
    b = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None], mask=offs_k[:, None] < K, other=0.0)
    return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def _promote(partial, acc, sa_ptr, sw_ptr, rows, row_ok, cols, ki, stride_sam, stride_swn,
             W_BLOCK_N: tl.constexpr, FMA: tl.constexpr):
    sa = tl.load(sa_ptr + rows * stride_sam + ki, mask=row_ok, other=1.0)
    sw = tl.load(sw_ptr + (cols // W_BLOCK_N) * stride_swn + ki)
    if FMA:
        return tl.fma(partial, sa[:, None] * sw[None, :], acc)
    return acc + partial * (sa[:, None] * sw[None, :])


@triton.jit
def _store(out_ptr, acc, offs_m, offs_n, M, N, stride_om):
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M", "NUM_PROGRAMS"])
def _variant_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr, M, N, K, stride_am, stride_sam, stride_wn, stride_swn,
                    stride_om, W_BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS, SPLIT_M: tl.constexpr,
                    SPLIT_N: tl.constexpr, PIPELINE: tl.constexpr, FMA: tl.constexpr):
    # Every element's chain is the shipped kernel's whatever the switches: one fresh dot per K block
    # over the same 128 K values, then one FMA into its own accumulator, K blocks in ascending order.
    # The switches only reorder independent work: SPLIT_* make two chains (the two halves of the
    # tile), PIPELINE issues block ki+1's dot before block ki's FMA. (Triton 3.6 still waits for each
    # dot right after issuing it: see the module docstring.)
    HALF_M: tl.constexpr = BLOCK_M // SPLIT_M
    HALF_N: tl.constexpr = BLOCK_N // SPLIT_N
    TWO: tl.constexpr = SPLIT_M * SPLIT_N == 2
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m0 = pid_m * BLOCK_M + tl.arange(0, HALF_M)
        offs_n0 = pid_n * BLOCK_N + tl.arange(0, HALF_N)
        offs_m1 = offs_m0 + (HALF_M if SPLIT_M == 2 else 0)
        offs_n1 = offs_n0 + (HALF_N if SPLIT_N == 2 else 0)
        rows0, rows1 = tl.where(offs_m0 < M, offs_m0, 0), tl.where(offs_m1 < M, offs_m1, 0)
        row_ok0, row_ok1 = offs_m0 < M, offs_m1 < M
        cols0, cols1 = tl.where(offs_n0 < N, offs_n0, 0), tl.where(offs_n1 < N, offs_n1, 0)
        acc0 = tl.zeros((HALF_M, HALF_N), dtype=tl.float32)
        acc1 = tl.zeros((HALF_M, HALF_N), dtype=tl.float32)
        if PIPELINE:
            p0 = _partial(a_ptr, w_ptr, rows0, row_ok0, cols0, 0, K, stride_am, stride_wn, BLOCK_K)
            if TWO:
                p1 = _partial(a_ptr, w_ptr, rows1, row_ok1, cols1, 0, K, stride_am, stride_wn, BLOCK_K)
            for ki in range(1, k_tiles):
                next0 = _partial(a_ptr, w_ptr, rows0, row_ok0, cols0, ki, K, stride_am, stride_wn, BLOCK_K)
                if TWO:
                    next1 = _partial(a_ptr, w_ptr, rows1, row_ok1, cols1, ki, K, stride_am, stride_wn, BLOCK_K)
                acc0 = _promote(p0, acc0, sa_ptr, sw_ptr, rows0, row_ok0, cols0, ki - 1, stride_sam, stride_swn,
                                W_BLOCK_N, FMA)
                if TWO:
                    acc1 = _promote(p1, acc1, sa_ptr, sw_ptr, rows1, row_ok1, cols1, ki - 1, stride_sam, stride_swn,
                                    W_BLOCK_N, FMA)
                    p1 = next1
                p0 = next0
            acc0 = _promote(p0, acc0, sa_ptr, sw_ptr, rows0, row_ok0, cols0, k_tiles - 1, stride_sam, stride_swn,
                            W_BLOCK_N, FMA)
            if TWO:
                acc1 = _promote(p1, acc1, sa_ptr, sw_ptr, rows1, row_ok1, cols1, k_tiles - 1, stride_sam, stride_swn,
                                W_BLOCK_N, FMA)
        else:
            for ki in range(k_tiles):
                p0 = _partial(a_ptr, w_ptr, rows0, row_ok0, cols0, ki, K, stride_am, stride_wn, BLOCK_K)
                if TWO:
                    p1 = _partial(a_ptr, w_ptr, rows1, row_ok1, cols1, ki, K, stride_am, stride_wn, BLOCK_K)
                acc0 = _promote(p0, acc0, sa_ptr, sw_ptr, rows0, row_ok0, cols0, ki, stride_sam, stride_swn,
                                W_BLOCK_N, FMA)
                if TWO:
                    acc1 = _promote(p1, acc1, sa_ptr, sw_ptr, rows1, row_ok1, cols1, ki, stride_sam, stride_swn,
                                    W_BLOCK_N, FMA)
        _store(out_ptr, acc0, offs_m0, offs_n0, M, N, stride_om)
        if TWO:
            _store(out_ptr, acc1, offs_m1, offs_n1, M, N, stride_om)


@gluon.jit(do_not_specialize=["M"])
def _wait1_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr, M, N, K, stride_am, stride_sam, stride_wn, stride_swn,
                  stride_om, W_BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
    # The overlap Triton does not emit (it waits for every wgmma whose result is not a dot's accumulator):
    # block kb's wgmma is issued async, then `wgmma.wait_group 1` lets block kb-1's partial be promoted
    # while kb's MMA runs. Per element the chain is unchanged: fresh partial per K block, one FMA, ascending K.
    load_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])
    # warpgroups side by side along N: 8 warps halve each thread's share of the three live 64x128 tiles
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4],
                                                         instr_shape=[16, BLOCK_N // (NUM_WARPS // 4), 32])
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], smem_layout)
    w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], smem_layout)

    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    tile_id = gl.program_id(0)
    first_pid_m = (tile_id // (GROUP_M * num_pid_n)) * GROUP_M
    group_size_m = gl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % (GROUP_M * num_pid_n)) // group_size_m
    k_tiles = gl.cdiv(K, BLOCK_K)

    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, load_layout))
    load_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, load_layout))
    load_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, load_layout))
    a_ptrs = a_ptr + gl.expand_dims(gl.where(load_m < M, load_m, 0).to(gl.int64) * stride_am, 1) \
        + gl.expand_dims(offs_k, 0)
    w_ptrs = w_ptr + gl.expand_dims(gl.where(load_n < N, load_n, 0).to(gl.int64) * stride_wn, 1) \
        + gl.expand_dims(offs_k, 0)
    a_row_ok = gl.expand_dims(load_m < M, 1)

    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
    row_ok = offs_m < M
    sa_ptrs = sa_ptr + gl.where(row_ok, offs_m, 0) * stride_sam
    sw_ptrs = sw_ptr + (gl.where(offs_n < N, offs_n, 0) // W_BLOCK_N) * stride_swn

    for kb in gl.static_range(STAGES - 1):  # prologue: blocks 0..STAGES-2 in flight
        k_ok = gl.expand_dims(offs_k < K - kb * BLOCK_K, 0)
        async_copy.async_copy_global_to_shared(a_smem.index(kb), a_ptrs + kb * BLOCK_K, mask=a_row_ok & k_ok)
        async_copy.async_copy_global_to_shared(w_smem.index(kb), w_ptrs + kb * BLOCK_K, mask=k_ok)
        async_copy.commit_group()

    zero = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma_layout)
    acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma_layout)
    partial = zero
    pending = warpgroup_mma_init(zero)
    for kb in range(k_tiles):
        s = kb % STAGES
        async_copy.wait_group(STAGES - 2)  # block kb landed
        fence_async_shared()
        gl.thread_barrier()
        pending_next = warpgroup_mma(a_smem.index(s), w_smem.index(s).permute((1, 0)), zero, use_acc=False,
                                     is_async=True)
        # block kb-1's MMA done (kb's may run on): its stage is free and its partial readable
        partial = warpgroup_mma_wait(1, deps=[pending])
        gl.thread_barrier()  # every warp's share of block kb-1's MMA is done before its stage is reloaded
        nxt = kb + STAGES - 1
        k_ok = gl.expand_dims(offs_k < K - nxt * BLOCK_K, 0) & (nxt < k_tiles)
        async_copy.async_copy_global_to_shared(a_smem.index(nxt % STAGES), a_ptrs + nxt * BLOCK_K,
                                               mask=a_row_ok & k_ok)
        async_copy.async_copy_global_to_shared(w_smem.index(nxt % STAGES), w_ptrs + nxt * BLOCK_K, mask=k_ok)
        async_copy.commit_group()
        if kb > 0:
            sa = gl.load(sa_ptrs + (kb - 1), mask=row_ok, other=1.0)
            sw = gl.load(sw_ptrs + (kb - 1))
            acc = gl.fma(partial, gl.expand_dims(sa, 1) * gl.expand_dims(sw, 0), acc)
        pending = pending_next
    partial = warpgroup_mma_wait(0, deps=[pending])
    async_copy.wait_group(0)
    sa = gl.load(sa_ptrs + (k_tiles - 1), mask=row_ok, other=1.0)
    sw = gl.load(sw_ptrs + (k_tiles - 1))
    acc = gl.fma(partial, gl.expand_dims(sa, 1) * gl.expand_dims(sw, 0), acc)

    out_ptrs = out_ptr + gl.expand_dims(offs_m.to(gl.int64) * stride_om, 1) + gl.expand_dims(offs_n, 0)
    gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=gl.expand_dims(row_ok, 1) & gl.expand_dims(offs_n < N, 0))


@dataclass(frozen=True)
class Variant:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    persistent: bool = False
    split_m: int = 1
    split_n: int = 1
    pipeline: bool = False
    maxnreg: int | None = None
    wait1: bool = False  # the Gluon kernel: wgmma.wait_group 1, MMA of block kb under the FMA of kb-1
    fma: bool = True

    def __str__(self) -> str:
        flags = [f for f, on in (("persistent", self.persistent), (f"split_m{self.split_m}", self.split_m > 1),
                                 (f"split_n{self.split_n}", self.split_n > 1), ("pipeline", self.pipeline),
                                 (f"maxnreg{self.maxnreg}", self.maxnreg), ("gluon_wait1", self.wait1),
                                 ("mul_add", not self.fma)) if on]
        return "+".join([f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}", *flags])

    def consts(self) -> dict:
        if self.wait1:
            return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=128, GROUP_M=8, STAGES=self.num_stages,
                        NUM_WARPS=self.num_warps)
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=128, GROUP_M=8, SPLIT_M=self.split_m,
                    SPLIT_N=self.split_n, PIPELINE=self.pipeline, FMA=self.fma)


def variants() -> list[Variant]:
    """The promising tiles (64x128 four warps, 128x128 eight) as shipped, persistent and with the
    MMA/FMA overlaps; SPLIT_M only where a half keeps wgmma's 64 rows; fewer stages and a register
    cap (168: three 4-warp CTAs per SM instead of two, a few hundred bytes spilled) for occupancy,
    the one overlap of one CTA's FMAs with another's MMAs that Triton 3.6 leaves to the hardware;
    last the Gluon kernel, whose MMA runs under the same CTA's FMAs (8 warps at 64x128: no spills)."""
    small, big = (64, 128, 4, 4), (128, 128, 8, 3)
    return [Variant(*small), Variant(*small, persistent=True), Variant(*small, split_n=2),
            Variant(*small, pipeline=True), Variant(*small, split_n=2, pipeline=True),
            Variant(64, 128, 4, 3), Variant(64, 128, 4, 2), Variant(64, 128, 4, 2, maxnreg=168),
            Variant(*big), Variant(*big, persistent=True), Variant(*big, split_n=2), Variant(*big, split_m=2),
            Variant(*big, pipeline=True),
            Variant(*small, wait1=True), Variant(64, 128, 8, 4, wait1=True), Variant(64, 64, 4, 4, wait1=True),
            Variant(*big, wait1=True)]


def run_variant(qa, qw, v: Variant, out_dtype=torch.bfloat16):
    a, w = qa.codes, qw.codes
    (m, k), n = a.shape, w.shape[0]
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    tiles = triton.cdiv(m, v.block_m) * triton.cdiv(n, v.block_n)
    programs = min(sm_count(a.device), tiles) if v.persistent else tiles
    sa, sw = qa.scales.reshape(m, -1).contiguous(), qw.scales.contiguous()
    if v.wait1:
        if k % 16:
            raise ValueError(f"{v}: K={k} is not a multiple of 16; its cp.async copies 16-byte pieces of rows")
        _wait1_kernel[(tiles,)](a, sa, w, sw, out, m, n, k, a.stride(0), sa.stride(0), w.stride(0), sw.stride(0),
                                out.stride(0), W_BLOCK_N=qw.block[0], **v.consts(), num_warps=v.num_warps,
                                maxnreg=v.maxnreg)
        return out
    _variant_kernel[(programs,)](a, sa, w, sw, out, m, n, k, a.stride(0), sa.stride(0), w.stride(0), sw.stride(0),
                                 out.stride(0), W_BLOCK_N=qw.block[0], NUM_PROGRAMS=programs, **v.consts(),
                                 num_warps=v.num_warps, num_stages=v.num_stages, maxnreg=v.maxnreg)
    return out


def run(args) -> None:
    from onepath.numerics.quant import quantize_fp8
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT
    from onepath.ops.cuda.linear import linear
    from onepath.ops.cuda.linear_fp8 import linear_fp8, pick_config

    def triton_fp8(qa, qw, **kw):
        """The Triton kernel at its tile ("shipped" below): linear_fp8 alone picks the warp-specialized
        kernel on Hopper (ops/cuda/linear_fp8_ws.py, lab/fp8_gluon.py)."""
        tile = pick_config(qa.codes.shape[0], qw.codes.shape[0], sm_count(qa.codes.device))
        return linear_fp8(qa, qw, config=tile, **kw)

    t = lambda fn: kernel_us(fn, args.rep_ms)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = []
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
        qa, qw = quantize_fp8(x, FP8_ACT), quantize_fp8(w, FP8_WEIGHT)
        base = dict(M=m, N=n, K=k, bf16_ours_us=t(lambda: linear(x, w)), shipped_us=t(lambda: triton_fp8(qa, qw)))
        print(f"M={m} N={n} K={k}: bf16 ours {base['bf16_ours_us']:.0f} us, shipped fp8 {base['shipped_us']:.0f} us",
              flush=True)
        shapes.append((qa, qw, triton_fp8(qa, qw), base))
    awkward = []
    for m, n, k in AWKWARD:
        qa = quantize_fp8(torch.randn(m, k, device="cuda", generator=gen).bfloat16(), FP8_ACT)
        qw = quantize_fp8((torch.randn(n, k, device="cuda", generator=gen) * 0.05).bfloat16(), FP8_WEIGHT)
        awkward.append((qa, qw, triton_fp8(qa, qw, out_dtype=torch.float32)))
    result = dict(environment("cuda"), command="python " + " ".join(sys.argv), rows=[])
    # variant-major, the Gluon kernels last: a variant that faults the CUDA context costs only those after it
    for v in variants():
        same_awkward = None
        if v.wait1:
            try:
                same_awkward = all(torch.equal(run_variant(qa, qw, v, out_dtype=torch.float32), want)
                                   for qa, qw, want in awkward)
            except Exception as e:  # noqa: BLE001 -- recorded with the timing rows' errors
                same_awkward = f"{type(e).__name__}: {str(e)[:200]}"
        for qa, qw, shipped, base in shapes:
            row = dict(base, variant=str(v), **asdict(v))
            if same_awkward is not None:
                row["same_bits_as_shipped_awkward_shapes"] = same_awkward
            m, n, k = base["M"], base["N"], base["K"]
            try:
                y = run_variant(qa, qw, v)
                row["same_bits_as_shipped"] = torch.equal(y, shipped)
                row["us"] = t(lambda: run_variant(qa, qw, v))
                row["vs_bf16_ours"] = base["bf16_ours_us"] / row["us"]
                row["tflops"] = 2.0 * m * n * k / row["us"] * 1e-6
                print(f"  M={m} N={n} K={k} {v}: {row['us']:.0f} us ({row['vs_bf16_ours']:.2f}x bf16, "
                      f"{row['tflops']:.0f} TF/s) same bits {row['same_bits_as_shipped']}", flush=True)
            except Exception as e:  # noqa: BLE001 -- a variant that does not compile is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"  M={m} N={n} K={k} {v}: {row['error']}", flush=True)
            result["rows"].append(row)
            save_json(result, Path(args.out))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="lab/results/fp8-variants.json")
    p.add_argument("--rep-ms", type=int, default=30)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("fp8_variants: no CUDA device, nothing to time")
        return
    run(args)


if __name__ == "__main__":
    main()
