"""Time onepath.ops.cuda.matmul against cuBLAS (F.linear) over decode to prefill M.

    python bench/kernels_matmul.py [--out bench/results/kernels-matmul.json] [--sweep]

Per (shape, M): median microseconds of both (triton.testing.do_bench, L2 flushed between calls, as
a decode step reads each layer's weight from HBM), TFLOP/s, GB/s of the bytes a call must move,
and speed vs cuBLAS (cuBLAS time / ours). --sweep also times every candidate tile config (pointer
and TMA loads) and records whether its bits equal the default's: the data for choosing the table.
Without CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.results import KERNEL_TIMING, environment, kernel_us, save_json  # noqa: E402

# (name, K, N, out_dtype): the MLP and attention projections of the target models, and an LM head.
SHAPES = [
    ("square 4096x4096", 4096, 4096, torch.bfloat16),
    ("qwen mlp 1024->3072", 1024, 3072, torch.bfloat16),
    ("qwen3 o_proj 2048->1024", 2048, 1024, torch.bfloat16),
    ("llama mlp 4096->11008", 4096, 11008, torch.bfloat16),
    ("qwen3 lm head 1024->151936 fp32", 1024, 151936, torch.float32),
]
MS = [1, 16, 64, 128, 256, 1024, 4096, 8192]
SWEEP_MS = [1, 64, 256, 1024, 8192]
CEILINGS = {"bf16_gemm_tflops_cublas_8192": 789, "device_copy_tb_s": 4.2}


def _baseline(out_dtype):
    """cuBLAS with the same output dtype where torch has it (mm.dtype), else F.linear's bf16."""
    if out_dtype == torch.float32:
        try:
            a = torch.ones(2, 16, device="cuda", dtype=torch.bfloat16)
            torch.mm(a, a.T, out_dtype=torch.float32)
            return "torch.mm(out_dtype=float32)", lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    return "F.linear", lambda x, w: F.linear(x, w)


GRAPH = False  # --graph: time CUDA-graph replays (no Python launch cost; L2 not flushed)


def _time_us(fn, rep_ms):
    return kernel_us(fn, rep_ms, graph=GRAPH)


def _sweep_configs():
    """The shipped tiles, other wgmma tiles (narrower N: more programs at decode, where N / BLOCK_N programs
    are all there are), and mma.sync tiles whose warps hold 16 whole rows (as the attention's decode program,
    which keeps the 64-row program's bits): the sweep's same_bits_as_default says whether each may join."""
    from onepath.ops.cuda.matmul import TILES_16BIT, TileConfig

    extra = [TileConfig(128, 64, 4, 4), TileConfig(64, 256, 8, 3), TileConfig(128, 256, 8, 4),
             TileConfig(128, 128, 4, 4), TileConfig(64, 64, 4, 6), TileConfig(64, 32, 4, 8),
             TileConfig(64, 16, 4, 8), TileConfig(16, 32, 1, 6), TileConfig(16, 64, 1, 4), TileConfig(32, 32, 2, 6)]
    base = [*TILES_16BIT, *extra]
    return base + [TileConfig(c.block_m, c.block_n, c.num_warps, c.num_stages, c.group_m, tma=True) for c in base]


def run(args) -> dict:
    from onepath.ops.cuda.matmul import matmul, pick_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, sweep = [], []
    head = f"{'shape':34s} {'M':>5s} {'config':>14s} {'ours us':>9s} {'cuBLAS us':>9s} {'speed':>6s} " \
           f"{'ours TF/s':>9s} {'cuBLAS TF/s':>11s} {'ours GB/s':>9s}"
    print(head)
    for name, k, n, out_dtype in SHAPES:
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
        base_name, base_fn = _baseline(out_dtype)
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            cfg = pick_config(m, n, torch.bfloat16, sms, out_dtype)
            flops = 2.0 * m * n * k
            moved = 2 * (m * k + n * k) + m * n * torch.finfo(out_dtype).bits // 8
            ours = _time_us(lambda: matmul(x, w, out_dtype=out_dtype), args.rep_ms)
            cublas = _time_us(lambda: base_fn(x, w), args.rep_ms)
            row = dict(shape=name, K=k, N=n, M=m, out_dtype=str(out_dtype), config=dataclasses.asdict(cfg),
                       ours_us=ours, cublas_us=cublas, baseline=base_name, speed_vs_cublas=cublas / ours,
                       ours_tflops=flops / ours * 1e-6, cublas_tflops=flops / cublas * 1e-6,
                       ours_gb_s=moved / ours * 1e-3, cublas_gb_s=moved / cublas * 1e-3)
            rows.append(row)
            tile = f"{cfg.block_m}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}"
            print(f"{name:34s} {m:5d} {tile:>14s} {ours:9.1f} {cublas:9.1f} {cublas / ours:6.2f} "
                  f"{row['ours_tflops']:9.1f} {row['cublas_tflops']:11.1f} {row['ours_gb_s']:9.0f}", flush=True)
            if args.sweep and m in SWEEP_MS:
                ref = matmul(x, w, out_dtype=out_dtype)
                for c in _sweep_configs():
                    entry = dict(shape=name, K=k, N=n, M=m, config=dataclasses.asdict(c))
                    try:
                        entry["same_bits_as_default"] = torch.equal(matmul(x, w, out_dtype=out_dtype, config=c), ref)
                        entry["us"] = _time_us(lambda: matmul(x, w, out_dtype=out_dtype, config=c), args.rep_ms)
                        entry["speed_vs_cublas"] = cublas / entry["us"]
                    except Exception as e:  # noqa: BLE001 -- a config that does not compile is a result
                        entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    sweep.append(entry)
                here = [e for e in sweep if e["M"] == m and e["shape"] == name]
                timed = [e for e in here if "us" in e]
                if timed:
                    best = min(timed, key=lambda e: e["us"])
                    c = best["config"]
                    print(f"{'':34s} {'':5s} sweep: best {c['block_m']}x{c['block_n']}w{c['num_warps']}s"
                          f"{c['num_stages']}{' tma' if c['tma'] else ''} {best['us']:.1f} us, "
                          f"{len(timed)}/{len(here)} compiled, all same bits: "
                          f"{all(e['same_bits_as_default'] for e in timed)}", flush=True)
            del x
        del w
        torch.cuda.empty_cache()
    return dict(
        environment("cuda"), sms=sms, command="python " + " ".join(sys.argv),
        timing="do_bench_cudagraph median (graph replay, L2 not flushed)" if GRAPH else KERNEL_TIMING,
        ceilings=CEILINGS, rows=rows, sweep=sweep,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/kernels-matmul.json")
    p.add_argument("--sweep", action="store_true", help="also time every candidate tile config")
    p.add_argument("--ms", type=int, nargs="+", default=MS)
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench time budget per measurement")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays: the kernel without launch cost")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("kernels_matmul: no CUDA device here; nothing timed (run it on the GPU machine)")
        return
    global GRAPH
    GRAPH = args.graph
    save_json(run(args), Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
