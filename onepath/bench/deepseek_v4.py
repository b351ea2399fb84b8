"""DeepSeek-V4-Flash-shaped models for the benches: the published layer shapes with fewer layers and experts, what
their cache costs, the indexer's top-k against torch.topk, and the rollout benchmark on them.

    python -m onepath.bench.deepseek_v4 cache            # the cache's bytes per token, FP8 KV against BF16
    python -m onepath.bench.deepseek_v4 topk             # index_topk (k = 2048) against torch.topk, us per call
    python -m onepath.bench.deepseek_v4 rollout --out bench/results/deepseek_v4/rollout-flash-4l.json

`flash_config` is DeepSeek-V4-Flash's config.json (bench/workloads.py DEEPSEEK_V4_FLASH) with any field
overridden. `cache_bytes` splits the cache (models/deepseek_v4_cache.py) into what grows with a sequence (the
pages: compressed entries) and what a running sequence holds at any length (the rings: its sliding window's K = V
rows and its open windows' compressor inputs), for BF16 and for FP8 KV, and their sum over a context.
`topk_timings` times ops.index_topk (the consistent kernel: on CUDA the Triton radix select) and torch.topk on the
same scores. `rollout` is bench/rollout.py on the deepseek-v4-flash-4l preset (Flash's layer shapes, 4 layers, 32
experts, random weights) with block-FP8 W8A8 linears, the FP8 KV cache and the indexer scoring in FP8 (the recipe's
fp8+fp8_kv+fp8_indexer), consistent and baseline, 256 requests
of 150 prompt / 3000 output tokens and the ragged workload; its other options pass through (--model
tiny-deepseek-v4 --device cpu --requests 4 --scale 0.01 runs it on a CPU in seconds).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from onepath.bench import rollout as rollout_bench
from onepath.bench.workloads import DEEPSEEK_V4_FLASH
from onepath.models.deepseek_v4_cache import PAGED, QUANTISABLE, DeepseekV4Cache, layout
from onepath.models.deepseek_v4_config import DeepseekV4Config
from onepath.models.kv_cache import BLOCK_SIZE
from onepath.numerics.spec import FP8_KV, ExecutionSpec
from onepath.ops import Ops

FLASH = {k: v for k, v in DEEPSEEK_V4_FLASH.items() if k != "model_type"}
CONTEXT = 150 + 3000  # the rollout bench's fixed workload: 150 prompt and 3000 output tokens


def flash_config(**overrides) -> DeepseekV4Config:
    """DeepSeek-V4-Flash's shapes, `overrides` on top (num_hidden_layers, n_routed_experts, ... to fit a GPU)."""
    return DeepseekV4Config(**{**FLASH, **overrides})


def cache_bytes(config: DeepseekV4Config, block_size: int = BLOCK_SIZE, context: int = CONTEXT) -> dict:
    """BF16 and FP8-KV bytes: per token of the pages, per running sequence of its K = V window ring and of its
    compressor-input rings (unquantised in both), the K = V bytes per token at `context` tokens (pages and window)
    and everything per token at `context`; and each FP8 / BF16 ratio."""
    out = {"context": context, "block_size": block_size}
    for label, kv in (("bf16", None), ("fp8", FP8_KV)):
        window = sum(rows * DeepseekV4Cache.row_bytes(name, width, torch.bfloat16, kv)
                     for i in range(config.num_hidden_layers)
                     for name, (width, rows) in layout(config, i).items() if name in QUANTISABLE and name not in PAGED)
        paged = DeepseekV4Cache.bytes_per_token(config, torch.bfloat16, kv, block_size)
        slot = DeepseekV4Cache.bytes_per_slot(config, torch.bfloat16, kv)
        out[label] = dict(paged_per_token=paged, window_per_sequence=window, state_per_sequence=slot - window,
                          kv_per_token=paged + window / context, total_per_token=paged + slot / context)
    out["fp8_over_bf16"] = {key: out["fp8"][key] / out["bf16"][key] for key in out["bf16"]}
    return out


TOPK_SWEEP = [(1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)]  # (block, num_warps) of the CUDA kernel


def topk_timings(rows: int = 64, length: int = 32768, k: int = 2048, device: str = "cuda", repeats: int = 50,
                 seed: int = 0, sweep: bool = False) -> dict:
    """Microseconds per call of ops.index_topk (consistent: the deterministic 64-bit-key top-k with the selection
    sorted by descending position) and of torch.topk(scores, k) on the same FP32 scores [rows, length], every entry
    valid; the first calls (compilation) untimed. sweep (CUDA): the kernel at each TOPK_SWEEP launch shape too,
    each checked equal to the shipped one's output."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.relu(torch.randn(rows, length, device=device, generator=gen))  # ReLU scores: ties at 0
    valid = torch.ones(rows, length, dtype=torch.bool, device=device)
    ops = Ops(ExecutionSpec.default("consistent", device))
    calls = {"consistent_index_topk": lambda: ops.index_topk(scores, valid, k),
             "torch_topk": lambda: torch.topk(scores, k, dim=-1)}
    if sweep and device == "cuda":
        from onepath.ops.cuda.topk import index_topk as kernel
        shipped = ops.index_topk(scores, valid, k)
        for block, warps in TOPK_SWEEP:
            if not torch.equal(kernel(scores, valid, k, block, warps), shipped):
                raise RuntimeError(f"index_topk with block {block}, {warps} warps selected other positions")
            calls[f"kernel_block{block}_warps{warps}"] = lambda b=block, w=warps: kernel(scores, valid, k, b, w)
    out = {"rows": rows, "length": length, "k": k, "device": device, "repeats": repeats}
    for name, call in calls.items():
        call()
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        sync()
        out[f"{name}_us"] = (time.perf_counter() - start) / repeats * 1e6
    out["over_torch_topk"] = out["consistent_index_topk_us"] / out["torch_topk_us"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m onepath.bench.deepseek_v4", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    cache = sub.add_parser("cache", help="the cache's bytes per token, FP8 KV against BF16")
    cache.add_argument("--layers", type=int, default=FLASH["num_hidden_layers"])
    cache.add_argument("--context", type=int, default=CONTEXT)
    cache.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    topk = sub.add_parser("topk", help="index_topk against torch.topk, us per call")
    topk.add_argument("--rows", type=int, default=64)
    topk.add_argument("--length", type=int, default=32768)
    topk.add_argument("--k", type=int, default=2048)
    topk.add_argument("--repeats", type=int, default=50)
    topk.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    topk.add_argument("--sweep", action="store_true", help="CUDA: also the kernel at each (block, warps) of TOPK_SWEEP")
    sub.add_parser("rollout", help="bench/rollout.py on deepseek-v4-flash-4l, FP8 W8A8 + FP8 KV + the FP8 "
                                   "indexer (options pass through)", add_help=False)
    args, rest = p.parse_known_args(argv)
    if args.what == "rollout":
        defaults = {"--model": "deepseek-v4-flash-4l", "--quant": "fp8+fp8_kv+fp8_indexer",
                    "--workloads": "fixed-3000,ragged"}
        given = {a.split("=")[0] for a in rest}
        chosen = [x for k, v in defaults.items() if k not in given for x in (k, v)]  # --model appends: one default
        return rollout_bench.main([*chosen, "--no-hf", *rest], prog="python -m onepath.bench.deepseek_v4 rollout")
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.what == "cache":
        result = cache_bytes(flash_config(num_hidden_layers=args.layers), args.block_size, args.context)
    else:
        result = topk_timings(args.rows, args.length, args.k, args.device, args.repeats, sweep=args.sweep)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
