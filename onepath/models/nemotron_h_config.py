"""NemotronHConfig: the config.json of a Nemotron-H hybrid (Mamba-2, attention, MLP and MoE layers by pattern).

Field names are transformers' NemotronHConfig's; what each field does, or why it is refused or harmless, is
fields.py's table. The layer pattern comes as layers_block_type (a list), layer_types (its alias), or the published
files' hybrid_override_pattern ("M" Mamba-2, "*" attention, "-" MLP, "E" MoE); the legacy mamba_* names are read as
transformers reads them.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, fields

from onepath.models.config import GENERATION, ModelConfig, check_fields
from onepath.models.fields import FAMILY_DEFAULTS, IMPLEMENTED
from onepath.numerics.spec import DTYPES

MODEL_TYPE = "nemotron_h"
BLOCK_TYPES = ("linear_attention", "full_attention", "moe", "mlp")
PATTERN = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
LEGACY_BLOCK_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
# legacy name -> field: transformers reads these, and the legacy value wins
LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_conv_bias": "use_conv_bias",
          "mamba_chunk_size": "chunk_size", "mamba_dt_limit": "time_step_limit"}
FLOAT_TAG = "__float__"  # transformers writes a non-finite float as {"__float__": "Infinity"}


@dataclass(slots=True)
class NemotronHConfig(ModelConfig):
    # transformers' defaults; num_hidden_layers is the pattern's length whatever is given
    vocab_size: int = 131072
    hidden_size: int = 4096
    intermediate_size: int = 21504
    num_hidden_layers: int = 0
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    max_position_embeddings: int = 4096
    moe_intermediate_size: int = 7688
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    pad_token_id: int | None = 0
    model_type: str = MODEL_TYPE
    layers_block_type: list[str] = field(default_factory=lambda: ["linear_attention", "moe", "full_attention", "mlp"])
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False                  # the Mamba in/out projections
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8                       # groups of heads sharing B and C (and a gated-norm group)
    conv_kernel: int = 4
    use_conv_bias: bool = True
    chunk_size: int = 128
    time_step_limit: tuple = (0.0, math.inf)
    mamba_ssm_cache_dtype: str = "float32"  # the scan state between passes, rounded at every chunk boundary
    n_routed_experts: int = 8
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1

    def __post_init__(self):
        self.layers_block_type = [LEGACY_BLOCK_TYPES.get(t, t) for t in self.layers_block_type]
        unknown = [(i, t) for i, t in enumerate(self.layers_block_type) if t not in BLOCK_TYPES]
        if unknown:
            i, t = unknown[0]
            raise ValueError(f"layers_block_type names {t!r} at layer {i}: nemotron_h layers are {BLOCK_TYPES}")
        if not self.layers_block_type:
            raise ValueError("layers_block_type is empty: give one entry per layer")
        self.num_hidden_layers = len(self.layers_block_type)
        self.rms_norm_eps = self.layer_norm_epsilon
        self.num_experts = self.n_routed_experts
        self.time_step_limit = tuple(decode_float(v) for v in self.time_step_limit)
        ModelConfig.__post_init__(self)
        self._check_mamba()
        if self.is_moe:
            self._check_router()

    def _check_mamba(self):
        for name in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "chunk_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} = {getattr(self, name)} must be positive")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads {self.mamba_num_heads} is not a multiple of n_groups {self.n_groups}: "
                             "each group's B and C serve whole heads (and the gated norm's groups whole heads)")
        lo, hi = (self.time_step_limit + (None, None))[:2]
        if len(self.time_step_limit) != 2 or not 0.0 <= lo <= hi:
            raise ValueError(f"time_step_limit {list(self.time_step_limit)} must be [low, high] with 0 <= low <= high")
        if self.mamba_ssm_cache_dtype not in DTYPES:
            raise ValueError(f"mamba_ssm_cache_dtype {self.mamba_ssm_cache_dtype!r} is unknown: use one of "
                             f"{sorted(DTYPES)}")

    def _check_router(self):
        e, groups = self.n_routed_experts, self.n_group
        if groups <= 0 or e % groups:
            raise ValueError(f"n_routed_experts {e} is not a multiple of n_group {groups}: the router ranks "
                             "equal groups of experts")
        if e // groups < 2:
            raise ValueError(f"n_group {groups} leaves {e // groups} expert per group: a group's score is the sum of "
                             "its two best experts, so each group needs at least 2 (as in transformers)")
        if not 1 <= self.topk_group <= groups:
            raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group = {groups}]")
        if self.num_experts_per_tok > self.topk_group * (e // groups):
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds the {self.topk_group * (e // groups)} "
                             f"experts of the topk_group {self.topk_group} groups a token may use")
        if self.moe_latent_size is not None and self.moe_latent_size <= 0:
            raise ValueError(f"moe_latent_size {self.moe_latent_size} must be positive or null")

    @property
    def is_moe(self) -> bool:
        return "moe" in self.layers_block_type

    def is_sparse_layer(self, layer: int) -> bool:
        return self.layers_block_type[layer] == "moe"

    def has_kv_cache(self, layer: int) -> bool:
        return self.layers_block_type[layer] == "full_attention"

    def is_mamba_layer(self, layer: int) -> bool:
        return self.layers_block_type[layer] == "linear_attention"

    @property
    def padding_idx(self) -> int | None:
        return None  # transformers' NemotronH embedding has no padding_idx

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate_size + 2 * self.n_groups * self.ssm_state_size

    @classmethod
    def from_dict(cls, raw: dict) -> "NemotronHConfig":
        check_fields(MODEL_TYPE, raw)
        raw, consumed = dict(raw), set()
        for old, new in LEGACY.items():
            if old in raw:
                raw[new] = raw[old]
                consumed.add(old)
        if "layers_block_type" not in raw and "layer_types" in raw:
            raw["layers_block_type"] = raw["layer_types"]
        if "layers_block_type" not in raw and "hybrid_override_pattern" in raw:
            raw["layers_block_type"] = pattern_layers(raw["hybrid_override_pattern"])
        if "num_local_experts" in raw and "n_routed_experts" not in raw:
            raw["n_routed_experts"] = raw["num_local_experts"]
        consumed |= {"layer_types", "hybrid_override_pattern", "num_local_experts", "num_hidden_layers", "dtype"}
        known = {f.name for f in fields(cls)} & (set(IMPLEMENTED[MODEL_TYPE]) | GENERATION) - {"layer_types"}
        kwargs = {**FAMILY_DEFAULTS[MODEL_TYPE], **{k: v for k, v in raw.items() if k in known}}
        if "dtype" in raw and "torch_dtype" not in raw:
            kwargs["torch_dtype"] = raw["dtype"]
        extra = {k: v for k, v in raw.items() if k not in known and k not in consumed}
        config = cls(**kwargs, extra=extra)
        layers = raw.get("num_hidden_layers")
        if layers is not None and layers != config.num_hidden_layers:
            warnings.warn(f"num_hidden_layers {layers} differs from the pattern's {config.num_hidden_layers} layers: "
                          "the pattern wins, as in transformers", stacklevel=2)
        return config

    def to_dict(self) -> dict:
        out = ModelConfig.to_dict(self)
        out.pop("layer_types", None)  # the base class's window field; the pattern is layers_block_type
        out["time_step_limit"] = [encode_float(v) for v in self.time_step_limit]
        return out


def pattern_layers(pattern: str) -> list[str]:
    bad = [(i, ch) for i, ch in enumerate(pattern) if ch not in PATTERN]
    if bad:
        i, ch = bad[0]
        raise ValueError(f"hybrid_override_pattern {pattern!r} has {ch!r} at layer {i}: use M (Mamba-2), * (attention), "
                         "- (MLP) or E (MoE)")
    return [PATTERN[ch] for ch in pattern]


def decode_float(v) -> float:
    if isinstance(v, dict) and FLOAT_TAG in v:
        return float(v[FLOAT_TAG])
    return float(v)


def encode_float(v: float):
    return v if math.isfinite(v) else {FLOAT_TAG: "Infinity" if v > 0 else "-Infinity"}
