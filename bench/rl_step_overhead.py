"""The full RL step's cost of consistency: mean step time (generation + old log-probs + update + sync)
of consistent vs baseline mode, with train.old_logprob verify and skip.

    python bench/rl_step_overhead.py --out bench/results/rl-step-overhead.json          # GPU config
    python bench/rl_step_overhead.py --config onepath/configs/demo.yaml --steps 4 \\
        --set train.prompts_per_step=8 --set warm_start.steps=5 --out /tmp/rl.json        # CPU smoke run

Each (policy, mode) trains from the same warm start for --steps steps; the first --skip-steps steps
(compilation, graph capture, allocator warm-up) are left out of the mean. Targets: overhead <= 5% with
skip, <= 10% with verify.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from onepath.bench.results import environment
from onepath.cli import main as onepath_main
from onepath.train.metrics import read_metrics

TARGETS = {"skip": 0.05, "verify": 0.10}


def run(args) -> dict:
    result = dict(environment(args.device), command="python bench/rl_step_overhead.py " + " ".join(sys.argv[1:]),
                  config=args.config, steps=args.steps, skip_steps=args.skip_steps, policies={})
    for policy in args.policies:
        out = Path(args.work) / policy
        extra = [f for item in args.set for f in ("--" + item.partition("=")[0], item.partition("=")[2])]
        code = onepath_main(["train", "--config", args.config, "--mode", "both", "--out", str(out), "--quiet",
                             "--device", args.device, "--train.steps", str(args.steps),
                             "--train.old_logprob", policy, "--train.val_every", "0", *extra])
        row = result["policies"][policy] = {"exit_code": code}
        for mode in ("consistent", "baseline"):
            steps = [r for r in read_metrics(out / mode / "metrics.jsonl") if r["step"] > args.skip_steps]
            row[mode] = {name: statistics.mean(r[f"timing_s/{name}"] for r in steps)
                         for name in ("step", "gen", "old_logprob", "update", "sync") if f"timing_s/{name}" in steps[0]}
        overhead = row["consistent"]["step"] / row["baseline"]["step"] - 1
        row.update(overhead=overhead, target=TARGETS[policy], passed=overhead <= TARGETS[policy])
        print(f"old_logprob {policy}: consistent {row['consistent']['step'] * 1e3:.1f} ms/step, baseline "
              f"{row['baseline']['step'] * 1e3:.1f} ms/step, overhead {overhead:+.1%} "
              f"({'PASS' if row['passed'] else 'FAIL'}, target <= {TARGETS[policy]:.0%})", flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="onepath/configs/qwen3-0.6b-gpu.yaml")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip-steps", type=int, default=3)
    p.add_argument("--policies", nargs="+", default=["skip", "verify"], choices=sorted(TARGETS))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override passed to onepath train, e.g. --set train.lr=1e-5")
    p.add_argument("--work", default="runs/rl-step-overhead", help="run directories")
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)
    bad = [item for item in args.set if "=" not in item]
    if bad:
        p.error(f"--set {bad[0]!r} is not KEY=VALUE, e.g. --set train.lr=1e-5")
    if args.steps <= args.skip_steps:
        p.error(f"--steps {args.steps} must exceed --skip-steps {args.skip_steps}")
    result = run(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r["exit_code"] == 0 for r in result["policies"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
