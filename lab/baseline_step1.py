"""Probe: which part of the baseline's FP8 rollout makes its first step's samples differ from the consistent
run's (the 150-step evidence runs: the baseline's step-1 k3 4.5 and reward -0.17 against the consistent run's
0.66 from the same warm start, bench/results/evidence/). One warm start, then one RL step per variant, each
switching one thing off: the library's blockwise FP8 GEMM (the dequantised GEMM instead), the FP8 KV cache,
the CUDA graphs. Prints each variant's step-1 k3, max |dp|, reward and response length.

    python lab/baseline_step1.py --out /tmp/bs [--config onepath/configs/evidence-dense.yaml]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onepath import cli  # noqa: E402
from onepath.ops import linear_quant as LQ  # noqa: E402


class _Refused(dict):
    def get(self, key, default=None):
        return "forced off by lab/baseline_step1.py"


def gemm_sweep() -> dict:
    """fp8_library_cuda against the dequantised GEMM at the dense evidence model's linear shapes: the largest
    |difference| over the largest |value| per (N, K, M)."""
    import torch
    from onepath.numerics.quant import quantize
    from onepath.numerics.spec import ExecutionSpec, FP8_WEIGHT
    op = ExecutionSpec.default("baseline", "cuda", quant="fp8").op("linear")
    rows = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((1024, 1024), (512, 1024), (2048, 1024), (2816, 1024), (5632, 1024), (1024, 2816), (128, 256)):
        qw = quantize(torch.randn(n, k, generator=gen, device="cuda") * 0.05, FP8_WEIGHT)
        for m in (1, 7, 16, 200, 4096, 16384):
            x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
            got = LQ.fp8_library_cuda(op, x, x, qw, None, torch.bfloat16).float()
            want = LQ.dequantized_gemm(quantize(x, op.act), qw, None).float()
            rows[f"{n}x{k} m={m}"] = round(float((got - want).abs().max() / want.abs().max()), 5)
    rows["refused"] = {f"{n}x{k}": r for (n, k), r in LQ._SCALED_MM_REFUSED.items()}
    LQ._SCALED_MM_REFUSED.clear()
    print("gemm_sweep", json.dumps(rows), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="onepath/configs/evidence-dense.yaml")
    p.add_argument("--out", required=True)
    p.add_argument("--only", nargs="*", help="variant names to run (default all)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(gemm_sweep(), indent=2) + "\n")
    base = ["train", "--config", args.config, "--quiet"]
    if not (out / "ws" / "warm_start").exists():
        cli.main(base + ["--out", str(out / "ws"), "--train.steps", "0"])
    step = base + ["--model.path", str(out / "ws" / "warm_start"), "--warm_start.steps", "0", "--train.steps", "1",
                   "--train.val_every", "0", "--train.save_every", "0"]
    fast = ["--mode", "baseline", "--trainer_quant", "none"]
    variants = {"consistent": ["--mode", "consistent"], "baseline": fast,
                "baseline-dequant-gemm": fast, "baseline-no-fp8-kv": fast + ["--quant", "fp8"],
                "baseline-eager": fast + ["--rollout.cuda_graphs", "false"],
                "consistent-no-fp8-kv": ["--mode", "consistent", "--quant", "fp8"]}
    results = {}
    for name, own in variants.items():
        if args.only and name not in args.only:
            continue
        saved = LQ._SCALED_MM_REFUSED
        if name == "baseline-dequant-gemm":
            LQ._SCALED_MM_REFUSED = _Refused()
        try:
            cli.main(step + own + ["--out", str(out / name)])
        finally:
            LQ._SCALED_MM_REFUSED = saved
        row = json.loads((out / name / "metrics.jsonl").read_text().splitlines()[0])
        results[name] = {k: row.get(k) for k in ("rollout_corr/k3_kl", "training/rollout_probs_diff_max",
                                                 "critic/score/mean", "response_length/mean", "actor/entropy")}
        print(name, json.dumps(results[name]), flush=True)
    (out / "step1.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
