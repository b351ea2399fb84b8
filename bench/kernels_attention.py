"""Paged attention (ops/cuda/attention.py) against torch SDPA flash, decode and prefill.

The logic and the options: onepath/bench/kernels_attention.py (`python bench/kernels_attention.py --help`).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.kernels_attention import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
