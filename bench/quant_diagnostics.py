"""The low-precision diagnostics table: for each format, "naive" (trainer unquantised, engine quantised)
and "aligned" (both quantised by the spec), the frozen-policy comparison of `onepath diagnose`:
P99 |d log p|, the fraction of ratios outside the PPO clip range, k3 KL, per-module relative L2.

    python bench/quant_diagnostics.py --device cuda --out bench/results/quant/quant-diagnostics.json
    python bench/quant_diagnostics.py --device cpu --out /tmp/quant-diagnostics.json     # CPU: FP32 base

Without --model a random Qwen3-style checkpoint is written first (K dims of 256 and 512: whole FP8
blocks and NVFP4 blocks). Aligned rows must read exactly 0; naive rows show what the quantisation
alone costs when the trainer ignores it.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from onepath.bench.results import environment
from onepath.consistency import diagnose
from onepath.models.checkpoint import save_checkpoint
from onepath.models.config import ModelConfig
from onepath.models.dense import DenseDecoder
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops

FORMATS = ("fp8", "fp8_kv", "fp8+fp8_kv", "nvfp4_w4a16", "nvfp4_w4a4")
CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, model_type="qwen3", max_position_embeddings=256)


def random_checkpoint(where: Path, seed: int) -> Path:
    model = DenseDecoder(ModelConfig(**CONFIG), Ops(ExecutionSpec()), max_positions=2)
    model.init_weights(seed, std=0.05)
    save_checkpoint(where, model.hf_state_dict(), model.config)
    return where


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint directory (default: a random one)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--num-sequences", type=int, default=8)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)
    result = dict(environment(args.device), command="python bench/quant_diagnostics.py " + " ".join(argv or sys.argv[1:]),
                  rows=[])
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(random_checkpoint(Path(tmp) / "model", args.seed))
        for fmt in args.formats.split(","):
            for setting, spec_a in (("naive", "consistent"), ("aligned", f"consistent+{fmt}")):
                out = Path(tmp) / f"{fmt}-{setting}.json"
                diagnose.main([model, "--sides", "spec", "--spec-a", spec_a, "--spec-b", f"consistent+{fmt}",
                               "--device", args.device, "--num-sequences", str(args.num_sequences),
                               "--length", str(args.length), "--seed", str(args.seed), "--json", str(out)])
                r = json.loads(out.read_text())
                result["rows"].append(dict(format=fmt, setting=setting, **{k: r[k] for k in (
                    "tokens", "logprob_abs_diff_p99", "logprob_abs_diff_max", "ratio_outside_clip_frac", "k3_kl",
                    "tokens_differing_frac")}, modules={k: m["rel_l2"] for k, m in r["modules"].items()}))
    print(f"\n{'format':12s} {'setting':8s} {'P99 |dlogp|':>12s} {'max |dlogp|':>12s} {'clip frac':>10s} "
          f"{'k3 KL':>10s}  worst module rel L2")
    for row in result["rows"]:
        worst = max(row["modules"].items(), key=lambda kv: kv[1], default=("-", 0.0))
        print(f"{row['format']:12s} {row['setting']:8s} {row['logprob_abs_diff_p99']:12.3g} "
              f"{row['logprob_abs_diff_max']:12.3g} {row['ratio_outside_clip_frac']:10.4g} {row['k3_kl']:10.3g}  "
              f"{worst[0]} {worst[1]:.3g}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
