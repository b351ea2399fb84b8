"""The engine's host work per decode step, without a model forward (CPU).

The logic and the options: onepath/bench/engine_host.py (`python bench/engine_host.py --help`).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.engine_host import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
