"""ModelConfig: the architecture fields of a Hugging Face config.json that the decoders read (dense, MoE);
NemotronHConfig, its subclass for the Nemotron-H hybrid (Mamba-2, attention, MLP and MoE layers by pattern).

Which config.json fields a family reads, refuses or may ignore is fields.py's table; a field that
changes the math is never dropped without a word.
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from onepath.models.fields import (DENSE_MODEL_TYPES, FAMILY_DEFAULTS, HYBRID_MODEL_TYPES, IMPLEMENTED,
                                   MOE_MODEL_TYPES, refusals, unclassified)
from onepath.numerics.spec import DTYPES

SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    model_type: str = "llama"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    hidden_act: str = "silu"
    # sliding-window attention (Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE; Mistral reads sliding_window alone):
    # which layers it windows is `attention_window`'s rule, as transformers derives layer_types
    use_sliding_window: bool = False
    max_window_layers: int = 28
    layer_types: list[str] | None = None
    # mixture of experts (Qwen3-MoE, Qwen2-MoE), as transformers' Qwen3MoeConfig / Qwen2MoeConfig
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE: a sigmoid-gated shared expert when > 0
    qkv_bias: bool = True                      # Qwen2-MoE's switch for the q/k/v biases
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES + MOE_MODEL_TYPES + HYBRID_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported: use one of "
                             f"{SUPPORTED_MODEL_TYPES + MOE_MODEL_TYPES + HYBRID_MODEL_TYPES}")
        if self.model_type in HYBRID_MODEL_TYPES and type(self) is ModelConfig:
            raise ValueError(f"model_type {self.model_type!r} has its own config class: read its config.json with "
                             "ModelConfig.from_dict, or build a NemotronHConfig")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported: the decoders use SwiGLU ('silu')")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}: GQA needs whole groups")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} = {getattr(self, name)} must be positive")
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        if self.is_moe:
            self._check_moe()
        self._check_rope()
        self._check_window()
        if self.pad_token_id is not None and not -self.vocab_size <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is outside the vocabulary [0, {self.vocab_size}): "
                             "transformers' embedding refuses it too; set it to a token id or null in config.json")

    def _check_rope(self):
        params = self.rope_scaling or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported: use one of {SUPPORTED_ROPE_TYPES}")
        partial = params.get("partial_rotary_factor", self.extra.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported: "
                             f"{self.model_type} rotates the whole head, remove it from config.json")

    def _check_window(self):
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer_types holds {unknown}: onepath's {self.model_type} implements {LAYER_TYPES}")
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for num_hidden_layers "
                                 f"{self.num_hidden_layers}: give one per layer")
        windowed = [i for i in range(self.num_hidden_layers) if self.is_sliding_layer(i)]
        if windowed and (self.window_size is None or self.window_size <= 0):
            raise ValueError(
                f"layers {windowed} are sliding_attention but the window is {self.window_size!r} "
                f"(use_sliding_window {self.use_sliding_window}, sliding_window {self.sliding_window!r}): set "
                "use_sliding_window true and sliding_window > 0, or mark them full_attention in layer_types")

    @property
    def padding_idx(self) -> int | None:
        """The embedding row whose lookups add nothing to its gradient (transformers' nn.Embedding padding_idx)."""
        return None if self.pad_token_id is None else self.pad_token_id % self.vocab_size

    @property
    def window_size(self) -> int | None:
        """The window every sliding layer uses, as transformers reads it: Mistral's sliding_window as is,
        the Qwen families' only under use_sliding_window."""
        if self.model_type == "llama" or (self.model_type != "mistral" and not self.use_sliding_window):
            return None
        return self.sliding_window

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` attends through the window: layer_types where the family defines it,
        else transformers' default rule for the family."""
        if self.layer_types is not None and self.model_type in ("qwen2", "qwen3", "qwen2_moe"):
            return self.layer_types[layer] == "sliding_attention"
        if self.window_size is None:
            return False
        if self.model_type in ("qwen2", "qwen3"):
            return layer >= self.max_window_layers
        if self.model_type == "qwen2_moe":
            return layer % 2 == 0 and layer < self.max_window_layers
        return True  # mistral, qwen3_moe: every layer

    def attention_window(self, layer: int) -> int | None:
        """Keys a query of layer `layer` sees, itself included (positions p - window + 1 .. p); None: all of 0..p."""
        return self.window_size if self.is_sliding_layer(layer) else None

    def _check_moe(self):
        for name in ("num_experts", "moe_intermediate_size", "decoder_sparse_step"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} = {getattr(self, name)} must be positive for model_type {self.model_type!r} "
                                 "(a dense model is model_type qwen3 or qwen2)")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok = {self.num_experts_per_tok} must be in [1, num_experts = "
                             f"{self.num_experts}]: each token picks that many distinct experts")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            raise ValueError(f"mlp_only_layers {outside} lie outside layers 0..{self.num_hidden_layers - 1}")

    @property
    def is_moe(self) -> bool:
        return self.model_type in MOE_MODEL_TYPES

    def has_kv_cache(self, layer: int) -> bool:
        """Whether decoder layer `layer` keeps K/V in the paged cache (every layer here; a hybrid's attention only)."""
        return True

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a mixture-of-experts MLP (transformers' rule)."""
        return (self.is_moe and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def qk_norm(self) -> bool:
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def has_attention_bias(self) -> bool:
        # Qwen2 always carries q/k/v biases, Qwen2-MoE per `qkv_bias`; the others follow `attention_bias`.
        return self.model_type == "qwen2" or (self.model_type == "qwen2_moe" and self.qkv_bias) or self.attention_bias

    @property
    def o_proj_bias(self) -> bool:
        # Qwen2's and Qwen2-MoE's o_proj never has a bias; Llama's and Qwen3's follow attention_bias.
        return self.has_attention_bias and self.model_type not in ("qwen2", "qwen2_moe")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        """From a config.json: the fields its family reads (fields.IMPLEMENTED) become ModelConfig's, the
        rest go to `extra`; a field set to a value onepath does not implement is refused."""
        model_type = raw.get("model_type", "llama")
        if cls is ModelConfig and model_type in HYBRID_MODEL_TYPES:
            return NemotronHConfig.from_dict(raw)
        if model_type == "deepseek_v4":  # a family with its own config dataclass
            from onepath.models.deepseek_v4_config import DeepseekV4Config
            return DeepseekV4Config.from_dict(raw)
        if model_type not in IMPLEMENTED:
            raise ValueError(f"model_type {model_type!r} is not supported: use one of {tuple(IMPLEMENTED)}")
        check_fields(model_type, raw)
        known = ({f.name for f in fields(cls)} - {"extra"}) & (set(IMPLEMENTED[model_type]) | GENERATION)
        kwargs = {**FAMILY_DEFAULTS[model_type], **{k: v for k, v in raw.items() if k in known}}
        if "num_local_experts" in raw and "num_experts" not in raw:
            # transformers 5 writes Qwen3-MoE's num_experts under this name (its attribute_map)
            kwargs["num_experts"] = raw["num_local_experts"]
        if "dtype" in raw and "torch_dtype" not in raw:
            kwargs["torch_dtype"] = raw["dtype"]
        if kwargs.get("rope_scaling") is None and isinstance(raw.get("rope_parameters"), dict):
            # transformers 5.x: rope_parameters' own rope_theta wins over a top-level one, as there.
            params = dict(raw["rope_parameters"])
            if "rope_theta" in params:
                kwargs["rope_theta"] = params.pop("rope_theta")
            if params.get("rope_type", params.get("type", "default")) != "default":
                kwargs["rope_scaling"] = params
        missing = [n for n in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if n not in kwargs]
        if missing:
            raise ValueError(f"config.json lacks {missing}: a dense decoder config needs them")
        # rope_parameters and dtype now live in fields; kept in extra they would go stale on to_dict.
        extra = {k: v for k, v in raw.items()
                 if k not in known and k not in ("rope_parameters", "dtype", "num_local_experts")}
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict:
        """config.json: the family's own fields (a family's file carries no other's) and `extra`."""
        keep = set(IMPLEMENTED[self.model_type]) | GENERATION
        out = {k: v for k, v in asdict(self).items() if k in keep}
        out.update(self.extra)
        out.setdefault("architectures", [ARCHITECTURES[self.model_type]])
        return out

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} does not exist: a checkpoint directory needs a config.json") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}): fix or re-export the config.json") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} holds a {type(raw).__name__}, not a JSON object: fix the config.json")
        try:
            return cls.from_dict(raw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None


def check_fields(model_type: str, raw: dict) -> None:
    """Refuse a config.json field set to a value onepath does not implement; warn about one `model_type` does not
    read (fields.py's tables)."""
    refused = refusals(raw)
    if refused:
        raise ValueError("config.json: " + "; ".join(refused))
    ignored = unclassified(model_type, raw)
    if ignored:
        warnings.warn(f"config.json fields {ignored} are not {model_type} fields transformers reads: ignored, "
                      "as transformers ignores them", stacklevel=3)


# ModelConfig fields every family's config.json carries that do not change the forward
GENERATION = {"bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "nemotron_h": "NemotronHForCausalLM"}

# --- Nemotron-H ---------------------------------------------------------------------------------------------------
# Field names are transformers' NemotronHConfig's; what each field does, or why it is refused or harmless, is
# fields.py's table. The layer pattern comes as layers_block_type (a list), layer_types (its alias), or the published
# files' hybrid_override_pattern ("M" Mamba-2, "*" attention, "-" MLP, "E" MoE); the legacy mamba_* names are read
# as transformers reads them.

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
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds the "
                             f"{self.topk_group * (e // groups)} experts of the topk_group {self.topk_group} groups "
                             "a token may use")
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
        raise ValueError(f"hybrid_override_pattern {pattern!r} has {ch!r} at layer {i}: use M (Mamba-2), "
                         "* (attention), - (MLP) or E (MoE)")
    return [PATTERN[ch] for ch in pattern]


def decode_float(v) -> float:
    if isinstance(v, dict) and FLOAT_TAG in v:
        return float(v[FLOAT_TAG])
    return float(v)


def encode_float(v: float):
    return v if math.isfinite(v) else {FLOAT_TAG: "Infinity" if v > 0 else "-Infinity"}
