"""ModelConfig: the architecture fields of a Hugging Face config.json that the dense decoder reads."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


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
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported: use one of {SUPPORTED_MODEL_TYPES}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported: the dense decoder uses SwiGLU ('silu')")
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

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def has_attention_bias(self) -> bool:
        # Qwen2 always carries q/k/v biases; the others follow `attention_bias`.
        return self.model_type == "qwen2" or self.attention_bias

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
        extra = {k: v for k, v in raw.items() if k not in known and k not in ("rope_parameters", "dtype")}
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
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
                 "mistral": "MistralForCausalLM"}
