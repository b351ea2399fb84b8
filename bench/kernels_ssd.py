"""The Mamba-2 scan: decode's replay of the open chunk against the one-step recurrence, prefill against the HBM and
tensor-core bounds.

The logic and the options: onepath/bench/kernels_ssd.py (`python bench/kernels_ssd.py --help`).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.kernels_ssd import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
