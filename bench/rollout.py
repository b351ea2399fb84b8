"""Rollout tokens/s (consistent, baseline, transformers' generate) and the decode roofline; JSON in bench/results/.

    python bench/rollout.py --model qwen3-0.6b --device cuda --out bench/results/rollout/rollout-qwen3-0.6b.json
    python bench/rollout.py --model tiny --device cpu --requests 8 --scale 0.02
    python bench/rollout.py --model qwen3-30b-a3b-12l --workloads fixed-1000 --out bench/results/rollout/rollout-qwen3-moe.json
    python bench/rollout.py --model nemotron-3-nano-13l --out bench/results/rollout/rollout-nemotron-3-nano-13l.json

The same as `onepath bench rollout` (onepath/bench/rollout.py holds the logic and the options).
"""
from __future__ import annotations

import sys
from pathlib import Path

# run from anywhere, installed or not; the script's own folder off the path: its kernels.py would shadow the
# `kernels` package that transformers' NemotronH imports (HF generate of a hybrid)
sys.path[0] = str(Path(__file__).resolve().parents[1])

from onepath.bench.rollout import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
