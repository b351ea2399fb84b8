"""`onepath check MODEL`: run the gates in order, print PASS/FAIL and the evidence of each (--json for CI)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from onepath.consistency.bisect import MODEL_HELP, load_class
from onepath.consistency.gates.context import TITLES, GateContext, GateResult
from onepath.consistency.gates.run import parse_gates, run_gate


def format_result(r: GateResult, width: int = 150) -> str:
    lines = [f"{r.name:<4s} {TITLES[r.name]:<34s} {'PASS' if r.passed else 'FAIL'}  {r.seconds:6.2f} s  {r.detail}"]
    for key, value in r.evidence.items():
        text = json.dumps(value, default=str) if not isinstance(value, str) else value
        lines.append(f"       {key}: {text if len(text) <= width else text[:width - 3] + '...'}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`onepath check`: exit 0 when every gate run passes, 1 when one fails."""
    parser = argparse.ArgumentParser(prog="onepath check", description="run the consistency gates C0..C10 in order "
                                     "and print PASS/FAIL with evidence for each; exit 1 when one fails",
                                     epilog="example: onepath check tiny --gates C2,C3,C4,C5")
    parser.add_argument("model", help=MODEL_HELP)
    parser.add_argument("--gates", default=None, help="comma-separated subset, e.g. C2,C3 (default: all, in order)")
    parser.add_argument("--json", default=None, help="also write every gate's result as JSON to this path (CI)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the gates run (default cpu)")
    parser.add_argument("--spec", default="consistent", help="'consistent', 'baseline' (a negative control: gates "
                                                             "C2..C6 should fail) or a spec.json path")
    parser.add_argument("--ops", default=None, help="backend class 'module:Class' (an Ops subclass; default Ops)")
    parser.add_argument("--seed", type=int, default=0, help="prompts, sampling and 'tiny''s weights (default 0)")
    parser.add_argument("--max-model-len", type=int, default=256, help="the engines' longest sequence (default 256)")
    parser.add_argument("--repro-dir", default=None, help="write bisect's standalone repro of a C3..C6 divergence "
                                                          "under this directory")
    parser.add_argument("--min-ratio", type=float, default=0.0, help="C10 fails below this consistent/baseline "
                                                                     "throughput ratio (default: record only)")
    args = parser.parse_args(argv)
    names = parse_gates(args.gates)
    ctx = GateContext.load(args.model, args.device, args.spec, ops_factory=load_class(args.ops), seed=args.seed,
                           max_model_len=args.max_model_len, min_throughput_ratio=args.min_ratio,
                           repro_dir=Path(args.repro_dir) if args.repro_dir else None)
    backend = getattr(ctx.ops_factory, "__qualname__", repr(ctx.ops_factory))
    print(f"onepath check {ctx.label}: {ctx.spec.mode} {ctx.device}, spec {ctx.spec.hash()}, backend {backend}")
    results = []
    for name in names:
        results.append(run_gate(ctx, name))
        print(format_result(results[-1]), flush=True)
    passed = sum(r.passed for r in results)
    print(f"{passed} of {len(results)} gates passed" + ("" if passed == len(results) else ": FAIL"))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": ctx.label, "device": ctx.device, "spec_hash": ctx.spec.hash(), "spec": ctx.spec.to_dict(),
            "backend": backend, "passed": passed == len(results),
            "gates": [r.to_dict() for r in results]}, indent=2, default=str))
    return 0 if passed == len(results) else 1
