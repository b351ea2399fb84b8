"""Paged KV cache storage: per layer, K and V of shape [num_blocks, block_size, kv_heads, head_dim]."""
from __future__ import annotations

import torch

from onepath.models.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu"):
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # zeros, not empty: unused slots are masked, but 0 * NaN would still poison a masked sum
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize
