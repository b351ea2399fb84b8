"""Decode roofline: the HBM bytes one decode step must read, and the tokens/s the bandwidth allows.

A decode step at batch B, each sequence attending over L keys, reads at least every weight matrix
once (the LM head in full, the embedding only the B gathered rows) and B * L tokens of K/V.
Activations and the K/V write of the new token are left out: a floor, not a model of the kernels.

A hybrid's Mamba layers read each sequence's recurrent state once (its scan state and conv inputs).
A mixture-of-experts layer reads its router and only the experts its B * k (token, slot) pairs
touch. Routing is taken as uniform and independent (random weights route close to that), so an
expert goes untouched with probability (1 - k/E)^B: at B = 256, k = 8, E = 128 that is 7e-8 and a
step reads every expert; at B = 1 it reads k of them.
"""
from __future__ import annotations

import torch

from onepath.models.config import ModelConfig
from onepath.numerics.spec import DTYPES

HBM_PEAK_B_S = 4.8e12
HBM_PEAK_SOURCE = "NVIDIA H200 datasheet: HBM3e peak 4.8 TB/s"
# HBM peaks by the device name torch reports: the H100 SXM5's HBM3, the H200's HBM3e (datasheets)
HBM_PEAKS = {"H200": (4.8e12, HBM_PEAK_SOURCE), "H100": (3.35e12, "NVIDIA H100 SXM5 datasheet: HBM3 peak 3.35 TB/s")}
# dense BF16 tensor-core peaks by device name (datasheets; the H200 has the H100 SXM5's compute)
TENSOR_PEAKS = {"H200": (989e12, "NVIDIA H200 datasheet: BF16 dense 989 TFLOP/s"),
                "H100": (989e12, "NVIDIA H100 SXM5 datasheet: BF16 dense 989 TFLOP/s")}
COPY_CEILING_B_S = 4.2e12
COPY_CEILING_SOURCE = "device-to-device copy (read+write) measured on the lent H200, ../shared/GPU.md"


def hbm_peak(device_name: str) -> tuple[float, str]:
    """(bytes/s, source) of the named GPU's HBM peak; the H200's where the name is not one of HBM_PEAKS'
    (the source then says so)."""
    for key, peak in HBM_PEAKS.items():
        if key in device_name:
            return peak
    return HBM_PEAK_B_S, f"{HBM_PEAK_SOURCE} (assumed: {device_name!r} is not in HBM_PEAKS)"


def tensor_peak(device_name: str) -> tuple[float, str]:
    """(FLOP/s, source) of the named GPU's dense BF16 tensor-core peak; the H200's where the name is not known."""
    for key, peak in TENSOR_PEAKS.items():
        if key in device_name:
            return peak
    return TENSOR_PEAKS["H200"][0], f"{TENSOR_PEAKS['H200'][1]} (assumed: {device_name!r} is not in TENSOR_PEAKS)"


def experts_touched(config: ModelConfig, batch: int) -> float:
    """The expected fraction of a sparse layer's experts that a decode step at `batch` reads (uniform routing)."""
    return 1 - (1 - config.num_experts_per_tok / config.num_experts) ** batch if config.is_moe else 1.0


def weight_bytes(state: dict[str, torch.Tensor], config: ModelConfig, batch: int) -> int:
    embed = state.get("model.embed_tokens.weight", state.get("backbone.embeddings.weight"))  # a hybrid's: backbone.*
    nbytes = lambda t: t.numel() * t.element_size()
    experts = sum(nbytes(t) for name, t in state.items() if ".mlp.experts." in name or ".mixer.experts." in name)
    total = sum(nbytes(t) for t in state.values()) - experts
    lm_head = nbytes(embed) if config.tie_word_embeddings else 0  # untied: lm_head.weight is in the state
    return (total - nbytes(embed) + lm_head + batch * embed.shape[1] * embed.element_size()
            + round(experts * experts_touched(config, batch)))


def recurrent_state_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """What a decode step of one sequence must read of a hybrid's recurrent state at least: each Mamba layer's scan
    state and its conv inputs once (0 for a model without one)."""
    if not hasattr(config, "is_mamba_layer"):
        return 0
    state = torch.empty((), dtype=DTYPES[config.mamba_ssm_cache_dtype]).element_size()
    per_layer = (config.mamba_num_heads * config.mamba_head_dim * config.ssm_state_size * state
                 + (config.conv_kernel - 1) * config.conv_dim * torch.empty((), dtype=dtype).element_size())
    return per_layer * sum(map(config.is_mamba_layer, range(config.num_hidden_layers)))


def decode_roofline(state: dict[str, torch.Tensor], config: ModelConfig, batch: int, context: float,
                    kv_bytes_per_token: int) -> dict:
    weights = weight_bytes(state, config, batch)
    kv = round(batch * context * kv_bytes_per_token)
    recurrent = batch * recurrent_state_bytes(config, next(iter(state.values())).dtype)
    total = weights + kv + recurrent
    return dict(batch=batch, context=context, weight_bytes=weights, kv_bytes=kv, recurrent_bytes=recurrent, bytes=total,
                step_seconds_peak=total / HBM_PEAK_B_S, tokens_per_s_peak=batch * HBM_PEAK_B_S / total,
                step_seconds_copy=total / COPY_CEILING_B_S, tokens_per_s_copy=batch * COPY_CEILING_B_S / total)


def roofline_fraction(tokens_per_s: float, roofline: dict) -> dict:
    return dict(of_peak=tokens_per_s / roofline["tokens_per_s_peak"],
                of_copy=tokens_per_s / roofline["tokens_per_s_copy"])
