"""Time the block-FP8 W8A8 path against our BF16 GEMM and cuBLAS BF16, at training and decode shapes.

    python bench/kernels_fp8.py [--out bench/results/linear/kernels-fp8.json]

Per (shape, M), median microseconds (triton.testing.do_bench, L2 flushed; --graph: CUDA graph replays, the
kernels without the host's launch cost, which bounds the eager times of the small ones):
  bf16_ours      onepath.ops.cuda.linear.linear (the consistent BF16 GEMM)
  bf16_cublas    F.linear
  fp8_gemm       onepath.ops.cuda.linear_fp8.linear_fp8 on operands quantised beforehand, by the kernel it
                 picks for the shape (fp8_kernel: a Triton tile, or the warp-specialized Gluon kernel from
                 WS_MIN_ROWS rows on)
  fp8_triton     the Triton kernel forced, at its tile for the shape
  fp8_ws         the warp-specialized kernel forced (WS_CONFIG, or the first --ws-variant: a config of variants()
                 by name; Hopper only)
  ws_variants    with --ws-variant A B ...: each named variant, timed in turn on the same operands right after
                 fp8_ws (variants compared under one clock and power state; the summary's geometric mean each)
  fp8_quant_act  onepath.ops.cuda.quant.quantize_fp8 of the activation (1x128 groups)
  fp8_linear     quantize_fp8 + linear_fp8: what a W8A8 linear with a cached FP8 weight costs
fp8_triton against fp8_ws over M is what WS_MIN_ROWS is set from: the summary's ws_from_m, per shape the
least M from which the ws kernel is the faster at that M and every larger one measured.
The target: fp8_gemm >= 1.6x bf16_ours at training shapes (M >= 4096; N, K in 2048..11008).
Without CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from onepath.bench.results import KERNEL_TIMING, environment, kernel_us, save_json

# (name, K, N): square and MLP projections of the target models
SHAPES = [("square 4096x4096", 4096, 4096), ("mlp 2048->6144", 2048, 6144), ("mlp 4096->11008", 4096, 11008),
          ("down 8192->2048", 8192, 2048)]
TRAIN_MS = [4096, 8192]
PREFILL_MS = [512, 1024, 2048]  # around WS_MIN_ROWS
DECODE_MS = [1, 64, 256]
TARGET_TRAIN = 1.6


def run(args) -> dict:
    from onepath.numerics.quant import quantize_fp8 as quantize_reference
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT
    from onepath.ops.cuda.linear import linear
    from onepath.ops.cuda.linear_fp8 import WS_CONFIG, WS_MIN_ROWS, is_hopper, linear_fp8, pick_config, pick_kernel
    from onepath.ops.cuda.quant import quantize_fp8

    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'shape':20s} {'M':>5s} {'fp8 kernel':24s} {'bf16 ours':>10s} {'cuBLAS':>8s} {'fp8 gemm':>9s} "
          f"{'triton':>8s} {'ws':>8s} {'quant':>7s} {'fp8/bf16':>8s} {'fp8 TF/s':>8s} {'bf16 TF/s':>9s}")
    hopper = is_hopper(device)
    named = named_variants(args.ws_variant or [])
    ws = named[0] if named else WS_CONFIG
    timed = named if hopper else []  # the ws kernel runs on Hopper only
    for name, k, n in SHAPES:
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
        qw = quantize_reference(w, FP8_WEIGHT)
        for m in args.ms or [*DECODE_MS, *PREFILL_MS, *TRAIN_MS]:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            qa = quantize_fp8(x, FP8_ACT)
            flops = 2.0 * m * n * k
            tile = pick_config(m, n, sms)
            t = dict(bf16_ours=kernel_us(lambda: linear(x, w), args.rep_ms, args.graph),
                     bf16_cublas=kernel_us(lambda: F.linear(x, w), args.rep_ms, args.graph),
                     fp8_gemm=kernel_us(lambda: linear_fp8(qa, qw), args.rep_ms, args.graph),
                     fp8_triton=kernel_us(lambda: linear_fp8(qa, qw, config=tile), args.rep_ms, args.graph),
                     fp8_ws=kernel_us(lambda: linear_fp8(qa, qw, config=ws), args.rep_ms, args.graph)
                     if hopper else None,
                     ws_variants={str(v): kernel_us(lambda: linear_fp8(qa, qw, config=v), args.rep_ms, args.graph)
                                  for v in timed[1:]},
                     fp8_quant_act=kernel_us(lambda: quantize_fp8(x, FP8_ACT), args.rep_ms, args.graph),
                     fp8_linear=kernel_us(lambda: linear_fp8(quantize_fp8(x, FP8_ACT), qw), args.rep_ms, args.graph))
            row = dict(shape=name, K=k, N=n, M=m,
                       phase="train" if m in TRAIN_MS else "prefill" if m in PREFILL_MS else "decode",
                       fp8_kernel=kernel_name(pick_kernel(m, n, k, torch.bfloat16, device)),
                       **{f"{key}_us": v for key, v in t.items() if key != "ws_variants"},
                       ws_variants_us={str(ws): t["fp8_ws"], **t["ws_variants"]} if timed else {},
                       fp8_gemm_vs_bf16_ours=t["bf16_ours"] / t["fp8_gemm"],
                       fp8_linear_vs_bf16_ours=t["bf16_ours"] / t["fp8_linear"],
                       fp8_gemm_tflops=flops / t["fp8_gemm"] * 1e-6, bf16_ours_tflops=flops / t["bf16_ours"] * 1e-6,
                       bf16_cublas_tflops=flops / t["bf16_cublas"] * 1e-6)
            rows.append(row)
            print(f"{name:20s} {m:5d} {row['fp8_kernel']:24s} {t['bf16_ours']:10.1f} {t['bf16_cublas']:8.1f} "
                  f"{t['fp8_gemm']:9.1f} {t['fp8_triton']:8.1f} {t['fp8_ws'] or float('nan'):8.1f} "
                  f"{t['fp8_quant_act']:7.1f} {row['fp8_gemm_vs_bf16_ours']:8.2f} {row['fp8_gemm_tflops']:8.0f} "
                  f"{row['bf16_ours_tflops']:9.0f}", flush=True)
            for v, us in row["ws_variants_us"].items():
                print(f"{'':26s} {v:40s} {us:8.1f} us  {t['bf16_ours'] / us:5.3f}x bf16 ours", flush=True)
        del w, qw
        torch.cuda.empty_cache()
    train = [r["fp8_gemm_vs_bf16_ours"] for r in rows if r["phase"] == "train"]
    ws_train = [r["bf16_ours_us"] / r["fp8_ws_us"] for r in rows if r["phase"] == "train" and r["fp8_ws_us"]]
    summary = dict(target_fp8_vs_bf16_train=TARGET_TRAIN, min_fp8_vs_bf16_train=min(train, default=None),
                   geomean_fp8_vs_bf16_train=geomean(train),
                   meets_target=bool(train) and min(train) >= TARGET_TRAIN, ws_config=str(ws),
                   geomean_ws_vs_bf16_train=geomean(ws_train),
                   geomean_ws_variants_vs_bf16_train={
                       v: geomean([r["bf16_ours_us"] / r["ws_variants_us"][v] for r in rows if r["phase"] == "train"])
                       for v in map(str, timed)},
                   ws_min_rows=WS_MIN_ROWS,
                   ws_from_m={name: _ws_from_m([r for r in rows if r["shape"] == name]) for name, _, _ in SHAPES})
    print(summary)
    return dict(environment("cuda"), command="python " + " ".join(sys.argv),
                timing=("CUDA graph replays (do_bench_cudagraph median, no launch cost)" if args.graph
                        else KERNEL_TIMING), rows=rows, summary=summary)


def variants() -> list:
    """BLOCK_N 128 at three ring depths (five, the shipped one, the deepest its shared memory holds with the
    A-scale stages), persistent or not, with and without the wait-1 pipeline (with it also grouped by 16); BLOCK_N
    256 (A read once for twice the columns) at the depths its shared memory allows, the shipped 4-stage one
    also with the consumers' chains in turns (pingpong, the turn passed at issue or at completion), with
    other groupings of the persistent walk (group_m: row tiles per group) and with the producer's registers
    given to the consumers (240 + 240 + 24)."""
    from onepath.ops.cuda.linear_fp8_ws import WSConfig
    return [WSConfig(128, 4), WSConfig(128, 3), WSConfig(128, 5), WSConfig(128, 4, persistent=False),
            WSConfig(128, 4, wait1=True), WSConfig(128, 3, wait1=True), WSConfig(128, 5, wait1=True),
            WSConfig(128, 4, persistent=False, wait1=True),
            WSConfig(128, 5, wait1=True, group_m=16),
            WSConfig(256, 3), WSConfig(256, 4), WSConfig(256, 4, pingpong="issued"), WSConfig(256, 4, pingpong="done"),
            WSConfig(256, 3, persistent=False), WSConfig(256, 4, group_m=4), WSConfig(256, 4, group_m=16),
            WSConfig(256, 4, consumer_regs=240, producer_regs=24)]


def decode_variants() -> list:
    """Split "n" (64-row tiles, the consumers side by side in N) for M <= 256, each at the deepest ring its
    shared memory allows: n64 chains (8 stages) persistent or one program per tile, and with wait1 (block
    kb's MMA under kb-1's promotion: a consumer's wgmma latency, not HBM, may bound so few CTAs); n128
    chains (4 stages); n32 chains (12 stages, twice the tiles of n64 where N is 1024-2048), with wait1."""
    from onepath.ops.cuda.linear_fp8_ws import WSConfig
    return [WSConfig(128, 8, split="n"), WSConfig(128, 8, persistent=False, split="n"),
            WSConfig(128, 8, wait1=True, split="n"), WSConfig(256, 4, split="n"),
            WSConfig(64, 12, split="n"), WSConfig(64, 12, wait1=True, split="n")]


def named_variants(names: list[str]) -> list:
    by_name = {str(v): v for v in variants()}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise SystemExit(f"--ws-variant {unknown}: not a variant of onepath/bench/kernels_fp8.py; pick from "
                         f"{sorted(by_name)}")
    return [by_name[name] for name in names]


def geomean(values: list[float]) -> float | None:
    return float(torch.tensor(values).log().mean().exp()) if values else None


def kernel_name(config) -> str:
    from onepath.ops.cuda.linear_fp8 import WSConfig
    if isinstance(config, WSConfig):
        return f"gluon {config}"
    return f"triton {config.block_m}x{config.block_n}w{config.num_warps}s{config.num_stages}"


def _ws_from_m(rows: list[dict]) -> int | None:
    """The least M from which the ws kernel beat the Triton one at that M and every larger M measured."""
    least = None
    for r in sorted(rows, key=lambda r: r["M"], reverse=True):
        if r["fp8_ws_us"] is None or r["fp8_ws_us"] >= r["fp8_triton_us"]:
            break
        least = r["M"]
    return least


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/linear/kernels-fp8.json")
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--graph", action="store_true",
                   help="time CUDA graph replays: the kernels alone, without Python's launch cost")
    p.add_argument("--ws-variant", nargs="+", help="time fp8_ws with this variants() config, e.g. "
                   "ws128x256s4+persistent+pingpong-issued (default: WS_CONFIG, the shipped one); more names: each "
                   "timed in turn after it (ws_variants)")
    p.add_argument("--ms", type=int, nargs="+", help="only these M (default: the decode, prefill and training M)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_fp8: no CUDA device, nothing to time")
        return
    save_json(run(args), Path(args.out))


if __name__ == "__main__":
    main()
