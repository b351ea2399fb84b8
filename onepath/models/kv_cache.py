"""Paged KV cache storage: per layer, K and V of shape [num_blocks, block_size, kv_heads, head_dim].

With the spec's attention.kv QuantSpec set (FP8_KV), a layer's K and V are each an FP8Tensor: codes
float8_e4m3fn [num_blocks, block_size, kv_heads, head_dim] and FP32 scales [num_blocks, block_size,
kv_heads, 1], one per token and head, by quant.py's rule. ops/attention.py writes and reads both forms.

Every model builds its own cache one way, `model.make_cache(num_blocks, block_size, num_slots=0)`, with the dtype,
device and quantisation its spec asks for: this KVCache for a dense or MoE decoder and for a hybrid's whole-sequence
forward, HybridCache (state_cache.py) for a hybrid with state slots, DeepseekV4Cache for DeepSeek-V4. A cache with
per-sequence state holds `num_slots` slots for running sequences and one more past them, `scratch_slot`, where the
padding rows of a static decode batch write; the scheduler never hands that one out (docs/models.md, "Caches").
"""
from __future__ import annotations

import torch

from onepath.models.config import ModelConfig
from onepath.numerics.quant import FP8Tensor
from onepath.numerics.spec import QuantSpec

SCALE_BYTES = 4  # one FP32 scale per token and head
BLOCK_SIZE = 16  # tokens per paged-cache block: the default of every engine, trainer and tool


class KVCache:
    # no per-sequence state: no state slots, no scratch slot for padding rows (HybridCache, DeepseekV4Cache have both)
    num_slots = 0
    scratch_slot = None

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", kv: QuantSpec | None = None, kv_heads: int | None = None):
        """kv_heads: the heads this cache holds (a tensor-parallel rank's); None: all of config's."""
        check_kv_spec(kv)
        shape = (num_blocks, block_size, kv_heads or config.num_key_value_heads, config.head_dim)

        def layer():
            # zeros, not empty: unused slots are masked, but 0 * NaN would still poison a masked sum
            if kv is None:
                return torch.zeros(shape, dtype=dtype, device=device)
            return FP8Tensor(torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
                             torch.zeros(*shape[:-1], 1, dtype=torch.float32, device=device), (1, config.head_dim),
                             kv)

        # a hybrid's layers without attention keep no K/V (None)
        self.k = [layer() if config.has_kv_cache(i) else None for i in range(config.num_hidden_layers)]
        self.v = [layer() if config.has_kv_cache(i) else None for i in range(config.num_hidden_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype, kv: QuantSpec | None = None,
                        kv_heads: int | None = None) -> int:
        """K and V of one token over all layers, scales included."""
        per_head = config.head_dim * torch.empty((), dtype=dtype).element_size() if kv is None \
            else config.head_dim + SCALE_BYTES
        layers = sum(map(config.has_kv_cache, range(config.num_hidden_layers)))
        return 2 * layers * (kv_heads or config.num_key_value_heads) * per_head


def check_kv_spec(kv: QuantSpec | None) -> None:
    if kv is not None and (kv.format, kv.scale_domain, kv.scales_applied) != ("fp8_e4m3", "per_token", "load"):
        raise ValueError(f"KV cache quantisation {kv} is not supported: the cache stores FP8 (E4M3) with one "
                         "scale per token and head, dequantised on load; use FP8_KV (quant='fp8_kv')")
