"""The full RL step's cost of consistency: mean step time (generation + old log-probs + update + sync)
of consistent vs baseline mode, with train.old_logprob verify and skip.

    python bench/rl_step_overhead.py --out bench/results/train/rl-step-overhead.json          # GPU config
    python bench/rl_step_overhead.py --config onepath/configs/demo.yaml --steps 4 \\
        --set train.prompts_per_step=8 --set warm_start.steps=5 --out /tmp/rl.json        # CPU smoke run

Each (policy, mode) runs the config's warm start, then --steps RL steps, in a run of its own; the first
--skip-steps steps (compilation, graph capture, allocator warm-up) are left out of the mean. --repeats R
runs each mode R times, alternating which runs first, and pools the steps (the overhead of each repeat
is kept too): the verdict then rests on more than one pair of runs. Targets: overhead <= 5% with
skip, <= 10% with verify.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from onepath.bench import runs
from onepath.bench.results import environment
from onepath.train.metrics import read_metrics

TARGETS = {"skip": 0.05, "verify": 0.10}


MODES = ("consistent", "baseline")
PHASES = ("step", "gen", "old_logprob", "update", "sync")


def run(args) -> dict:
    result = dict(environment(args.device), command="python bench/rl_step_overhead.py " + " ".join(sys.argv[1:]),
                  config=args.config, steps=args.steps, skip_steps=args.skip_steps, repeats=args.repeats, policies={})
    extra = [f for item in args.set for f in ("--" + item.partition("=")[0], item.partition("=")[2])]
    for policy in args.policies:
        records = {mode: [] for mode in MODES}
        codes, per_repeat = [], []
        for r in range(args.repeats):
            # each mode in its own run, the order alternating between repeats: a drift in the machine's
            # speed (another job on the host, clocks) then weighs on both modes alike
            step_means = {}
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                out = Path(args.work) / policy / f"r{r}-{mode}"
                codes.append(runs.train(["--config", args.config, "--mode", mode, "--out", str(out),
                                         "--quiet", "--device", args.device, "--train.steps", str(args.steps),
                                         "--train.old_logprob", policy, "--train.val_every", "0", *extra]))
                steps = [x for x in read_metrics(out / "metrics.jsonl") if x["step"] > args.skip_steps]
                records[mode] += steps
                step_means[mode] = statistics.mean(x["timing_s/step"] for x in steps)
            per_repeat.append(step_means["consistent"] / step_means["baseline"] - 1)
        row = result["policies"][policy] = {"exit_code": max(codes, key=abs)}
        for mode in MODES:
            row[mode] = {name: statistics.mean(x[f"timing_s/{name}"] for x in records[mode])
                         for name in PHASES if f"timing_s/{name}" in records[mode][0]}
        overhead = row["consistent"]["step"] / row["baseline"]["step"] - 1
        row.update(overhead=overhead, overhead_per_repeat=per_repeat, target=TARGETS[policy],
                   passed=overhead <= TARGETS[policy])
        spread = f" (repeats {', '.join(f'{o:+.1%}' for o in per_repeat)})" if args.repeats > 1 else ""
        print(f"old_logprob {policy}: consistent {row['consistent']['step'] * 1e3:.1f} ms/step, baseline "
              f"{row['baseline']['step'] * 1e3:.1f} ms/step, overhead {overhead:+.1%}{spread} "
              f"({'PASS' if row['passed'] else 'FAIL'}, target <= {TARGETS[policy]:.0%})", flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="onepath/configs/qwen3-0.6b-gpu.yaml")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip-steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per mode, alternating which mode runs first; the means pool every run's steps")
    p.add_argument("--policies", nargs="+", default=["skip", "verify"], choices=sorted(TARGETS))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override passed to onepath train, e.g. --set train.lr=1e-5")
    p.add_argument("--work", default="runs/rl-step-overhead", help="run directories")
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)
    bad = [item for item in args.set if "=" not in item]
    if bad:
        p.error(f"--set {bad[0]!r} is not KEY=VALUE, e.g. --set train.lr=1e-5")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats} must be >= 1")
    if args.steps <= args.skip_steps:
        p.error(f"--steps {args.steps} must exceed --skip-steps {args.skip_steps}")
    result = run(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r["exit_code"] == 0 for r in result["policies"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
