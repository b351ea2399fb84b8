"""Rollout tokens/s of the engine (consistent, baseline) and of transformers' generate, vs the decode roofline.

One run covers every model, workload and mode (`onepath bench rollout`, or bench/rollout.py):

    onepath bench rollout --model qwen3-0.6b --device cuda --out bench/results/rollout/rollout-qwen3-0.6b.json
    python bench/rollout.py --model tiny --device cpu --requests 8 --scale 0.02
    python bench/rollout.py --model qwen3-30b-a3b-12l --workloads fixed-1000 --out bench/results/rollout/rollout-qwen3-moe.json

Each (workload, mode) runs on a fresh engine (max_model_len fitted to the workload) over the same
weights and prompts; the engine is warmed up (Triton compilation, CUDA-graph capture, prefill and
decode at every row count that changes a GEMM's tiles) before anything is timed, and freed before
the next is built. After the first fixed workload, a window of steps in which every sequence
decodes is timed against the decode roofline of its batch and context. A measurement that fails is
recorded with its error and the run goes on; the JSON is rewritten after every measurement.
An MoE model (qwen3-30b-a3b-12l, tiny-moe) decodes eagerly (it reads expert counts on the host) and
is held to its own consistent/baseline target (summary.TARGETS); so is the hybrid (nemotron-3-nano-13l,
tiny-hybrid: Nemotron-H, its decode in CUDA graphs, its roofline counting each sequence's recurrent state).

Each generate shows a progress bar with its time left; on the CPU the run first prints its estimated
length: the engine tokens it will run times the seconds a token took in a first timed step.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import math
import os
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from onepath.bench.hf_generate import hf_generate, hf_model
from onepath.bench.results import environment, save_json
from onepath.bench.roofline import COPY_CEILING_B_S, COPY_CEILING_SOURCE, HBM_PEAK_B_S, HBM_PEAK_SOURCE
from onepath.bench.summary import TARGETS, WORKLOAD_ROOFLINE, checks, derive, errors, print_summary
from onepath.bench.workloads import MODELS, WORKLOADS, Workload, model_config, workload
from onepath.engine.device import require_device
from onepath.engine.llm_engine import LLMEngine, young_collections_only
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.config import ModelConfig
from onepath.models import build_decoder
from onepath.models.deepseek_v4_cache import DeepseekV4Cache
from onepath.models.deepseek_v4_config import DeepseekV4Config
from onepath.models.kv_cache import BLOCK_SIZE, KVCache
from onepath.numerics.spec import MODES, ExecutionSpec
from onepath.ops import Ops


DECODE_SKIP = 2            # decode steps run before the timed window
PROBE_TOKENS = 256         # the CPU estimate's first step: as many rows as a full batch's decode step
LONG_RUN_S = 600           # a CPU run estimated longer than this is told how to make it short
EXAMPLE = "example: onepath bench rollout --model tiny --device cpu --requests 8 --scale 0.02 --no-hf"
SHORT_RUN = ("for a short run pass --model tiny, or --requests 8 --scale 0.02 (fewer requests, prompts and "
             "outputs scaled down), or --workloads fixed-1000 --modes consistent")


def add_kernel_arguments(p: argparse.ArgumentParser) -> None:
    """The kernel settings the rollout and profile benches share: --spec and --no-fused-act-quant."""
    p.add_argument("--spec", action="append", default=[], metavar="OP.FIELD=VALUE",
                   help="kernel settings for both modes, e.g. attention.q_rows=16 attention.kv_tile=64")
    p.add_argument("--no-fused-act-quant", action="store_true",
                   help="with FP8 linears, the standalone activation quantiser instead of RMSNorm and SiLU-mul "
                        "quantising their output in their own launch (ops/linear_quant.FUSED_ACT_QUANT; the same bits)")


def apply_fused_act_quant(args: argparse.Namespace) -> None:
    """--no-fused-act-quant turns ops/linear_quant.FUSED_ACT_QUANT off for this process."""
    if args.no_fused_act_quant:
        from onepath.ops import linear_quant
        linear_quant.FUSED_ACT_QUANT = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", help=f"{', '.join(MODELS)}; repeat or comma-separate "
                   "(default qwen3-0.6b)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list (default: all)")
    p.add_argument("--modes", default=",".join(MODES), help="comma list (default: consistent,baseline)")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also time transformers' generate on the same weights and prompts")
    p.add_argument("--hf-workload", default="fixed-1000", help="the fixed workload HF generate runs")
    p.add_argument("--hf-requests", type=int, default=None,
                   help="HF on the first N requests only (one batch of N; compare tokens/s, not seconds)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="each step waits for the last one's tokens before the next is scheduled")
    p.add_argument("--quant", default=None, help="low-precision presets for both modes, e.g. fp8+fp8_kv")
    add_kernel_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="JSON path (default bench/results/rollout/rollout-MODELS-DEVICE.json)")
    p.add_argument("--requests", type=int, default=None, help="requests per workload (default 256)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every prompt and output length (CPU runs)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--decode-steps", type=int, default=64, help="steps in the timed all-decode window")
    p.add_argument("--decode-prompts", type=_lengths, default=None, metavar="N[,N...]",
                   help="prompt lengths of the all-decode windows, one window each (default: the first fixed "
                        "workload's prompt length); e.g. 150,1000,3000 times decode steps at three contexts")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default torch's; 1 for tiny CPU runs)")
    p.add_argument("--graph-batch-sizes", type=_lengths, default=None, metavar="N[,N...]",
                   help="the batch sizes decode graphs are captured at (default the engine's: 1, 2, 4, 8 and "
                        "multiples of 16 up to --max-num-seqs); a decode step pads to the next one")


def main(argv: list[str] | None = None, prog: str = "python bench/rollout.py") -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], epilog=EXAMPLE)
    add_arguments(parser)
    return run(parser.parse_args(argv), f"{prog} {shlex.join(argv)}")


def run(args: argparse.Namespace, command: str) -> int:
    """Run every model, print the tables, write the JSON; 0 when every measurement ran (targets aside)."""
    models = _names(args.model or ["qwen3-0.6b"], MODELS, "model")
    workloads = [workload(n).scaled(args.requests, args.scale) for n in _names([args.workloads], WORKLOADS, "workload")]
    modes = _names([args.modes], MODES, "mode")
    _check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    apply_fused_act_quant(args)
    out = Path(args.out or f"bench/results/rollout/rollout-{'+'.join(models)}-{args.device}.json")
    result = dict(environment(args.device), command=command, options=vars(args), targets=TARGETS,
                  hbm=dict(peak_B_s=HBM_PEAK_B_S, peak_source=HBM_PEAK_SOURCE, copy_ceiling_B_s=COPY_CEILING_B_S,
                           copy_ceiling_source=COPY_CEILING_SOURCE, workload_roofline=WORKLOAD_ROOFLINE),
                  models={}, checks=[])
    for name in models:
        result["models"][name] = entry = {}
        bench_model(name, workloads, modes, args, entry, lambda: save_json(result, out))
        result["checks"] += checks(name, entry)
        save_json(result, out)
    print_summary(result)
    print(f"\nwrote {out}")
    return 1 if any(errors(m) for m in result["models"].values()) else 0


def _lengths(text: str) -> list[int]:
    """--decode-prompts: a comma list of positive integers."""
    lengths = text.split(",")
    if not all(n.strip().isdigit() and int(n) > 0 for n in lengths):
        raise argparse.ArgumentTypeError(f"{text!r} must be positive integers, e.g. 150,1000")
    return [int(n) for n in lengths]


def _decode_prompts(args, decode_on: Workload | None) -> list[int]:
    """The decode windows' prompt lengths (none without a fixed workload to run them after)."""
    if decode_on is None:
        return []
    if args.decode_prompts is None:
        return [decode_on.prompt_len[0]]
    return args.decode_prompts


def _names(values: list[str], known, what: str) -> list[str]:
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"{what} {unknown or names!r} is unknown: use one or more of {', '.join(known)}")
    return list(dict.fromkeys(names))


def _check(args) -> None:
    require_device(args.device)
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization {args.gpu_memory_utilization} must be in (0, 1]")
    for name in ("requests", "hf_requests", "decode_steps", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.scale <= 0:
        raise ValueError(f"--scale {args.scale} must be > 0")
    if args.hf and args.hf_workload not in WORKLOADS:
        raise ValueError(f"--hf-workload {args.hf_workload!r} is unknown: use one of {', '.join(WORKLOADS)}")


def bench_model(name: str, workloads: list[Workload], modes: list[str], args, entry: dict, save) -> None:
    """Each workload on a fresh engine per mode (max_model_len fitted to it), then HF generate."""
    config = model_config(name)
    decode_on = next((w for w in workloads if w.fixed), None)
    windows = _decode_prompts(args, decode_on)
    entry.update(config=config.to_dict(), dtype=str(_dtype(args)), workloads={},
                 decode_steps=[dict(workload=decode_on.name, prompt_len=n, modes={}) for n in windows])
    try:
        state = random_weights(config, args)
    except Exception as e:  # noqa: BLE001
        entry.update(failure("random weights", e))
        return
    entry["weight_bytes"] = sum(t.numel() * t.element_size() for t in state.values())
    plan = []
    for w in workloads:
        prompts, outputs = w.sample(config.vocab_size, seed=args.seed * 1000 + list(WORKLOADS).index(w.name))
        max_model_len = 16 + max([max(map(len, prompts)) + max(outputs),
                                  *(n + _window_tokens(w, n, args) for n in windows if w is decode_on)])
        plan.append((w, prompts, outputs, max_model_len))
    if args.device == "cpu":
        announce_estimate(name, config, state, plan, modes, windows, decode_on, args)
    for w, prompts, outputs, max_model_len in plan:
        row = entry["workloads"][w.name] = dict(
            requests=w.requests, prompt_len=list(w.prompt_len), output_len=list(w.output_len),
            prompt_tokens=sum(map(len, prompts)), output_tokens=sum(outputs), max_model_len=max_model_len, modes={})
        for mode in modes:
            bench_engine(name, config, mode, state, w, prompts, outputs, max_model_len, w is decode_on, args, entry)
            save()
        if args.hf and w.name == args.hf_workload:
            bench_hf(name, config, state, w, prompts, args, row)
            save()
    derive(entry, state, config, args.max_num_seqs, _kv_bytes_per_token(config, args))


def announce_estimate(name: str, config: ModelConfig, state: dict, plan: list, modes: list[str], windows: list[int],
                      decode_on: Workload | None, args) -> None:
    """Print how long the engine runs should take on this CPU: the tokens they run (warm-up, timed generate,
    decode windows) times the seconds per token of a first step of PROBE_TOKENS prompt tokens."""
    tokens = 0
    for w, prompts, outputs, max_model_len in plan:
        batch = min(args.max_num_seqs, w.requests)
        calls = warm_up_calls(max_model_len, batch, args, [len(p) for p in prompts])
        calls.append(([len(p) for p in prompts], outputs))
        calls += [([n] * batch, [_window_tokens(w, n, args)] * batch) for n in windows if w is decode_on]
        tokens += len(modes) * sum(tokens_run(lengths, max_tokens, max_model_len) for lengths, max_tokens in calls)
    try:
        probe, seconds = first_step(config, state, modes[0], args)
    except Exception as e:  # noqa: BLE001 -- the measurement itself records what fails
        print(f"{name}: no time estimate ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return
    total = tokens * seconds / probe
    params = sum(t.numel() for t in state.values())
    print(f"{name} on the cpu ({params / 1e9:.3g}B parameters): about {_duration(total)} for the engine's "
          f"{tokens / 1e6:.3g}M tokens ({len(plan)} workloads x {len(modes)} modes, warm-up included) at "
          f"{1e3 * seconds / probe:.3g} ms a token, from a first step of {probe} tokens in {modes[0]} mode; attention "
          f"over long contexts{' and HF generate' if args.hf else ''} add to it", flush=True)
    if total > LONG_RUN_S:
        print(f"  {SHORT_RUN}", flush=True)


def first_step(config: ModelConfig, state: dict, mode: str, args) -> tuple[int, float]:
    """(tokens, seconds) of a prefill of PROBE_TOKENS random tokens on a fresh engine, the second of two
    (the first pays one-off costs: allocations, lazy initialisation)."""
    tokens = min(PROBE_TOKENS, args.max_num_batched_tokens)
    engine, _ = build_engine(config, mode, state, tokens + 16, 1, args)
    g = torch.Generator().manual_seed(args.seed)
    for _ in range(2):
        prompt = torch.randint(0, config.vocab_size, (tokens,), generator=g).tolist()  # fresh: no prefix-cache hit
        start = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True, seed=args.seed))
        seconds = time.perf_counter() - start
    del engine
    _free(args.device)
    return tokens, seconds


def tokens_run(prompt_lens: list[int], max_tokens: list[int], max_model_len: int) -> int:
    """Tokens the engine runs for these requests: each prompt, then every sampled token but the last."""
    return sum(min(p + n, max_model_len) - 1 for p, n in zip(prompt_lens, max_tokens))


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def random_weights(config: ModelConfig, args) -> dict[str, torch.Tensor]:
    """The weights every engine and HF get: model.init_weights(seed) in the device's dtype, on the CPU."""
    model = build_decoder(config, Ops(ExecutionSpec.default("baseline", args.device)), max_positions=2)
    model.init_weights(args.seed)
    state = model.hf_state_dict()
    del model
    _free(args.device)
    return state


def bench_engine(name, config, mode, state, w: Workload, prompts, outputs, max_model_len, decode: bool, args,
                 entry) -> None:
    """Build, warm up, time one workload (and the decode window), free; a failure is recorded, not raised."""
    engine, stage, rows = None, "building or warming up the engine", entry["workloads"][w.name]["modes"]
    try:
        batch = min(args.max_num_seqs, w.requests)
        engine, used = build_engine(config, mode, state, max_model_len, batch, args)
        label = f"{name} {w.name} {mode}"
        warm_up(engine, max_model_len, batch, args, [len(p) for p in prompts], label=f"{label} warm-up")
        stage = "the timed generate"
        rows[mode] = dict(timed_generate(engine, prompts, outputs, args, label=label), engine=used,
                          memory=memory(engine))
        print(f"{name} {w.name} {mode}: {rows[mode]['tokens_per_s']:.1f} output tokens/s", flush=True)
        for window in entry["decode_steps"] if decode else ():
            stage = "the decode window"
            rows = window["modes"]
            rows[mode] = decode_window(engine, w, window["prompt_len"], args,
                                       label=f"{label} decode window at {window['prompt_len']}")
    except Exception as e:  # noqa: BLE001 -- a failed mode is a result; the run goes on
        rows[mode] = failure(stage, e)
        print(f"{name} {w.name} {mode}: {rows[mode]['error']}", *rows[mode]["where"], sep="\n  at ", file=sys.stderr,
              flush=True)
    del engine
    _free(args.device)


TRACE_FRAMES = 6  # a failure's innermost frames, recorded beside its message


def failure(stage: str, e: Exception) -> dict:
    """A failed measurement's record: the stage and the error (cut to 2000 characters), and under "where" the
    innermost frames that raised it, "path:line function" (paths from the working directory), innermost last: a
    failure on a GPU machine reads without a rerun."""
    frames = traceback.extract_tb(e.__traceback__)[-TRACE_FRAMES:]
    return dict(error=f"{stage}: {type(e).__name__}: {e}"[:2000],
                where=[f"{shown_path(f.filename)}:{f.lineno} {f.name}" for f in frames])


def shown_path(path: str) -> str:
    """path from the working directory where it lies under it, else as it is."""
    mine = os.path.relpath(path)
    return path if mine.startswith("..") else mine


def build_engine(config: ModelConfig, mode: str, state: dict, max_model_len: int, batch: int,
                 args) -> tuple[LLMEngine, dict]:
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    spec = ExecutionSpec.default(mode, args.device, quant=args.quant)
    spec = spec.with_settings(args.spec)
    model = build_decoder(config, Ops(spec), max_positions=max_model_len)
    model.load_hf_state_dict(state)
    accepted = inspect.signature(LLMEngine).parameters
    kwargs = dict(block_size=BLOCK_SIZE, scheduler=SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len))
    if args.device == "cuda" and "gpu_memory_utilization" in accepted:
        kwargs.update(num_blocks=None, gpu_memory_utilization=args.gpu_memory_utilization)
    else:
        # the CPU, or an engine that cannot size its cache: room for `batch` sequences of max_model_len
        kwargs["num_blocks"] = batch * math.ceil(max_model_len / BLOCK_SIZE)
    if "cuda_graphs" in accepted:
        kwargs["cuda_graphs"] = False if args.no_cuda_graphs else None
    if args.graph_batch_sizes:
        kwargs["graph_batch_sizes"] = args.graph_batch_sizes
    if "async_scheduling" in accepted:
        kwargs["async_scheduling"] = not args.no_async_scheduling
    used = dict(kwargs, scheduler=dataclasses.asdict(kwargs["scheduler"]),
                cuda_graphs=kwargs.get("cuda_graphs", "not an engine option"))
    return LLMEngine(model, **kwargs), used


def memory(engine: LLMEngine) -> dict:
    reported = getattr(engine, "memory", None)
    if reported:
        return dict(reported)
    model = engine.model
    kv_bytes_per_token = KVCache.bytes_per_token(model.config, model.ops.spec.dtype, model.ops.spec.op("attention").kv)
    num_blocks, block_size = engine.block_manager.num_blocks, engine.block_manager.block_size
    return dict(weights_gib=sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30,
                kv_cache_gib=num_blocks * block_size * kv_bytes_per_token / 2**30, num_blocks=num_blocks,
                block_size=block_size, kv_bytes_per_token=kv_bytes_per_token,
                source="computed by the benchmark: the engine reports no .memory")


def warm_up_calls(max_model_len: int, batch: int, args, prompt_lens: list[int] = ()) -> list[tuple[list, list]]:
    """The warm-up's generate calls, each (prompt lengths, max_tokens): prefill steps of budget, budget/2, ...
    rows, then decode steps at batch sizes `batch`, the multiples of 16 below it, 8, 4, 2, 1; then, given the
    workload's prompt lengths, its own prefill: prompts of those lengths decoding until all are prefilled,
    so that the timed run's steps have the row counts of steps run here."""
    length = max(1, min(64, max_model_len // 4))
    calls, rows = [], args.max_num_batched_tokens
    while rows >= length:
        n = min(args.max_num_seqs, rows // length)
        calls.append(([length] * n, [1] * n))
        rows //= 2
    sizes = {b for b in (1, 2, 4, 8) if b < batch} | set(range(16, batch, 16)) | {batch}
    # request i stops once the batch has shrunk below i + 1: decode runs at each size once
    decode = [min(1 + sum(s > i for s in sizes), max_model_len - length) for i in range(batch)]
    calls.append(([length] * batch, decode))
    if prompt_lens:
        steps = math.ceil(sum(prompt_lens) / args.max_num_batched_tokens) + 2
        calls.append((list(prompt_lens), [max(1, min(steps, max_model_len - n)) for n in prompt_lens]))
    return calls


def warm_up(engine: LLMEngine, max_model_len: int, batch: int, args, prompt_lens: list[int] = (),
            label: str | None = None) -> None:
    """Run warm_up_calls on fresh random tokens (no prefix-cache hit). Kernels compile per tile config and
    per whether M fills its tiles (a launch at a new row count may need a new build, a slow step inside the
    timed run without this: rollout-qwen3-0.6b-step-profile.json); here, not in the timed region.
    label: a progress bar per call."""
    g = torch.Generator().manual_seed(args.seed + 7919)
    calls = warm_up_calls(max_model_len, batch, args, prompt_lens)
    for i, (lengths, max_tokens) in enumerate(calls):
        prompts = [torch.randint(0, engine.model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
        engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True, seed=args.seed) for n in max_tokens],
                        progress=None if label is None else f"{label} {i + 1}/{len(calls)}")
    _sync(args.device)


def timed_generate(engine: LLMEngine, prompts: list[list[int]], outputs: list[int], args,
                   label: str | None = None) -> dict:
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=args.seed) for n in outputs]
    before = _counters(engine.stats)
    engine.step_times = []
    _sync(args.device)
    start = time.perf_counter()
    outs = engine.generate(prompts, params, progress=label)
    _sync(args.device)
    seconds = time.perf_counter() - start
    stats = _delta(before, _counters(engine.stats))
    steps, engine.step_times = step_profile(engine.step_times), None
    short = [(o, n) for o, n in zip(outs, outputs) if o.error or len(o.token_ids) != n]
    if short:
        o, n = short[0]
        raise RuntimeError(f"{len(short)} requests did not generate their tokens; request {o.request_id}: "
                           f"{o.error or f'{len(o.token_ids)} tokens of {n}'}")
    generated, prompt_tokens = sum(len(o.token_ids) for o in outs), sum(map(len, prompts))
    return dict(seconds=seconds, steps=stats.get("steps"), generated_tokens=generated, prompt_tokens=prompt_tokens,
                tokens_per_s=generated / seconds, total_tokens_per_s=(generated + prompt_tokens) / seconds, stats=stats,
                step_profile=steps)


def step_profile(times: list[tuple[float, bool]], slowest: int = 5) -> dict:
    """Where a generate's wall time went, from the host's time per step (with async scheduling a step's
    host time is the GPU's pace): eager and graph steps' counts and seconds, the graph steps' mean ms in
    each tenth of the run (a fixed workload's context grows with the step), their median and slowest."""
    graph = [t for t, replayed in times if replayed]
    tenths = [graph[i * len(graph) // 10:(i + 1) * len(graph) // 10] for i in range(10)] if len(graph) >= 10 else []
    top = sorted(range(len(times)), key=lambda i: -times[i][0])[:slowest]
    return dict(steps=len(times), seconds=sum(t for t, _ in times),
                eager_steps=len(times) - len(graph), eager_seconds=sum(t for t, replayed in times if not replayed),
                graph_steps=len(graph), graph_seconds=sum(graph),
                graph_ms_median=1e3 * statistics.median(graph) if graph else None,
                graph_ms_by_tenth=[1e3 * sum(part) / len(part) for part in tenths],
                slowest=[dict(step=i, ms=1e3 * times[i][0], graph=times[i][1]) for i in top])


def _window_tokens(w: Workload, prompt_len: int, args) -> int:
    """max_tokens of a decode-window request: room for what it samples during the batch's prefill
    (twice the steps a full budget needs: chunks end on KV-tile boundaries), the skipped steps, the
    window, and one more, so that no sequence finishes inside the window."""
    batch = min(w.requests, args.max_num_seqs)
    prefill_steps = math.ceil(batch * prompt_len / args.max_num_batched_tokens)
    return 2 * prefill_steps + 2 + DECODE_SKIP + args.decode_steps


def decode_window(engine: LLMEngine, w: Workload, prompt_len: int, args, label: str | None = None) -> dict:
    """Time --decode-steps engine steps in which every sequence decodes, after prompts of prompt_len tokens
    (fresh prompts: no prefix-cache hits). label: a progress bar (updated outside the timed steps)."""
    batch, max_tokens = min(w.requests, args.max_num_seqs), _window_tokens(w, prompt_len, args)
    g = torch.Generator().manual_seed(args.seed + 104729)
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=args.seed))
           for p in torch.randint(0, engine.model.config.vocab_size, (batch, prompt_len), generator=g).tolist()]
    scheduler, bar = engine.scheduler, engine.progress_bar(label, ids)
    before_window = engine.stats.prefill_tokens + engine.stats.generated_tokens

    def show():
        if bar is not None:
            bar.update(engine.stats.prefill_tokens + engine.stats.generated_tokens - before_window - bar.n)
    with young_collections_only():  # as generate() steps
        for _ in range(max_tokens):
            if not scheduler.waiting and all(s.num_uncomputed_tokens == 1 for s in scheduler.running):
                break
            engine.step()
            show()
        for _ in range(DECODE_SKIP):
            engine.step()
        running, preemptions = list(scheduler.running), scheduler.num_preemptions
        if not running:
            raise RuntimeError("no sequence is running after prefill: the decode window has nothing to time")
        context = sum(s.num_tokens for s in running) / len(running)  # keys per sequence the first step reads
        before = _counters(engine.stats)
        _sync(args.device)
        start = time.perf_counter()
        for _ in range(args.decode_steps):
            engine.step()
        _sync(args.device)
        seconds = time.perf_counter() - start
        stats = _delta(before, _counters(engine.stats))
        show()
        while engine.has_unfinished():
            engine.step()
            show()
    if bar is not None:
        bar.close()
    pure = (len(running) == batch and stats.get("generated_tokens") == batch * args.decode_steps
            and stats.get("prefill_tokens") == 0 and scheduler.num_preemptions == preemptions)
    return dict(batch=len(running), context=context + (args.decode_steps - 1) / 2, steps=args.decode_steps,
                seconds=seconds, seconds_per_step=seconds / args.decode_steps,
                tokens_per_s=len(running) * args.decode_steps / seconds, pure_decode=pure, stats=stats)


def bench_hf(name: str, config: ModelConfig, state: dict, w: Workload, prompts, args, row: dict) -> None:
    model = None
    try:
        if not w.fixed:
            raise ValueError(f"--hf-workload {w.name} has ragged lengths; HF generate takes one max_new_tokens "
                             "per batch: choose a fixed workload")
        prompts = prompts[:args.hf_requests or w.requests]
        print(f"{name} {w.name} HF generate: {len(prompts)} requests x {w.output_len[0]} tokens "
              "(no progress bar: one transformers call)", flush=True)
        model = hf_model(config, state, _dtype(args), args.device)
        pad = config.pad_token_id or 0
        hf_generate(model, prompts, 2, pad, args.seed)  # warm-up: first-call allocations, cuBLAS handles
        row["hf"] = hf_generate(model, prompts, w.output_len[0], pad, args.seed)
        print(f"{name} {w.name} HF generate: {row['hf']['tokens_per_s']:.1f} output tokens/s", flush=True)
    except Exception as e:  # noqa: BLE001
        row["hf"] = failure("HF generate", e)
        print(f"{name} {w.name} {row['hf']['error']}", *row["hf"]["where"], sep="\n  at ", file=sys.stderr, flush=True)
    del model
    _free(args.device)


def _counters(stats) -> dict:
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before[k] for k, v in after.items() if isinstance(v, (int, float)) and k in before}


def _kv_bytes_per_token(config: ModelConfig, args) -> float:
    spec = ExecutionSpec.default("consistent", args.device, quant=args.quant)
    if isinstance(config, DeepseekV4Config):  # a layout of its own, the indexer's keys by their own rule
        return DeepseekV4Cache.bytes_per_token(config, spec.dtype, spec.op("attention").kv,
                                               index_kv=spec.op("indexer").kv)
    return KVCache.bytes_per_token(config, spec.dtype, spec.op("attention").kv)


def _dtype(args) -> torch.dtype:
    return ExecutionSpec.default("baseline", args.device).dtype


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
