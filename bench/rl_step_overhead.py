"""The full RL step's cost of consistency: step time of consistent vs baseline mode.

The logic and the options: onepath/bench/rl_step_overhead.py (`python bench/rl_step_overhead.py --help`).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.rl_step_overhead import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
