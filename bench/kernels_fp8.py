"""The block-FP8 W8A8 GEMM against our BF16 GEMM and cuBLAS BF16, at training and decode shapes.

The logic and the options: onepath/bench/kernels_fp8.py (`python bench/kernels_fp8.py --help`).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.kernels_fp8 import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
