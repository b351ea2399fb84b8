"""ModelConfig: the architecture fields of a Hugging Face config.json that the decoders read (dense, MoE)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
# config.json keys of the mixture-of-experts families only: a dense config.json is written without them
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers")
QWEN2_MOE_FIELDS = ("shared_expert_intermediate_size", "qkv_bias")


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
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in raw.items() if k in known}
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
        family = {"qwen3_moe": MOE_FIELDS, "qwen2_moe": MOE_FIELDS + QWEN2_MOE_FIELDS}.get(self.model_type, ())
        skip = {"extra", *MOE_FIELDS, *QWEN2_MOE_FIELDS} - set(family)
        out = {k: v for k, v in asdict(self).items() if k not in skip}
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


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM"}
