"""The consistent BF16 GEMM (ops/cuda/linear.py) against cuBLAS, from decode to prefill rows.

The logic and the options: onepath/bench/kernels_linear.py (`python bench/kernels_linear.py --help`).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.kernels_linear import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
