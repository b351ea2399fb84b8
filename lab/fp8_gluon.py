"""The warp-specialized Gluon block-FP8 GEMM (onepath/ops/cuda/linear_fp8_ws.py) across its configs: which
is fastest, and does each give the Triton kernel's bits (ops/cuda/linear_fp8.py)?

    python lab/fp8_gluon.py [--out lab/results/fp8-gluon.json] [--only NAME|GLOB ...] [--skip ...]
    python lab/fp8_gluon.py --decode [--out lab/results/fp8-gluon-decode.json] [--weights-mb 0]

The kernel, its contract and its switches (BLOCK_N 128 or 256, ring depth, persistent, wait1, pingpong) are
described in linear_fp8_ws.py; linear_fp8 ships two (ops/cuda/linear_fp8.py): WS_CONFIG from WS_MIN_ROWS
rows on, DECODE_WS_CONFIG (split "n") below.
Per config: bits against the Triton kernel (linear_fp8 with its Triton tile, forced) on awkward shapes
(FP32 out; bf16 out with bias) and at training shapes, the registers and spills of its build, median
time against the Triton FP8 kernel, our BF16 GEMM and cuBLAS BF16. A config that hangs (an mbarrier
never completing) ends the run after --hang-s with the results so far saved.
--decode: the split "n" configs (decode_variants) and WS_CONFIG at M 1, 64, 128, 256 on the decode GEMMs of
Qwen3-0.6B, Qwen3-1.7B and a 7B model (DECODE_SHAPES): bits against the Triton kernel per case, and CUDA-graph
times of each against the Triton kernel and our BF16 GEMM, the weights cycled through copies so that they
come from HBM as in a decode step (--weights-mb 0: one weight, L2-warm, as bench/kernels_fp8.py --graph);
about 70 s on an H200, most of it compiles, and it stops timing new shapes after --budget-s.
tests/ops/test_linear_fp8_ws.py builds every config for sm_90 on a CPU machine.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import threading
import time
from dataclasses import asdict
from fnmatch import fnmatch
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.results import KERNEL_TIMING, environment, kernel_us, print_table, save_json  # noqa: E402
from onepath.bench.kernels_fp8 import decode_variants, kernel_name, variants  # noqa: E402
from onepath.ops.cuda.linear_fp8_ws import WSConfig, launch, output  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 6144, 2048), (8192, 2048, 8192), (8192, 11008, 4096), (4096, 2048, 8192)]
AWKWARD = [(1, 200, 208), (37, 72, 384), (130, 200, 208), (300, 1000, 1000)]  # (M, N, K)
DECODE_MS = (1, 64, 128, 256)
DECODE_SHAPES = {  # (K, N) of the decode GEMMs: qkv, o, gate+up, down
    "qwen3-0.6b": [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)],
    "qwen3-1.7b": [(2048, 4096), (2048, 2048), (2048, 12288), (6144, 2048)],
    "llama-7b": [(4096, 4096), (8192, 2048), (4096, 11008)],
}


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


def _command() -> str:
    return "python " + " ".join(sys.argv)


def _selected(configs: list[WSConfig], args) -> list[WSConfig]:
    def named(v, patterns):
        return any(fnmatch(str(v), p) for p in patterns)
    return [v for v in configs if not named(v, args.skip) and (not args.only or named(v, args.only))]


def _awkward_cases(gen, triton_fp8) -> list[tuple]:
    """((M, N, K), qa, qw, bias, out_dtype, the Triton kernel's output) on AWKWARD: FP32 out shows every bit
    of the accumulator; bf16 with bias the epilogue's bias and rounding."""
    from onepath.numerics.quant import quantize_fp8
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT

    cases = []
    for m, n, k in AWKWARD:
        qa = quantize_fp8(torch.randn(m, k, device="cuda", generator=gen).bfloat16(), FP8_ACT)
        qw = quantize_fp8((torch.randn(n, k, device="cuda", generator=gen) * 0.05).bfloat16(), FP8_WEIGHT)
        bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
        cases.append(((m, n, k), qa, qw, None, torch.float32, triton_fp8(qa, qw, out_dtype=torch.float32)))
        cases.append(((m, n, k), qa, qw, bias, torch.bfloat16, triton_fp8(qa, qw, bias)))
    return cases


def _check_awkward(v: WSConfig, cases: list[tuple], info: dict) -> None:
    """info's same_bits_awkward and awkward_mismatches, or its error: run first for each variant (masks, ragged
    K, TMA's zero fill; a hang shows up quickly)."""
    from onepath.ops.cuda.linear_fp8 import linear_fp8

    try:
        mismatched = []
        for (m, n, k), qa, qw, bias, out_dtype, want in cases:
            got = linear_fp8(qa, qw, bias, out_dtype, config=v)
            if not torch.equal(got, want):
                mismatched.append(f"M={m} N={n} K={k} {out_dtype}: {(got != want).sum().item()} differ")
        info["same_bits_awkward"] = not mismatched
        info["awkward_mismatches"] = mismatched
    except Exception as e:  # noqa: BLE001 -- a variant that does not build or run is a result
        info["error"] = _error(e)


def run(args) -> None:
    from onepath.numerics.quant import quantize_fp8
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT
    from onepath.ops.cuda.linear import linear, sm_count
    from onepath.ops.cuda.linear_fp8 import linear_fp8, pick_config

    out_path = Path(args.out)
    t = lambda fn: kernel_us(fn, args.rep_ms)
    sms = sm_count(torch.device("cuda"))

    def triton_fp8(qa, qw, bias=None, out_dtype=torch.bfloat16):
        """The Triton kernel at its tile for the shape (linear_fp8 picks the Gluon one from WS_MIN_ROWS rows on)."""
        return linear_fp8(qa, qw, bias, out_dtype, config=pick_config(qa.codes.shape[0], qw.codes.shape[0], sms))

    gen = torch.Generator(device="cuda").manual_seed(0)
    result = dict(environment("cuda"), command=_command(), timing=KERNEL_TIMING, baselines=[], variants=[], rows=[])
    shapes = []
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
        qa, qw = quantize_fp8(x, FP8_ACT), quantize_fp8(w, FP8_WEIGHT)
        base = dict(M=m, N=n, K=k, bf16_ours_us=t(lambda: linear(x, w)), cublas_bf16_us=t(lambda: torch.mm(x, w.t())),
                    triton_fp8_us=t(lambda: triton_fp8(qa, qw)))
        flops = 2.0 * m * n * k
        print(f"M={m} N={n} K={k}: bf16 ours {flops / base['bf16_ours_us'] * 1e-6:.0f} TF/s, cuBLAS bf16 "
              f"{flops / base['cublas_bf16_us'] * 1e-6:.0f}, Triton fp8 {flops / base['triton_fp8_us'] * 1e-6:.0f}",
              flush=True)
        result["baselines"].append(base)
        shapes.append((qa, qw, triton_fp8(qa, qw), base))
    awkward = _awkward_cases(gen, triton_fp8)
    save_json(result, out_path)

    table = []
    for v in _selected(variants(), args):
        info = dict(variant=str(v), **asdict(v), shared_bytes=v.shared_bytes())
        result["variants"].append(info)
        watchdog = _watchdog(args.hang_s, str(v), result, out_path)
        _check_awkward(v, awkward, info)
        for qa, qw, want, base in shapes:
            m, n, k = base["M"], base["N"], base["K"]
            row = dict(base, variant=str(v))
            try:
                y = output(m, n, torch.bfloat16, "cuda")
                kernel = launch(qa, qw, None, y, v)
                info.update(spilled_bytes=4 * kernel.n_spills, launch_registers=kernel.n_regs)
                row["same_bits"] = torch.equal(y, want)
                row["us"] = t(lambda: linear_fp8(qa, qw, config=v))
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


def _cycling(fn, weights: list):
    """fn(w) over the weight's copies in turn. A CUDA graph captures each call with its own copy, so a replay
    reads every weight from HBM, as a decode step does (one weight, replayed, would sit in the 50 MB L2)."""
    turn = itertools.count()
    return lambda: fn(weights[next(turn) % len(weights)])


def _copies(make, nbytes: int, total_mb: int) -> list:
    return [make() for _ in range(max(1, -(-total_mb * 2 ** 20 // nbytes)))]


def run_decode(args) -> None:
    """Per decode shape (K, N) and M in DECODE_MS: bits of every split "n" variant and WS_CONFIG against the
    Triton kernel (its tile for the shape, forced), then CUDA-graph times of each, the Triton kernel and our
    BF16 GEMM on a bf16 weight of the same shape."""
    from onepath.numerics.quant import FP8Tensor, quantize_fp8
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT
    from onepath.ops.cuda.linear import linear, sm_count
    from onepath.ops.cuda.linear_fp8 import WS_CONFIG, linear_fp8, pick_config

    start = time.monotonic()
    out_path = Path(args.out)
    sms = sm_count(torch.device("cuda"))
    t = lambda fn: kernel_us(fn, args.rep_ms, graph=True)
    configs = [WS_CONFIG, *_selected(decode_variants(), args)]
    labels = {str(v): f"v{i}" for i, v in enumerate(configs)}  # the table's columns: v0 is WS_CONFIG

    def triton_fp8(qa, qw, bias=None, out_dtype=torch.bfloat16):
        return linear_fp8(qa, qw, bias, out_dtype, config=pick_config(qa.codes.shape[0], qw.codes.shape[0], sms))

    gen = torch.Generator(device="cuda").manual_seed(0)
    result = dict(environment("cuda"), command=_command(), timing=f"do_bench_cudagraph median, rep {args.rep_ms} ms",
                  weights=(f"cold: copies of each weight cycled, >= {args.weights_mb} MB of them, read from HBM"
                           if args.weights_mb else "warm: one weight, replayed from L2 where it fits"),
                  labels=labels, variants=[], rows=[])
    awkward = _awkward_cases(gen, triton_fp8)
    for v in configs[1:]:
        info = dict(variant=str(v), **asdict(v), shared_bytes=v.shared_bytes())
        result["variants"].append(info)
        watchdog = _watchdog(args.hang_s, str(v), result, out_path)
        _check_awkward(v, awkward, info)
        watchdog.cancel()
        print(f"{v}: awkward shapes same bits {info.get('same_bits_awkward')} {info.get('error', '')}"
              f"{info.get('awkward_mismatches') or ''}", flush=True)
    save_json(result, out_path)

    table = []
    for model, k, n in [(model, k, n) for model, shapes in DECODE_SHAPES.items() for k, n in shapes]:
        if time.monotonic() - start > args.budget_s:
            result["stopped"] = f"over --budget-s {args.budget_s:.0f} s before K={k} N={n}"
            break
        weight = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
        qw = quantize_fp8(weight, FP8_WEIGHT)
        bf16_weights = _copies(weight.clone, weight.nbytes, args.weights_mb)
        fp8_weights = _copies(lambda: FP8Tensor(qw.codes.clone(), qw.scales.clone(), qw.block), qw.codes.nbytes,
                              args.weights_mb)
        for m in DECODE_MS:
            watchdog = _watchdog(args.hang_s, f"K={k} N={n} M={m}", result, out_path)
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            qa = quantize_fp8(x, FP8_ACT)
            want = triton_fp8(qa, qw)
            row = dict(model=model, K=k, N=n, M=m, triton_tile=kernel_name(pick_config(m, n, sms)), same_bits={},
                       us={}, errors={})
            row["us"]["bf16_ours"] = t(_cycling(lambda w: linear(x, w), bf16_weights))
            row["us"]["triton_fp8"] = t(_cycling(lambda w: triton_fp8(qa, w), fp8_weights))
            for v in configs:
                try:
                    row["same_bits"][str(v)] = torch.equal(linear_fp8(qa, qw, config=v), want)
                    row["us"][str(v)] = t(_cycling(lambda w: linear_fp8(qa, w, config=v), fp8_weights))
                except Exception as e:  # noqa: BLE001 -- a variant that does not build or run is a result
                    row["errors"][str(v)] = _error(e)
            watchdog.cancel()
            # the fastest of the FP8 kernels that gave the Triton kernel's bits
            fp8 = {name: us for name, us in row["us"].items()
                   if name == "triton_fp8" or row["same_bits"].get(name)}
            row["fastest_fp8"] = min(fp8, key=fp8.get)
            row["fastest_vs_bf16_ours"] = row["us"]["bf16_ours"] / fp8[row["fastest_fp8"]]
            row["fastest_vs_triton_fp8"] = row["us"]["triton_fp8"] / fp8[row["fastest_fp8"]]
            result["rows"].append(row)
            save_json(result, out_path)
            wrong = [labels[name] for name, same in row["same_bits"].items() if not same]
            wrong += [f"{labels[name]} failed" for name in row["errors"]]
            table.append([model, f"{k}x{n}", str(m), f"no: {', '.join(wrong)}" if wrong else "yes",
                          *(row["us"].get(name) for name in ("bf16_ours", "triton_fp8", *labels)),
                          labels.get(row["fastest_fp8"], row["fastest_fp8"]), row["fastest_vs_bf16_ours"],
                          row["fastest_vs_triton_fp8"]])
            print(f"{model} K={k} N={n} M={m}: fastest {row['fastest_fp8']} {fp8[row['fastest_fp8']]:.1f} us, "
                  f"bf16 ours {row['us']['bf16_ours']:.1f} us, other bits: {', '.join(wrong) or 'none'}", flush=True)
        del bf16_weights, fp8_weights
    for name, label in labels.items():
        print(f"{label} = {name}")
    print_table(f"Block-FP8 GEMM at decode: microseconds ({result['timing']}; {result['weights']})",
                ["model", "K x N", "M", "same bits", "bf16 ours", "triton fp8", *labels.values(), "fastest",
                 "vs bf16", "vs triton"], table)
    result["summary"] = _decode_summary(result["rows"], ["triton_fp8", *labels])
    print_table("Per kernel over the cases it ran: where fastest, geometric mean and worst speedup",
                ["kernel", "label", "same bits", "fastest in", "gmean vs bf16", "gmean vs triton", "worst vs triton"],
                [[name, labels.get(name, "-"), f"{c['same_bits']}/{c['cases']}", c["fastest_in"],
                  c["gmean_vs_bf16_ours"], c["gmean_vs_triton_fp8"], c["worst_vs_triton_fp8"]]
                 for name, c in result["summary"].items()])
    result["seconds"] = time.monotonic() - start
    save_json(result, out_path)
    print(f"\nwrote {out_path} ({result['seconds']:.0f} s)")


def _decode_summary(rows: list[dict], names: list[str]) -> dict:
    """Per kernel: in how many cases it had the Triton kernel's bits and was the fastest FP8 kernel, and its
    speedups over our BF16 GEMM and the Triton FP8 kernel (geometric mean, worst)."""
    summary = {}
    for name in names:
        ran = [r for r in rows if name in r["us"]]
        if not ran:
            continue
        vs_bf16 = [r["us"]["bf16_ours"] / r["us"][name] for r in ran]
        vs_triton = [r["us"]["triton_fp8"] / r["us"][name] for r in ran]
        summary[name] = dict(cases=len(ran), same_bits=sum(r["same_bits"].get(name, True) for r in ran),
                             fastest_in=sum(r["fastest_fp8"] == name for r in ran),
                             gmean_vs_bf16_ours=math.exp(sum(map(math.log, vs_bf16)) / len(ran)),
                             gmean_vs_triton_fp8=math.exp(sum(map(math.log, vs_triton)) / len(ran)),
                             worst_vs_triton_fp8=min(vs_triton))
    return summary


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode", action="store_true", help="decode shapes (M 1-256) and the split 'n' variants")
    p.add_argument("--out", help="default lab/results/fp8-gluon.json, with --decode fp8-gluon-decode.json")
    p.add_argument("--rep-ms", type=int, help="default 20, with --decode 10")
    p.add_argument("--weights-mb", type=int, default=256,
                   help="--decode: MB of weight copies to cycle through (0: one weight, L2-warm where it fits)")
    p.add_argument("--budget-s", type=float, default=120, help="--decode: stop timing new shapes after this")
    p.add_argument("--only", nargs="*", default=[], help="variant names or globs, e.g. 'ws128x128s4+persistent'")
    p.add_argument("--skip", nargs="*", default=[], help="variant names or globs, e.g. '*wait1*'")
    p.add_argument("--hang-s", type=float, default=90, help="seconds one variant may take before it counts as hung")
    args = p.parse_args()
    args.out = args.out or f"lab/results/fp8-gluon{'-decode' if args.decode else ''}.json"
    args.rep_ms = args.rep_ms or (10 if args.decode else 20)
    if not torch.cuda.is_available():
        print("fp8_gluon: no CUDA device, nothing to time (tests/ops/test_linear_fp8_ws.py builds it for sm_90)")
        return
    (run_decode if args.decode else run)(args)


if __name__ == "__main__":
    main()
