"""Long multi-turn tool episodes (32,768 tokens on CUDA): KV sized for them, the trainer's micro-batches and
recompute with their peak memory, diff = 0 on every policy token before and after one GRPO update.

    python bench/long_episode.py --out bench/results/train/long-episode-qwen3-0.6b.json      # CUDA, 4 x 32,768
    python bench/long_episode.py --device cpu --tokens 1024 --out /tmp/long-episode.json     # CPU, tiny model

The logic and the options: onepath/bench/long_episode.py (`python bench/long_episode.py --help`).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.long_episode import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
