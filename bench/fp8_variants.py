"""Which formulation of the block-FP8 GEMM's K loop Triton runs fast on Hopper: the data behind
ops/cuda/matmul_fp8.py's choice.

    python bench/fp8_variants.py [--out bench/results/fp8-variants.json]

Every variant computes, per K block, a fresh tensor-core partial and promotes it in FP32 with the
scale product (the W8A8 contract). They differ in what Triton is free to overlap:
  scales_first  load the block's scales before the dot (their latency hides under the MMA)
  fma           acc = fma(partial, s, acc) (one rounding) vs acc + partial * s (two)
  persistent    min(#SMs, #tiles) programs walking tiles vs one program per tile
Per variant: median microseconds at training shapes, and whether its bits equal the shipped kernel's.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.results import environment, save_json  # noqa: E402
from onepath.ops.cuda.matmul import _tile_coords  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 6144, 2048), (8192, 2048, 8192)]  # (M, N, K)
TILES = [(128, 128, 8, 4), (128, 128, 8, 3), (128, 256, 8, 3), (64, 128, 4, 4)]  # (BLOCK_M, BLOCK_N, warps, stages)


@triton.jit(do_not_specialize=["M", "NUM_PROGRAMS"])
def _variant_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr, M, N, K, stride_am, stride_sam, stride_wn, stride_swn,
                    stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, NUM_PROGRAMS, SCALES_FIRST: tl.constexpr,
                    FMA: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.where(offs_m < M, offs_m, 0)
        row_ok = offs_m < M
        cols = tl.where(offs_n < N, offs_n, 0)
        w_blocks = cols // 128
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k_left = K - ki * BLOCK_K
            if SCALES_FIRST:
                sa = tl.load(sa_ptr + rows * stride_sam + ki, mask=row_ok, other=1.0)
                sw = tl.load(sw_ptr + w_blocks * stride_swn + ki)
            a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + (ki * BLOCK_K + offs_k)[None, :],
                        mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + (ki * BLOCK_K + offs_k)[:, None],
                        mask=offs_k[:, None] < k_left, other=0.0)
            partial = tl.dot(a, b, out_dtype=tl.float32)
            if not SCALES_FIRST:
                sa = tl.load(sa_ptr + rows * stride_sam + ki, mask=row_ok, other=1.0)
                sw = tl.load(sw_ptr + w_blocks * stride_swn + ki)
            if FMA:
                acc = tl.fma(partial, sa[:, None] * sw[None, :], acc)
            else:
                acc += partial * (sa[:, None] * sw[None, :])
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def variant(qa, qw, tile, persistent, scales_first, fma):
    a, w = qa.codes, qw.codes
    (m, k), n = a.shape, w.shape[0]
    bm, bn, warps, stages = tile
    out = torch.empty(m, n, device=a.device, dtype=torch.bfloat16)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = min(torch.cuda.get_device_properties(0).multi_processor_count, tiles) if persistent else tiles
    sa, sw = qa.scales.reshape(m, -1).contiguous(), qw.scales.contiguous()
    _variant_kernel[(programs,)](a, sa, w, sw, out, m, n, k, a.stride(0), sa.stride(0), w.stride(0), sw.stride(0),
                                 out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8,
                                 NUM_PROGRAMS=programs, SCALES_FIRST=scales_first, FMA=fma,
                                 num_warps=warps, num_stages=stages)
    return out


def run(args) -> dict:
    import triton.testing

    from onepath.numerics.quant import quantize_fp8
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT
    from onepath.ops.cuda.matmul import matmul
    from onepath.ops.cuda.matmul_fp8 import matmul_fp8

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
        qa, qw = quantize_fp8(x, FP8_ACT), quantize_fp8(w, FP8_WEIGHT)
        shipped = matmul_fp8(qa, qw)
        t = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=args.rep_ms, return_mode="median") * 1e3
        bf16 = t(lambda: matmul(x, w))
        base = dict(M=m, N=n, K=k, bf16_ours_us=bf16, shipped_us=t(lambda: matmul_fp8(qa, qw)))
        print(f"M={m} N={n} K={k}: bf16 ours {bf16:.0f} us, shipped fp8 {base['shipped_us']:.0f} us", flush=True)
        for tile, persistent, first, fma in itertools.product(TILES, (True, False), (True, False), (True, False)):
            row = dict(base, tile=list(tile), persistent=persistent, scales_first=first, fma=fma)
            try:
                y = variant(qa, qw, tile, persistent, first, fma)
                row["same_bits_as_shipped"] = torch.equal(y, shipped)
                row["us"] = t(lambda: variant(qa, qw, tile, persistent, first, fma))
                row["vs_bf16_ours"] = bf16 / row["us"]
                row["tflops"] = 2.0 * m * n * k / row["us"] * 1e-6
                print(f"  {tile} persistent={persistent} scales_first={first} fma={fma}: {row['us']:.0f} us "
                      f"({row['vs_bf16_ours']:.2f}x bf16, {row['tflops']:.0f} TF/s) same bits {row['same_bits_as_shipped']}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 -- a variant that does not compile is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"  {tile} persistent={persistent} scales_first={first} fma={fma}: {row['error']}", flush=True)
            rows.append(row)
    return dict(environment("cuda"), command="python " + " ".join(sys.argv), rows=rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/fp8-variants.json")
    p.add_argument("--rep-ms", type=int, default=30)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("fp8_variants: no CUDA device, nothing to time")
        return
    save_json(run(args), Path(args.out))


if __name__ == "__main__":
    main()
