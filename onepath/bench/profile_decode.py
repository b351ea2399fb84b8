"""Where a decode step's time goes: host phases and the GPU kernels of all-decode engine steps.

    python bench/profile_decode.py --model qwen3-0.6b --batch 256 --out bench/results/decode/profile-decode.json
    python bench/profile_decode.py --modes consistent --quants none,fp8,fp8_kv,fp8+fp8_kv   # low precision
    python bench/profile_decode.py --bound bench/results/decode/profile-decode.json   # no GPU: add the bound below

Per mode: an engine (CUDA graphs on) is filled with `batch` requests of `prompt` tokens, stepped
until every sequence decodes, then `steps` steps are timed by phase (schedule, forward + sampling,
postprocess; CUDA-synchronised), and `steps` more run under torch.profiler, whose kernel table
(GPU time per kernel name, summed) is printed and saved.

Each BF16 mode also gets the decode roofline at its batch and mean context (onepath.bench.roofline, as the
rollout bench computes it) and `attention_at_peak`: the step this profile allows if the attention kernels read
the K/V at the HBM peak and every other kernel took what it took here, and that step's fraction of the
roofline, which no change to attention alone can pass. --bound adds both to a saved profile (CPU only).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from onepath.bench.results import environment
from onepath.bench.rollout import add_kernel_arguments, apply_fused_act_quant
from onepath.bench.workloads import model_config
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models import build_decoder
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops


def fill(engine: LLMEngine, batch: int, prompt: int, vocab: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        engine.add_request(torch.randint(0, vocab, (prompt,), generator=g).tolist(),
                           SamplingParams(max_tokens=100_000, ignore_eos=True, seed=seed), request_id=i)
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()


def timed_phases(engine: LLMEngine, steps: int) -> dict:
    phases = {"schedule": [], "forward_and_sample": [], "postprocess": []}
    if engine.pending is not None:  # phases are timed one after the other: no step in flight
        engine.complete()
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        scheduled = engine.scheduler.schedule()
        t1 = time.perf_counter()
        sampled = engine.runner.run(scheduled).result()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        engine.scheduler.postprocess(scheduled, sampled)
        t3 = time.perf_counter()
        for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
            phases[name].append(seconds * 1e3)
    graphs = getattr(engine.model, "capturable", True)  # an expert-parallel MoE decodes eagerly
    assert engine.runner.replayed_graph == graphs, f"the profiled steps {'did not replay' if graphs else 'replayed'} " \
        "a CUDA graph"
    return {name: statistics.median(v) for name, v in phases.items()}


def kernel_table(engine: LLMEngine, steps: int, top: int) -> tuple[list[dict], float]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        gpu_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if event.device_type == torch.autograd.DeviceType.CUDA and gpu_us > 0:
            rows.append(dict(name=event.key[:90], calls=event.count // steps, gpu_ms_per_step=gpu_us / 1e3 / steps))
    rows.sort(key=lambda r: -r["gpu_ms_per_step"])
    return rows[:top], sum(r["gpu_ms_per_step"] for r in rows)


ATTENTION_KERNELS = ("_paged_attention_kernel", "_merge_splits_kernel")


def add_bound(result: dict) -> None:
    """Add `roofline` and `attention_at_peak` to each BF16 mode of a profile (quantised modes read other bytes
    per weight and per token: left out). The roofline's weights are the model's, in the GPU's dtype."""
    from onepath.bench.roofline import HBM_PEAK_B_S, decode_roofline
    from onepath.models.kv_cache import KVCache

    config = model_config(result["options"]["model"])
    dtype = ExecutionSpec.default("consistent", "cuda").dtype
    with torch.device("meta"):  # the weights' shapes, no memory
        model = build_decoder(config, Ops(ExecutionSpec.default("baseline", "cpu")), max_positions=2)
    state = {name: t.to(dtype) for name, t in model.state_dict().items()}
    per_token = KVCache.bytes_per_token(config, dtype, None)
    for name, mode in result["modes"].items():
        if "+" in name:
            continue
        roofline = decode_roofline(state, config, mode["batch"], mode["mean_context"], per_token)
        attention = sum(k["gpu_ms_per_step"] for k in mode["kernels"] if k["name"] in ATTENTION_KERNELS)
        other = mode["gpu_kernel_ms_per_step"] - attention
        at_peak = roofline["kv_bytes"] / HBM_PEAK_B_S * 1e3
        step = roofline["step_seconds_peak"] * 1e3
        mode["roofline"] = roofline
        mode["attention_at_peak"] = dict(
            attention_ms=attention, other_kernels_ms=other, attention_at_peak_ms=at_peak,
            step_ms=other + at_peak, of_roofline=step / (other + at_peak),
            measured_of_roofline=step / mode["gpu_kernel_ms_per_step"])
        print(f"{name}: kernels {mode['gpu_kernel_ms_per_step']:.2f} ms ({step / mode['gpu_kernel_ms_per_step']:.2f} "
              f"of the roofline's {step:.2f}); attention {attention:.2f} ms, at the HBM peak {at_peak:.2f}: "
              f"{other + at_peak:.2f} ms, {step / (other + at_peak):.2f} of the roofline")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--modes", default="consistent,baseline")
    p.add_argument("--quants", default="none", help="comma list of quant presets, each profiled in every mode "
                                                  "(none: BF16; e.g. fp8, fp8_kv, fp8+fp8_kv)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt", type=int, default=150)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--max-model-len", type=int, default=1200)
    p.add_argument("--out", default=None)
    p.add_argument("--bound", type=Path, metavar="FILE", help="add the roofline and attention_at_peak to a saved "
                   "profile, in place; no GPU")
    add_kernel_arguments(p)
    args = p.parse_args(argv)
    apply_fused_act_quant(args)
    if args.bound:
        result = json.loads(args.bound.read_text())
        add_bound(result)
        args.bound.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    config = model_config(args.model)
    result = dict(environment("cuda"), command="python bench/profile_decode.py " + " ".join(argv or sys.argv[1:]),
                  options=vars(args), modes={})
    for mode, quant in [(m, q) for m in args.modes.split(",") for q in args.quants.split(",")]:
        spec = ExecutionSpec.default(mode, "cuda", quant=None if quant == "none" else quant)
        spec = spec.with_settings(args.spec)
        model = build_decoder(config, Ops(spec), max_positions=args.max_model_len)
        model.init_weights(0)
        name = mode if quant == "none" else f"{mode}+{quant}"
        engine = LLMEngine(model, scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=8192,
                                                            max_model_len=args.max_model_len))
        fill(engine, args.batch, args.prompt, config.vocab_size, seed=1)
        for _ in range(5):
            engine.step()
        phases = timed_phases(engine, args.steps)
        kernels, gpu_ms = kernel_table(engine, args.steps, args.top)
        context = statistics.mean(s.num_tokens for s in engine.scheduler.running)
        result["modes"][name] = dict(batch=len(engine.scheduler.running), mean_context=context, host_ms=phases,
                                     cuda_graphs=engine.runner.replayed_graph, gpu_kernel_ms_per_step=gpu_ms,
                                     kernels=kernels)
        print(f"\n{name}: batch {len(engine.scheduler.running)}, context {context:.0f}; host phases (ms, median) "
              + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()) + f"; GPU kernels {gpu_ms:.2f} ms/step")
        for r in kernels:
            print(f"  {r['gpu_ms_per_step']:8.3f} ms  {r['calls']:5d}x  {r['name']}")
        del engine, model
        torch.cuda.empty_cache()
    add_bound(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
