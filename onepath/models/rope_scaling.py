"""RoPE inverse frequencies for every rope_scaling type, and the cos/sin table built from them.

Each formula copies transformers' `ROPE_INIT_FUNCTIONS` (5.x) expression by expression, Python
scalars and float32 tensors in the same places, so the frequencies are bit-equal to theirs.
transformers computes them once, on the CPU, and copies them to the model's device; so do we.
"""
from __future__ import annotations

import math

import torch

from onepath.models.config import ModelConfig


def rope_parameters(config: ModelConfig) -> dict:
    """config.rope_scaling standardised as transformers does: rope_type, rope_theta and, where used,
    original_max_position_embeddings are always present."""
    params = dict(config.rope_scaling or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", config.rope_theta)
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        # Phi3-style configs keep the pretraining length at top level; transformers lets it win.
        if "original_max_position_embeddings" in config.extra:
            params["original_max_position_embeddings"] = config.extra["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params


def inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """float32 inverse frequencies [head_dim // 2] and the cos/sin scaling, as at transformers' init.

    "dynamic" and "longrope" are the init values: transformers changes them in forward once a batch
    reaches past (original_)max_position_embeddings; `cos_sin_table` refuses such lengths.
    """
    return frequencies(rope_parameters(config), config.head_dim, config.max_position_embeddings)


def frequencies(params: dict, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """inv_freq's formulas for standardised rope parameters `params` (rope_parameters') over `dim` rotated
    channels: the float32 inverse frequencies [dim // 2] and the cos/sin scaling."""
    rope_type = params["rope_type"]
    base = params["rope_theta"]
    if rope_type == "yarn":
        return _yarn(params, base, dim, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope(params, base, dim, max_position_embeddings)
    if rope_type == "dynamic":
        # At init seq_len is max_position_embeddings, so the base scale below is 1 up to rounding.
        seq_len, factor = max_position_embeddings, params["factor"]
        base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "linear":
        inv = inv / params["factor"]
    if rope_type == "llama3":
        inv = _llama3(inv, params)
    return inv, 1.0


def cos_sin_table(config: ModelConfig, max_positions: int,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [max_positions, head_dim // 2]; row p rotates position p.

    Order as LlamaRotaryEmbedding.forward (transformers 5.x): freqs = position.float() * inv_freq
    (one float32 product), then cos()/sin() of freqs, then * attention scaling (a Python float).
    transformers takes cos of cat(freqs, freqs); both halves are elementwise the same values.
    """
    params = rope_parameters(config)
    limit = {"dynamic": config.max_position_embeddings,
             "longrope": params.get("original_max_position_embeddings")}.get(params["rope_type"])
    if limit is not None and max_positions > limit:
        raise ValueError(
            f"max_positions {max_positions} > {limit} for rope_type {params['rope_type']!r}: transformers "
            f"rescales every position of a batch that long, which one table cannot match; "
            f"lower max_model_len to {limit}")
    return table(*inv_freq(config), max_positions, device)


def table(inv: torch.Tensor, scaling: float, max_positions: int,
          device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_sin_table's rows 0..max_positions-1 from inverse frequencies `inv` and the cos/sin scaling."""
    positions = torch.arange(max_positions, dtype=torch.int64, device=device).float()
    freqs = positions[:, None] * inv.to(device)
    return freqs.cos() * scaling, freqs.sin() * scaling


def _yarn(params: dict, base: float, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv, float(attention_factor)


def _longrope(params: dict, base: float, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short_factor = params["short_factor"]
    if len(short_factor) != dim // 2:
        raise ValueError(f"longrope short_factor has {len(short_factor)} entries, head_dim // 2 = {dim // 2}: "
                         f"fix rope_scaling in config.json")
    ext_factors = torch.tensor(short_factor, dtype=torch.float32)
    inv = 1.0 / (ext_factors * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv, float(attention_factor)


def _llama3(inv: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
