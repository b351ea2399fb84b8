"""The engine's host work per decode step, with no forward: what a GPU waits for between two steps.

    python bench/engine_host.py [--batch 256] [--out bench/results/engine/engine-host-cpu.json]

--batch sequences (prompt 150 tokens, random ids) decode one token per step through the real
Scheduler and BlockManager (prefix caching on), the ModelRunner's per-step host code (the chunks,
DecodeGraphs.stage's input staging into static buffers on the CPU, the sampling keys) and
Scheduler.postprocess with a fixed sampled token. Median milliseconds per step of each phase over
--steps steps after a warm-up. On a GPU a decode step runs these while the GPU idles (the
engine is synchronous), so they bound how much a decode step can gain from host work.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


from onepath.bench.results import environment, save_json
from onepath.bench.workloads import model_config
from onepath.engine.block_manager import BlockManager
from onepath.engine.model_runner import DecodeGraphs, ModelRunner
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import Scheduler, SchedulerConfig
from onepath.engine.sequence import Sequence
from onepath.models import build_decoder
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops

BLOCK = 16


def run(args) -> dict:
    num_blocks = args.batch * -(-args.max_model_len // BLOCK) + 1
    blocks = BlockManager(num_blocks, BLOCK, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=8192,
                                          max_model_len=args.max_model_len), blocks)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        prompt = torch.randint(3, 150_000, (args.prompt,), generator=gen).tolist()
        scheduler.add(Sequence(i, prompt, SamplingParams(max_tokens=100_000, ignore_eos=True, seed=1)))
    # the runner's static buffers and staging, on the CPU: a tiny model gives them their device and no
    # forward runs (nothing reads the one-block cache: staging writes ids and tables only)
    model = build_decoder(model_config("tiny"), Ops(ExecutionSpec.default("consistent", "cpu")),
                          max_positions=args.max_model_len)
    stage = DecodeGraphs(model, model.make_cache(1, BLOCK), num_blocks, args.max_model_len, [args.batch],
                         capture=False)
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


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt", type=int, default=150)
    p.add_argument("--max-model-len", type=int, default=1200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = run(args)
    if args.out:
        save_json(result, Path(args.out))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
