"""A new family's 30-step GRPO run at the recipe's shapes, consistent and baseline from one random checkpoint.

The logic and the options: onepath/bench/family_run.py (`python bench/family_run.py --help`).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.family_run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
