"""DeepSeek-V4-Flash-shaped models for the benches: the published layer shapes with fewer layers and experts, and
what their cache costs.

    python -m onepath.bench.deepseek_v4 cache            # the cache's bytes per token, FP8 KV against BF16

`flash_config` is DeepSeek-V4-Flash's config.json (hidden 4096, 64 heads of 512 with one shared KV head, q_lora_rank
1024, o_groups 8 x o_lora_rank 1024, 64 indexer heads of 128 picking 512 entries, sliding window 128, CSA at 4 and
HCA at 128, mHC with 4 streams, 256 experts of 2048 with 6 routed and one shared, vocab 129280) with any field
overridden. `cache_bytes` splits the cache (models/deepseek_v4_cache.py) into what grows with a sequence (the
pages: compressed entries) and what a running sequence holds at any length (the rings: its sliding window's K = V
rows and its open windows' compressor inputs), for BF16 and for FP8 KV, and their sum over a context.
"""
from __future__ import annotations

import argparse
import json

import torch

from onepath.models.deepseek_v4_cache import PAGED, QUANTISABLE, DeepseekV4Cache, layout
from onepath.models.deepseek_v4_config import DeepseekV4Config
from onepath.models.kv_cache import BLOCK_SIZE
from onepath.numerics.spec import FP8_KV

FLASH = dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
             num_attention_heads=64, head_dim=512, q_lora_rank=1024, partial_rotary_factor=64 / 512,
             num_experts_per_tok=6, n_routed_experts=256, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus",
             hc_mult=4, hc_sinkhorn_iters=20, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64,
             index_head_dim=128, index_topk=512, swiglu_limit=10.0, max_position_embeddings=1048576,
             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m onepath.bench.deepseek_v4", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["cache"])
    p.add_argument("--layers", type=int, default=FLASH["num_hidden_layers"])
    p.add_argument("--context", type=int, default=CONTEXT)
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    args = p.parse_args(argv)
    print(json.dumps(cache_bytes(flash_config(num_hidden_layers=args.layers), args.block_size, args.context),
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
