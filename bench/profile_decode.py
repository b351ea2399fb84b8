"""Where a decode step's time goes: host phases and GPU kernels of all-decode engine steps.

The logic and the options: onepath/bench/profile_decode.py (`python bench/profile_decode.py --help`).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.profile_decode import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
