"""Sustained GEMM throughput with the SM clock and board power it runs at, one training shape.

    python lab/gemm_power.py [--out lab/results/gemm-power.json] [--seconds 3] [--ws-variant NAME ...]

Each kernel's CUDA graph of back-to-back launches is replayed for --seconds (after a warm-up of the same length)
while nvidia-smi samples the SM clock and the board power every 100 ms. Per kernel: TFLOP/s, the median clock
and power, TFLOP/s per GHz (work per cycle, whatever the clock) and per kW. The kernels: our BF16 GEMM, cuBLAS
BF16, our block-FP8 GEMM (WS_CONFIG, then each --ws-variant: lab/fp8_gluon.py names) and cuBLAS FP8 with one
scale per tensor (torch._scaled_mm: no 128-wide scale blocks, no promotion; a ceiling for FP8 on this GPU, not
a kernel the contract can take). Without CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.results import environment, print_table, save_json  # noqa: E402

LAUNCHES = 10  # GEMMs per graph replay


def _sampler() -> subprocess.Popen | None:
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    gpu = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    try:
        return subprocess.Popen(["nvidia-smi", "-i", gpu, "--query-gpu=clocks.sm,power.draw",
                                 "--format=csv,noheader,nounits", "-lms", "100"], stdout=subprocess.PIPE, text=True)
    except FileNotFoundError:
        return None


def _samples(proc: subprocess.Popen | None) -> tuple[list[float], list[float]]:
    if proc is None:
        return [], []
    proc.terminate()
    rows = [line.split(",") for line in proc.communicate()[0].splitlines() if line.count(",") == 1]
    return [float(mhz) for mhz, _ in rows], [float(watts) for _, watts in rows]


def sustained(fn, seconds: float) -> dict:
    """fn replayed back to back for `seconds`: microseconds a call, median SM clock (MHz) and power (W)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES):
            fn()

    def replay_for(duration: float) -> tuple[int, float]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        replays, t0 = 0, time.monotonic()
        start.record()
        while time.monotonic() - t0 < duration:
            graph.replay()
            replays += 1
            if replays % 8 == 0:  # keep a few replays queued, not seconds of them
                torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
        return replays, start.elapsed_time(end)

    replay_for(seconds)  # warm-up: clocks and power settle
    proc = _sampler()
    replays, ms = replay_for(seconds)
    mhz, watts = _samples(proc)
    return dict(us=ms * 1e3 / (replays * LAUNCHES), sm_mhz=statistics.median(mhz) if mhz else None,
                power_w=statistics.median(watts) if watts else None, samples=len(mhz))


def kernels(m: int, n: int, k: int, variants: list[str]) -> dict:
    """name -> a call of that GEMM at M, N, K on fresh operands (quantised here, not in the calls): our BF16 GEMM,
    cuBLAS BF16, our block-FP8 GEMM (WS_CONFIG, then each of variants: lab/fp8_gluon.py names), cuBLAS FP8 with
    one scale per tensor."""
    from onepath.bench.kernels_fp8 import named_variants
    from onepath.numerics.quant import quantize_fp8 as quantize_reference
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT
    from onepath.ops.cuda.linear import linear
    from onepath.ops.cuda.linear_fp8 import WS_CONFIG, linear_fp8
    from onepath.ops.cuda.quant import quantize_fp8

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
    qa, qw = quantize_fp8(x, FP8_ACT), quantize_reference(w, FP8_WEIGHT)
    one = torch.ones((), device="cuda")
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    calls = {"bf16 ours": lambda: linear(x, w), "bf16 cuBLAS": lambda: torch.nn.functional.linear(x, w)}
    for config in dict.fromkeys([WS_CONFIG, *named_variants(variants)]):
        calls[f"fp8 ours {config}"] = lambda config=config: linear_fp8(qa, qw, config=config)
    calls["fp8 cuBLAS per-tensor"] = lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                                              out_dtype=torch.bfloat16)
    return calls


def run(args) -> dict:
    m, n, k = args.shape
    rows = []
    for name, fn in kernels(m, n, k, args.ws_variant or []).items():
        row = dict(kernel=name, **sustained(fn, args.seconds))
        row["tflops"] = 2.0 * m * n * k / row["us"] * 1e-6
        row["tflops_per_ghz"] = row["tflops"] / (row["sm_mhz"] / 1e3) if row["sm_mhz"] else None
        row["tflops_per_kw"] = row["tflops"] / (row["power_w"] / 1e3) if row["power_w"] else None
        rows.append(row)
        print(f"{name}: {row['tflops']:.0f} TF/s at {row['sm_mhz']} MHz, {row['power_w']} W", flush=True)
    print_table(f"Sustained GEMMs at M={m} N={n} K={k} ({args.seconds:.0f} s each)",
                ["kernel", "us", "TF/s", "SM MHz", "W", "TF/s per GHz", "TF/s per kW"],
                [[r["kernel"], r["us"], r["tflops"], r["sm_mhz"], r["power_w"], r["tflops_per_ghz"], r["tflops_per_kw"]]
                 for r in rows])
    return dict(environment("cuda"), command="python " + " ".join(sys.argv), M=m, N=n, K=k, rows=rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="lab/results/gemm-power.json")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--shape", type=int, nargs=3, default=[8192, 4096, 4096], metavar=("M", "N", "K"))
    p.add_argument("--ws-variant", nargs="+", help="more block-FP8 configs to time (lab/fp8_gluon.py names)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gemm_power: no CUDA device, nothing to time")
        return
    save_json(run(args), Path(args.out))


if __name__ == "__main__":
    main()
