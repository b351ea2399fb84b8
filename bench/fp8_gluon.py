"""The warp-specialized Gluon block-FP8 GEMM (onepath/ops/cuda/matmul_fp8_ws.py) across its configs: which
is fastest, and does each give the Triton kernel's bits (ops/cuda/matmul_fp8.py)?

    python bench/fp8_gluon.py [--out bench/results/fp8-gluon.json] [--only NAME|GLOB ...] [--skip ...]

The kernel, its contract and its switches (BLOCK_N 128 or 256, ring depth, persistent, wait1) are
described in matmul_fp8_ws.py; matmul_fp8 ships one config (WS_CONFIG) from WS_MIN_ROWS rows on.
Per config: bits against the Triton kernel (matmul_fp8 with its Triton tile, forced) on awkward shapes
(FP32 out; bf16 out with bias) and at training shapes, the registers and spills of its build, median
time against the Triton FP8 kernel, our BF16 GEMM and cuBLAS BF16. A config that hangs (an mbarrier
never completing) ends the run after --hang-s with the results so far saved.
tests/ops/test_fp8_gluon_build.py builds every config for sm_90 on a CPU machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from dataclasses import asdict
from fnmatch import fnmatch
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.results import KERNEL_TIMING, environment, kernel_us, print_table, save_json  # noqa: E402
from onepath.ops.cuda.matmul_fp8_ws import WSConfig, launch, output  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 6144, 2048), (8192, 2048, 8192), (8192, 11008, 4096), (4096, 2048, 8192)]
AWKWARD = [(1, 200, 208), (37, 72, 384), (130, 200, 208), (300, 1000, 1000)]  # (M, N, K)


def variants() -> list[WSConfig]:
    """BLOCK_N 128 at three ring depths, persistent or not, with and without the wait-1 pipeline; BLOCK_N
    256 (A read once for twice the columns) at the depths its shared memory allows."""
    return [WSConfig(128, 4), WSConfig(128, 3), WSConfig(128, 5), WSConfig(128, 4, persistent=False),
            WSConfig(128, 4, wait1=True), WSConfig(128, 3, wait1=True), WSConfig(128, 5, wait1=True),
            WSConfig(128, 4, persistent=False, wait1=True),
            WSConfig(256, 3), WSConfig(256, 4), WSConfig(256, 3, persistent=False)]


def _watchdog(seconds: float, what: str, result: dict, out: Path) -> threading.Timer:
    """A kernel waiting on an mbarrier that never completes hangs the process: after `seconds` record
    which variant did, save what was measured and exit (rerun with --skip to go on)."""
    def fire():
        result["hung"] = f"{what}: no result after {seconds:.0f} s"
        save_json(result, out)
        print(f"\nfp8_gluon: {result['hung']}; partial results in {out}", flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def run(args) -> None:
    from onepath.numerics.quant import quantize_fp8
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT
    from onepath.ops.cuda.matmul import _num_sms, matmul
    from onepath.ops.cuda.matmul_fp8 import matmul_fp8, pick_config

    out_path = Path(args.out)
    t = lambda fn: kernel_us(fn, args.rep_ms)
    sms = _num_sms(torch.device("cuda"))

    def triton_fp8(qa, qw, bias=None, out_dtype=torch.bfloat16):
        """The Triton kernel at its tile for the shape (matmul_fp8 picks the Gluon one from WS_MIN_ROWS rows on)."""
        return matmul_fp8(qa, qw, bias, out_dtype, config=pick_config(qa.codes.shape[0], qw.codes.shape[0], sms))

    gen = torch.Generator(device="cuda").manual_seed(0)
    result = dict(environment("cuda"), command="python " + " ".join(sys.argv), timing=KERNEL_TIMING, baselines=[],
                  variants=[], rows=[])
    shapes = []
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
        qa, qw = quantize_fp8(x, FP8_ACT), quantize_fp8(w, FP8_WEIGHT)
        base = dict(M=m, N=n, K=k, bf16_ours_us=t(lambda: matmul(x, w)), cublas_bf16_us=t(lambda: torch.mm(x, w.t())),
                    triton_fp8_us=t(lambda: triton_fp8(qa, qw)))
        flops = 2.0 * m * n * k
        print(f"M={m} N={n} K={k}: bf16 ours {flops / base['bf16_ours_us'] * 1e-6:.0f} TF/s, cuBLAS bf16 "
              f"{flops / base['cublas_bf16_us'] * 1e-6:.0f}, Triton fp8 {flops / base['triton_fp8_us'] * 1e-6:.0f}",
              flush=True)
        result["baselines"].append(base)
        shapes.append((qa, qw, triton_fp8(qa, qw), base))
    awkward = []
    for m, n, k in AWKWARD:
        qa = quantize_fp8(torch.randn(m, k, device="cuda", generator=gen).bfloat16(), FP8_ACT)
        qw = quantize_fp8((torch.randn(n, k, device="cuda", generator=gen) * 0.05).bfloat16(), FP8_WEIGHT)
        bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
        # FP32 out shows every bit of the accumulator; bf16 with bias the epilogue's bias and rounding
        awkward.append(((m, n, k), qa, qw, None, torch.float32, triton_fp8(qa, qw, out_dtype=torch.float32)))
        awkward.append(((m, n, k), qa, qw, bias, torch.bfloat16, triton_fp8(qa, qw, bias)))
    save_json(result, out_path)

    table = []
    for v in variants():
        if any(fnmatch(str(v), p) for p in args.skip) or (args.only and not any(fnmatch(str(v), p) for p in args.only)):
            continue
        info = dict(variant=str(v), **asdict(v), shared_bytes=v.shared_bytes())
        result["variants"].append(info)
        watchdog = _watchdog(args.hang_s, str(v), result, out_path)
        try:  # the awkward shapes first: masks, ragged K, TMA's zero fill, a hang shows up quickly
            mismatched = []
            for (m, n, k), qa, qw, bias, out_dtype, want in awkward:
                got = matmul_fp8(qa, qw, bias, out_dtype, config=v)
                if not torch.equal(got, want):
                    mismatched.append(f"M={m} N={n} K={k} {out_dtype}: {(got != want).sum().item()} differ")
            info["same_bits_awkward"] = not mismatched
            info["awkward_mismatches"] = mismatched
        except Exception as e:  # noqa: BLE001 -- a variant that does not build or run is a result
            info["error"] = _error(e)
        for qa, qw, want, base in shapes:
            m, n, k = base["M"], base["N"], base["K"]
            row = dict(base, variant=str(v))
            try:
                y = output(m, n, torch.bfloat16, "cuda")
                kernel = launch(qa, qw, None, y, v)
                info.update(spilled_bytes=4 * kernel.n_spills, launch_registers=kernel.n_regs)
                row["same_bits"] = torch.equal(y, want)
                row["us"] = t(lambda: matmul_fp8(qa, qw, config=v))
                row["tflops"] = 2.0 * m * n * k / row["us"] * 1e-6
                for name in ("bf16_ours", "cublas_bf16", "triton_fp8"):
                    row[f"vs_{name}"] = base[f"{name}_us"] / row["us"]
                table.append([f"{m}x{n}x{k}", str(v), "yes" if row["same_bits"] else "NO", row["us"], row["tflops"],
                              row["vs_bf16_ours"], row["vs_cublas_bf16"], row["vs_triton_fp8"]])
            except Exception as e:  # noqa: BLE001
                row["error"] = _error(e)
                table.append([f"{m}x{n}x{k}", str(v), row["error"]])
            result["rows"].append(row)
            save_json(result, out_path)
        watchdog.cancel()
        print(f"{v}: awkward shapes same bits {info.get('same_bits_awkward')} {info.get('error', '')}"
              f"{info.get('awkward_mismatches') or ''}, spilled bytes {info.get('spilled_bytes')}", flush=True)
    print_table("Warp-specialized block-FP8 GEMM vs the Triton FP8 kernel, our BF16 GEMM and cuBLAS BF16 "
                f"({KERNEL_TIMING})", ["shape", "variant", "same bits", "us", "TF/s", "vs bf16 ours", "vs cuBLAS",
                                       "vs triton fp8"], table)
    save_json(result, out_path)
    print(f"\nwrote {out_path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/fp8-gluon.json")
    p.add_argument("--rep-ms", type=int, default=20)
    p.add_argument("--only", nargs="*", default=[], help="variant names or globs, e.g. 'ws128x128s4+persistent'")
    p.add_argument("--skip", nargs="*", default=[], help="variant names or globs, e.g. '*wait1*'")
    p.add_argument("--hang-s", type=float, default=90, help="seconds one variant may take before it counts as hung")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("fp8_gluon: no CUDA device, nothing to time (tests/ops/test_fp8_gluon_build.py builds it for sm_90)")
        return
    run(args)


if __name__ == "__main__":
    main()
