"""Routing agreement (trainer vs rollout) per RL step on an MoE, with the step's diff metrics.

The logic and the options: onepath/bench/moe_routing.py (`python bench/moe_routing.py --help`).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.moe_routing import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
