"""ModelConfig: the architecture fields of a Hugging Face config.json that the decoders read (dense, MoE).

Which config.json fields a family reads, refuses or may ignore is fields.py's table; a field that
changes the math is never dropped without a word.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from onepath.models.fields import (DENSE_MODEL_TYPES, FAMILY_DEFAULTS, IMPLEMENTED, MOE_MODEL_TYPES, refusals,
                                   unclassified)

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
        if self.model_type not in SUPPORTED_MODEL_TYPES + MOE_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported: use one of "
                             f"{SUPPORTED_MODEL_TYPES + MOE_MODEL_TYPES}")
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
        if model_type == "deepseek_v4":  # a family with its own config dataclass
            from onepath.models.deepseek_v4_config import DeepseekV4Config
            return DeepseekV4Config.from_dict(raw)
        if model_type not in IMPLEMENTED:
            raise ValueError(f"model_type {model_type!r} is not supported: use one of {tuple(IMPLEMENTED)}")
        refused = refusals(raw)
        if refused:
            raise ValueError("config.json: " + "; ".join(refused))
        ignored = unclassified(model_type, raw)
        if ignored:
            warnings.warn(f"config.json fields {ignored} are not {model_type} fields transformers reads: ignored, "
                          "as transformers ignores them", stacklevel=2)
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


# ModelConfig fields every family's config.json carries that do not change the forward
GENERATION = {"bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM"}
