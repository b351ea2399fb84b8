"""Past one GPU: rollout tokens/s on 1, 2, 4 processes (data-parallel engines, or one tensor-parallel
engine), the RL step's time per layout, and the tensor-parallel row-parallel site's cost, the invariant
gather (models/tensor_parallel.py) against the stock all-reduce of partial sums, at decode shapes.

Each part launches `torchrun --standalone --nproc-per-node N` (NCCL on CUDA, gloo on the CPU) of this
module's worker, or `onepath train`; rank 0 writes its numbers, the driver collects them into one JSON
with its command. On the CPU it is a functional run (2 cores shared by the processes): its numbers show
the benchmark works, not how the layouts scale on GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from onepath.bench.results import environment, print_table, save_json
from onepath.bench.workloads import MODELS, Workload, model_config
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models import build_decoder
from onepath.models.kv_cache import BLOCK_SIZE
from onepath.models.tensor_parallel import TensorParallel
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops

PARTS = ("rollout", "step", "tp-reduce")
# the RL step on GPUs: Qwen3-0.6B's shape on the embedded task, no warm start (the step's time, not its learning)
GPU_TRAIN_ARGS = "--config onepath/configs/qwen3-0.6b-gpu.yaml --warm_start.steps 0 --train.val_every 0 --train.save_every 0"
LAYOUTS = ("dp", "tp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4], help="processes (GPUs) per run")
    p.add_argument("--layouts", nargs="+", default=["dp", "tp"], choices=LAYOUTS, help="rollout layouts")
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    p.add_argument("--requests", type=int, default=256, help="rollout requests per run (all processes together)")
    p.add_argument("--prompt-len", type=int, default=150)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256], help="tp-reduce: rows (decode)")
    p.add_argument("--reps", type=int, default=50, help="tp-reduce: timed repetitions per case")
    p.add_argument("--steps", type=int, default=5, help="step: RL steps per layout (the first is not timed)")
    p.add_argument("--train-args", default=None, help="step: more `onepath train` arguments, one string (default on "
                   "CUDA: " + GPU_TRAIN_ARGS + ")")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/distributed/...)")


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "worker":
        return worker(argv[1:])
    p = argparse.ArgumentParser(prog="python bench/distributed.py", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    label = "gpu" if args.device == "cuda" else "cpu-functional"
    out = Path(args.out or f"bench/results/distributed/distributed-{label}.json")
    result = dict(command="python bench/distributed.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
                  label=label, **environment(args.device), model=args.model, parts={})
    if label == "cpu-functional":
        result["note"] = ("a functional run on the CPU: the processes share the machine's cores, so these numbers "
                          "say that the benchmark runs, not how the layouts scale on GPUs")
    for part in args.parts:
        result["parts"][part] = {"rollout": bench_rollout, "step": bench_step, "tp-reduce": bench_tp_reduce}[part](args)
        save_json(result, out)
    print(f"\nwrote {out}")
    return 0


def torchrun(processes: int, argv: list[str]) -> dict:
    """One launch of this module's worker on `processes` ranks; rank 0's JSON."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
               "-m", "onepath.bench.distributed", "worker", *argv, "--result", str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            return dict(error=(done.stdout + done.stderr)[-2000:])
        return json.loads(path.read_text())


def bench_rollout(args) -> list[dict]:
    rows, base = [], None
    for layout in args.layouts:
        for n in args.processes:
            if layout == "tp" and n == 1:
                continue
            row = dict(layout=layout, processes=n, **torchrun(n, [
                "rollout", "--layout", layout, "--device", args.device, "--model", args.model, "--requests",
                str(args.requests), "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
                "--max-num-seqs", str(args.max_num_seqs)]))
            if n == 1 and "tokens_per_s" in row:
                base = row["tokens_per_s"]
            if base and "tokens_per_s" in row:
                row["speedup"] = row["tokens_per_s"] / base
                row["scaling_efficiency"] = row["speedup"] / n  # the target in DP: >= 0.9
            rows.append(row)
    print_table("rollout tokens/s", ["layout", "processes", "", "tokens/s", "speedup", "efficiency"],
                [[r["layout"], r["processes"], "", r.get("tokens_per_s"), r.get("speedup"), r.get("scaling_efficiency")]
                 for r in rows])
    return rows


def bench_step(args) -> list[dict]:
    """`onepath train` per layout pair; the mean step time over the steps after the first."""
    rows = []
    pairs = [("single", "single", 1)] + [(r, t, n) for n in args.processes if n > 1 for r, t in
                                         (("dp", "fsdp"), ("tp", "fsdp"))]
    for rollout, trainer, n in pairs:
        with tempfile.TemporaryDirectory() as out:
            launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"] if n > 1 else []
            cmd = [sys.executable, *launcher, "-m", "onepath", "train", "--out", out, "--quiet", "--device", args.device,
                   "--train.steps", str(args.steps), "--parallel.rollout", rollout, "--parallel.trainer", trainer,
                   *shlex.split(args.train_args if args.train_args is not None else
                                GPU_TRAIN_ARGS if args.device == "cuda" else "")]
            done = subprocess.run(cmd, capture_output=True, text=True)
            row = dict(rollout=rollout, trainer=trainer, processes=n)
            if done.returncode:
                row["error"] = (done.stdout + done.stderr)[-2000:]
            else:
                history = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
                timed = history[1:] or history
                row.update(step_s=statistics.mean(m["timing_s/step"] for m in timed),
                           gen_s=statistics.mean(m["timing_s/gen"] for m in timed),
                           diff_zero_steps=sum(m["training/rollout_probs_diff_max"] == 0 for m in history),
                           steps=len(history))
        rows.append(row)
    print_table("RL step", ["rollout", "trainer", "processes", "step s", "gen s", "diff=0 steps"],
                [[r["rollout"], r["trainer"], r["processes"], r.get("step_s"), r.get("gen_s"), r.get("diff_zero_steps")]
                 for r in rows])
    return rows


def bench_tp_reduce(args) -> list[dict]:
    rows = []
    config = model_config(args.model)
    for n in [n for n in args.processes if n > 1]:
        result = torchrun(n, ["tp-reduce", "--device", args.device, "--hidden", str(config.hidden_size),
                              "--intermediate", str(config.intermediate_size), "--reps", str(args.reps),
                              "--tokens", *map(str, args.tokens)])
        rows += [dict(processes=n, **r) for r in result.get("rows", [dict(error=result.get("error"))])]
    print_table("TP row-parallel site (down projection), median us", ["processes", "tokens", "", "gather", "all_reduce",
                                                                      "gather / all_reduce"],
                [[r["processes"], r.get("tokens"), "", r.get("gather_us"), r.get("all_reduce_us"), r.get("ratio")]
                 for r in rows])
    return rows


def worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("part")
    p.add_argument("--layout", default="dp")
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=192)
    p.add_argument("--tokens", type=int, nargs="+", default=[1])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--result", required=True)
    a = p.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if a.device == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    try:
        result = (rollout_worker if a.part == "rollout" else tp_reduce_worker)(a)
        if dist.get_rank() == 0:
            Path(a.result).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def rollout_worker(a) -> dict:
    """Every rank an engine (dp: its share of the requests) or one engine over every rank (tp: all of them)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    config = model_config(a.model)
    spec = ExecutionSpec.default("consistent", a.device)
    model = build_decoder(config, Ops(spec), max_positions=a.prompt_len + a.output_len)
    model.init_weights(seed=0)
    if a.layout == "tp":
        model.tensor_parallel()
    w = Workload("fixed", a.requests, (a.prompt_len, a.prompt_len), (a.output_len, a.output_len))
    prompts, _ = w.sample(config.vocab_size, seed=0)
    mine = prompts if a.layout == "tp" else prompts[rank::size]
    engine = LLMEngine(model, block_size=BLOCK_SIZE, cuda_graphs=False if a.layout == "tp" else None,
                       num_blocks=None if a.device == "cuda" else len(mine) * -(-(a.prompt_len + a.output_len) // 16) + 8,
                       scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, max_model_len=a.prompt_len + a.output_len))
    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, seed=1)
    engine.generate(mine[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (graphs, kernels)
    sync(a.device)
    dist.barrier()
    start = time.perf_counter()
    outputs = engine.generate(mine, params)
    sync(a.device)
    seconds = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the run ends when its slowest rank does
    tokens = torch.tensor([sum(len(o.token_ids) for o in outputs) if a.layout == "dp" or rank == 0 else 0])
    dist.all_reduce(tokens)
    return dict(tokens=int(tokens), seconds=float(seconds), tokens_per_s=int(tokens) / float(seconds))


def tp_reduce_worker(a) -> dict:
    """The down projection's row-parallel site at `tokens` rows: the invariant path (all-gather the input,
    the full-K GEMM for this rank's output columns, all-gather the outputs) against the stock one (the
    K shard's GEMM, all-reduce of the partial sums), both on the consistent GEMM, median of `reps`."""
    size = dist.get_world_size()
    spec = ExecutionSpec.default("consistent", a.device)
    ops, dtype = Ops(spec), spec.dtype
    h, i = a.hidden, a.intermediate
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(h, i, generator=g) * 0.02).to(dtype).to(a.device)
    rows = []
    for m in a.tokens:
        x = torch.randn(m, i // size, generator=g).to(dtype).to(a.device)
        times = {}
        for reduce in ("gather", "all_reduce"):
            tp = TensorParallel.over(None, spec)
            tp.reduce = reduce
            rank = tp.rank
            w = weight[rank * tp.width(h):(rank + 1) * tp.width(h)] if reduce == "gather" else \
                weight[:, rank * (i // size):(rank + 1) * (i // size)]
            w = w.contiguous()
            run = lambda: tp.row_parallel(lambda v, _: ops.linear(v, w), x, i, h)  # noqa: E731
            for _ in range(3):
                run()
            samples = []
            for _ in range(a.reps):
                sync(a.device)
                dist.barrier()
                start = time.perf_counter()
                run()
                sync(a.device)
                samples.append(time.perf_counter() - start)
            times[reduce] = statistics.median(samples) * 1e6
        rows.append(dict(tokens=m, gather_us=times["gather"], all_reduce_us=times["all_reduce"],
                         ratio=times["gather"] / times["all_reduce"]))
    return dict(rows=rows)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
