"""Recurrent state beside the paged KV cache: per Mamba-2 layer and per slot (one per running sequence), the conv
state (the last K - 1 inputs) and the scan's SSDState (the state at the last chunk boundary and the open chunk's
inputs, ops/ssd.py). A hybrid model's engine gives each sequence a slot; the trainer's whole sequences need none.
"""
from __future__ import annotations

import torch

from onepath.models.kv_cache import KVCache
from onepath.numerics.spec import DTYPES, SSD_CHUNK
from onepath.ops.ssd import SSDState


class StateCache:
    def __init__(self, config, num_slots: int, dtype: torch.dtype, chunk: int, device="cpu"):
        state_dtype = DTYPES[config.mamba_ssm_cache_dtype]

        def conv(i):
            return torch.zeros(num_slots, config.conv_kernel - 1, config.conv_dim, dtype=dtype, device=device)

        def ssd(i):
            return SSDState.empty(num_slots, config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
                                  config.ssm_state_size, chunk, dtype, state_dtype, device)

        layers = range(config.num_hidden_layers)
        self.conv = [conv(i) if config.is_mamba_layer(i) else None for i in layers]
        self.ssd = [ssd(i) if config.is_mamba_layer(i) else None for i in layers]
        self.num_slots = num_slots

    @staticmethod
    def bytes_per_slot(config, dtype: torch.dtype, chunk: int) -> int:
        """One sequence's state over all Mamba layers: conv state, boundary state, the open chunk's x, dt and B."""
        size = torch.empty((), dtype=dtype).element_size()
        state_size = torch.empty((), dtype=DTYPES[config.mamba_ssm_cache_dtype]).element_size()
        h, p, g, n = config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.ssm_state_size
        per_layer = ((config.conv_kernel - 1) * config.conv_dim * size + h * p * n * state_size
                     + chunk * (h * p * size + h * 4 + g * n * size))
        return per_layer * sum(map(config.is_mamba_layer, range(config.num_hidden_layers)))


class HybridCache(KVCache):
    """The paged KV of the attention layers and the recurrent state of the Mamba layers: `num_slots` sequences'
    slots and the scratch slot past them (`scratch_slot`), where a static decode batch's padding rows write."""

    def __init__(self, config, num_blocks: int, block_size: int, dtype: torch.dtype, num_slots: int,
                 chunk: int = SSD_CHUNK, device="cpu", kv=None):
        super().__init__(config, num_blocks, block_size, dtype, device, kv)
        self.states = StateCache(config, num_slots + 1, dtype, chunk, device)
        self.num_slots, self.scratch_slot = num_slots, num_slots
