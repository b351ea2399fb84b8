"""Decode roofline: the HBM bytes one decode step must read, and the tokens/s the bandwidth allows.

A decode step at batch B, each sequence attending over L keys, reads at least every weight matrix
once (the LM head in full, the embedding only the B gathered rows) and B * L tokens of K/V.
Activations and the K/V write of the new token are left out: a floor, not a model of the kernels.
"""
from __future__ import annotations

import torch

from onepath.models.config import ModelConfig

HBM_PEAK_B_S = 4.8e12
HBM_PEAK_SOURCE = "NVIDIA H200 datasheet: HBM3e peak 4.8 TB/s"
COPY_CEILING_B_S = 4.2e12
COPY_CEILING_SOURCE = "device-to-device copy (read+write) measured on the lent H200, ../shared/GPU.md"


def weight_bytes(state: dict[str, torch.Tensor], config: ModelConfig, batch: int) -> int:
    embed = state["model.embed_tokens.weight"]
    total = sum(t.numel() * t.element_size() for t in state.values())
    embed_bytes = embed.numel() * embed.element_size()
    lm_head = embed_bytes if config.tie_word_embeddings else 0  # untied: lm_head.weight is in the state
    return total - embed_bytes + lm_head + batch * embed.shape[1] * embed.element_size()


def decode_roofline(state: dict[str, torch.Tensor], config: ModelConfig, batch: int, context: float,
                    kv_bytes_per_token: int) -> dict:
    weights = weight_bytes(state, config, batch)
    kv = round(batch * context * kv_bytes_per_token)
    total = weights + kv
    return dict(batch=batch, context=context, weight_bytes=weights, kv_bytes=kv, bytes=total,
                step_seconds_peak=total / HBM_PEAK_B_S, tokens_per_s_peak=batch * HBM_PEAK_B_S / total,
                step_seconds_copy=total / COPY_CEILING_B_S, tokens_per_s_copy=batch * COPY_CEILING_B_S / total)


def roofline_fraction(tokens_per_s: float, roofline: dict) -> dict:
    return dict(of_peak=tokens_per_s / roofline["tokens_per_s_peak"],
                of_copy=tokens_per_s / roofline["tokens_per_s_copy"])
