"""No routing replay, measured over an RL run: per step, the share of tokens whose recomputed MoE routing
(the trainer's forward) equals the rollout's (the engine records it), with the step's diff metrics.

    python bench/moe_routing.py --out bench/results/moe/moe-routing-cpu.json                # embedded MoE, CPU
    python bench/moe_routing.py --device cuda --set model.num_experts=64 ... --out ...  # on the GPU

The run is `onepath train` on the demo config with an embedded Qwen3-MoE (--set overrides any key);
target: moe/routing_agreement = 1.0 on every step, over >= 20 steps.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


from onepath.bench import runs
from onepath.bench.results import environment, save_json
from onepath.train.metrics import read_metrics

MOE = ["model.model_type=qwen3_moe", "model.num_experts=16", "model.num_experts_per_tok=4",
       "model.moe_intermediate_size=48", "warm_start.steps=100"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="onepath/configs/demo.yaml")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--mode", default="consistent", choices=("consistent", "baseline"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides, after MOE's")
    p.add_argument("--out", default="bench/results/moe/moe-routing-cpu.json")
    args = p.parse_args(argv)
    overrides = [f for item in MOE + args.set for f in ("--" + item.partition("=")[0], item.partition("=")[2])]
    with tempfile.TemporaryDirectory() as run:
        code = runs.train(["--config", args.config, "--mode", args.mode, "--out", run, "--quiet",
                           "--device", args.device, "--train.steps", str(args.steps), "--train.val_every", "0",
                           *overrides])
        records = read_metrics(Path(run) / "metrics.jsonl")
    steps = [{"step": r["step"], "routing_agreement": r["moe/routing_agreement"],
              "routing_compared_tokens": r["moe/routing_compared_tokens"],
              "tokens_differing_frac": r.get("rollout_corr/tokens_differing_frac")} for r in records]
    result = dict(environment(args.device), command="python bench/moe_routing.py " + " ".join(argv or sys.argv[1:]),
                  exit_code=code, overrides=MOE + args.set, mode=args.mode, steps=steps,
                  all_steps_agree=bool(steps) and all(s["routing_agreement"] == 1.0 for s in steps),
                  compared_tokens=sum(s["routing_compared_tokens"] for s in steps))
    save_json(result, Path(args.out))
    print(f"{len(steps)} steps, {result['compared_tokens']} tokens compared, routing agreement 1.0 on every step: "
          f"{result['all_steps_agree']}")
    return code


if __name__ == "__main__":
    sys.exit(main())
