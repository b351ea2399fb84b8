"""Past one GPU: DP rollout scaling, the RL step per layout, TP's invariant reduction vs all-reduce.

The logic and the options: onepath/bench/distributed.py (`python bench/distributed.py --help`).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.distributed import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
