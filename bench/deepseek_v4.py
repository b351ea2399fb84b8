"""DeepSeek-V4-Flash-shaped benches: the cache's bytes per token, the indexer's top-k against torch.topk, and the
rollout benchmark (consistent vs baseline, FP8 W8A8 + FP8 KV, 256 requests of 150 / 3000 tokens and ragged).

    python bench/deepseek_v4.py cache
    python bench/deepseek_v4.py topk --k 2048 --rows 64 --length 32768
    python bench/deepseek_v4.py rollout --out bench/results/deepseek_v4/rollout-flash-4l.json
    python bench/deepseek_v4.py rollout --model tiny-deepseek-v4 --device cpu --requests 4 --scale 0.01

onepath/bench/deepseek_v4.py holds the logic and the options.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.deepseek_v4 import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
