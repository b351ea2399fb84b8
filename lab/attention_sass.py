"""Instructions per KV tile of the paged attention kernel's sm_90 builds, from their SASS (no GPU).

The builds and the counting are the tests' (tests/attention_sass.py, checked by tests/ops/test_attention_sass.py);
this writes their table: `python lab/attention_sass.py --out lab/results/attention-sass-tile.json`.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from tests.attention_sass import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
