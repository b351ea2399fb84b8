"""The engine's host work per decode step, without a model: what a GPU waits for between two steps.

    python bench/engine_host.py [--batch 256] [--out bench/results/engine-host-cpu.json]

--batch sequences (prompt 150 tokens, random ids) decode one token per step through the real
Scheduler and BlockManager (prefix caching on), the ModelRunner's per-step host code (the chunks,
DecodeGraphs.stage's input staging into static buffers on the CPU, the sampling keys) and
Scheduler.postprocess with a fixed sampled token. Median milliseconds per step of each phase over
--steps steps after a warm-up. On the GPU machine a decode step runs these while the GPU idles (the
engine is synchronous), so they bound how much a decode step can gain from host work.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.results import environment, save_json  # noqa: E402
from onepath.engine.block_manager import BlockManager  # noqa: E402
from onepath.engine.model_runner import DecodeGraphs  # noqa: E402
from onepath.engine.sampling_params import SamplingParams  # noqa: E402
from onepath.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from onepath.engine.sequence import Sequence  # noqa: E402

BLOCK = 16


class _StageOnly(DecodeGraphs):
    """DecodeGraphs' static buffers and staging on the CPU, with no model and no graphs."""

    def __init__(self, max_batch: int, max_model_len: int, scratch_block: int):
        self.block_size, self.max_model_len, self.batch_sizes = BLOCK, max_model_len, [max_batch]
        self.width = -(-max_model_len // BLOCK)
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * BLOCK
        self.input_ids = torch.zeros(max_batch, dtype=torch.long)
        self.positions = torch.zeros(max_batch, dtype=torch.long)
        self.slot_mapping = torch.zeros(max_batch, dtype=torch.long)
        self.block_tables = torch.zeros(max_batch, self.width, dtype=torch.long)


def run(args) -> dict:
    from onepath.engine.model_runner import ModelRunner

    num_blocks = args.batch * -(-args.max_model_len // BLOCK) + 1
    blocks = BlockManager(num_blocks, BLOCK, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=8192,
                                          max_model_len=args.max_model_len), blocks)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        prompt = torch.randint(3, 150_000, (args.prompt,), generator=gen).tolist()
        scheduler.add(Sequence(i, prompt, SamplingParams(max_tokens=100_000, ignore_eos=True, seed=1)))
    stage = _StageOnly(args.batch, args.max_model_len, num_blocks)
    phases = {"schedule": [], "chunks": [], "stage": [], "sample_keys": [], "postprocess": []}
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        scheduled = scheduler.schedule()
        t1 = time.perf_counter()
        chunks = ModelRunner.chunks(scheduled)
        t2 = time.perf_counter()
        decode = all(s.num_tokens == 1 for s in scheduled)
        if decode:
            stage.stage(chunks)
        t3 = time.perf_counter()
        keys = ModelRunner.sample_keys([s.seq for s in scheduled if s.samples])
        t4 = time.perf_counter()
        scheduler.postprocess(scheduled, {s.seq.request_id: (7, -1.0) for s in scheduled if s.samples})
        t5 = time.perf_counter()
        if step >= args.warmup:
            assert decode and len(keys) == args.batch, "the timed steps must be all-decode steps of the whole batch"
            for name, (a, b) in zip(phases, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5))):
                phases[name].append((b - a) * 1e3)
    ms = {name: statistics.median(v) for name, v in phases.items()}
    ms["total"] = sum(ms.values())
    print(f"host ms per decode step at batch {args.batch}: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items()))
    return dict(environment("cpu"), command="python bench/engine_host.py " + " ".join(sys.argv[1:]),
                batch=args.batch, prompt=args.prompt, steps=args.steps, host_ms_per_step=ms)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt", type=int, default=150)
    p.add_argument("--max-model-len", type=int, default=1200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = run(args)
    if args.out:
        save_json(result, Path(args.out))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
