"""DeepseekV4Config: the config.json of a DeepSeek-V4 checkpoint (model_type deepseek_v4), as transformers reads it.

Its own dataclass rather than more ModelConfig fields: DeepSeek-V4 shares none of the dense families' attention
fields (no intermediate_size, one shared KV head, a LoRA query, compressors, mHC) and has a schedule of its own
per layer. It answers the questions the engine and the trainer ask of any config (vocab_size, eos_token_ids,
max_position_embeddings, padding_idx, to_dict) the way ModelConfig does. Which fields are implemented, refused
or change no math is fields.py's table; legacy names of published files fold in as transformers folds them.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from onepath.models.fields import IMPLEMENTED, refusals, unclassified

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
ROPE_TYPES = ("default", "yarn")
COMPRESS_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # the legacy compress_ratios values
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
DEFAULT_HASH_LAYERS = 3
ALIASES = {"intermediate_size": "moe_intermediate_size", "num_local_experts": "n_routed_experts"}
GENERATION = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype")


@dataclass(slots=True)
class DeepseekV4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    partial_rotary_factor: float = 64 / 512
    rope_parameters: dict | None = None   # {"main": {...}, "compress": {...}} once standardised
    layer_types: list[str] | None = None
    compress_rates: dict | None = None
    mlp_layer_types: list[str] | None = None
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    model_type: str = "deepseek_v4"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        n = self.num_hidden_layers
        for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "head_dim", "q_lora_rank", "n_routed_experts", "hc_mult", "hc_sinkhorn_iters", "sliding_window",
                     "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} = {getattr(self, name)} must be positive")
        if self.layer_types is None:
            interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            self.layer_types = [HCA] * min(n, 2) + interleave
        if self.mlp_layer_types is None:
            hashed = min(n, DEFAULT_HASH_LAYERS)
            self.mlp_layer_types = ["hash_moe"] * hashed + ["moe"] * (n - hashed)
        self.compress_rates = dict(DEFAULT_COMPRESS_RATES if self.compress_rates is None else self.compress_rates)
        for name, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            values = list(getattr(self, name))
            if len(values) < n:
                raise ValueError(f"{name} has {len(values)} entries for num_hidden_layers {n}: give one per layer")
            bad = [(i, v) for i, v in enumerate(values) if v not in allowed]
            if bad:
                i, v = bad[0]
                raise ValueError(f"{name}[{i}] = {v!r} is not a DeepSeek-V4 layer type: use one of {allowed}")
            setattr(self, name, values[:n])  # as transformers: a published list may carry the MTP layer's entry
        self._check_compression()
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported: use one of {SCORING_FUNCS}")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok = {self.num_experts_per_tok} must be in [1, n_routed_experts = "
                             f"{self.n_routed_experts}]")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"o_groups {self.o_groups} does not divide num_attention_heads * head_dim = "
                             f"{self.num_attention_heads * self.head_dim}: the grouped output projection needs whole "
                             "groups")
        self._check_rope()
        if self.pad_token_id is not None and not -self.vocab_size <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is outside the vocabulary [0, {self.vocab_size}): "
                             "set it to a token id or null in config.json")

    def _check_compression(self):
        for key, rate in self.compress_rates.items():
            if key not in (CSA, HCA):
                raise ValueError(f"compress_rates has {key!r}: its keys are {CSA!r} and {HCA!r}")
            if not isinstance(rate, int) or isinstance(rate, bool) or rate < 1:
                raise ValueError(f"compress_rates[{key!r}] = {rate!r} is not a compress rate: use a positive int "
                                 "(DeepSeek-V4: 4 and 128)")
        for kind in (CSA, HCA):
            if kind in self.layer_types and kind not in self.compress_rates:
                raise ValueError(f"layer_types uses {kind!r} but compress_rates gives it no rate")
        if CSA in self.layer_types:
            entries = self.max_position_embeddings // self.compress_rates[CSA]
            if self.index_topk > entries:
                raise ValueError(
                    f"index_topk {self.index_topk} > {entries}, the compressed entries a context of "
                    f"max_position_embeddings {self.max_position_embeddings} can have at compress_rates"
                    f"[{CSA!r}] = {self.compress_rates[CSA]}: lower index_topk")

    def _check_rope(self):
        if self.rope_parameters is None:
            self.rope_parameters = standard_rope({}, self.rope_theta, self.compress_rope_theta,
                                                 self.partial_rotary_factor)
        factors = {label: self.rope_parameters.get(label, {}).get("partial_rotary_factor", self.partial_rotary_factor)
                   for label in ("main", "compress")}
        if factors["main"] != factors["compress"]:
            raise ValueError(f"rope_parameters partial_rotary_factor {factors}: DeepSeek-V4 rotates one slice of "
                             "each head in both RoPEs; give them one value")
        rotated = self.rope_dim
        if rotated < 2 or rotated % 2 or rotated > self.head_dim:
            raise ValueError(f"partial_rotary_factor {factors['main']} rotates {rotated} of head_dim "
                             f"{self.head_dim} channels: it must give an even number in [2, head_dim]")
        if rotated > self.index_head_dim:
            raise ValueError(f"index_head_dim {self.index_head_dim} < the {rotated} rotated channels "
                             f"(head_dim * partial_rotary_factor): the indexer rotates as many")
        for label in ("main", "compress"):
            params = self.rope_parameters.get(label)
            if not isinstance(params, dict):
                raise ValueError(f"rope_parameters lacks {label!r}: give both 'main' and 'compress' or neither")
            kind = params.get("rope_type", params.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise ValueError(f"rope_parameters[{label!r}] rope_type {kind!r} is not supported: use one of "
                                 f"{ROPE_TYPES}")
            if params.get("truncate", True) is not True:
                raise ValueError(f"rope_parameters[{label!r}] truncate {params['truncate']!r}: transformers' "
                                 "DeepSeek-V4 always truncates the YaRN ramp; remove the key")

    @property
    def rope_dim(self) -> int:
        """Channels of each head RoPE rotates: the trailing head_dim * partial_rotary_factor, the rope parameters'
        own factor where they carry one (transformers' rotary embedding reads that one)."""
        factor = self.rope_parameters["main"].get("partial_rotary_factor", self.partial_rotary_factor)
        return int(self.head_dim * factor)

    def rope(self, label: str) -> dict:
        """rope_parameters[label] standardised (rope_type, rope_theta, original_max_position_embeddings for YaRN)."""
        params = dict(self.rope_parameters[label])
        params["rope_type"] = params.get("rope_type", params.get("type", "default"))
        params.setdefault("rope_theta", self.rope_theta if label == "main" else self.compress_rope_theta)
        if params["rope_type"] == "yarn":
            params.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        return params

    def compress_rate(self, layer: int) -> int:
        """Source tokens per compressed entry of layer `layer`; 0 for a sliding-window-only layer."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else self.compress_rates[kind]

    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def num_key_value_heads(self) -> int:
        return 1

    @property
    def is_moe(self) -> bool:
        return True

    @property
    def padding_idx(self) -> int | None:
        return None if self.pad_token_id is None else self.pad_token_id % self.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    @classmethod
    def from_dict(cls, raw: dict) -> "DeepseekV4Config":
        refused = refusals(raw)
        if refused:
            raise ValueError("config.json: " + "; ".join(refused))
        ignored = unclassified("deepseek_v4", raw)
        if ignored:
            warnings.warn(f"config.json fields {ignored} are not deepseek_v4 fields transformers reads: ignored, as "
                          "transformers ignores them", stacklevel=2)
        known = {f.name for f in fields(cls)} - {"extra", "rope_parameters"}
        kwargs = {k: v for k, v in raw.items() if k in known}
        for alias, name in ALIASES.items():
            if alias in raw and name not in raw:
                kwargs[name] = raw[alias]
        if "dtype" in raw and "torch_dtype" not in raw:
            kwargs["torch_dtype"] = raw["dtype"]
        kwargs.update(_legacy(raw, kwargs))
        rope = raw.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"rope_parameters {rope!r} must be a JSON object")
        if not rope and isinstance(raw.get("rope_scaling"), dict):
            rope = raw["rope_scaling"]
        rope_fields = ("rope_theta", "compress_rope_theta", "partial_rotary_factor")
        kwargs["rope_parameters"] = standard_rope(rope, *(kwargs.get(name, default(name)) for name in rope_fields))
        extra = {k: v for k, v in raw.items() if k not in known and k not in IMPLEMENTED["deepseek_v4"]
                 and k != "dtype"}
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict:
        """config.json as transformers' DeepseekV4Config writes it: the modern names, rope_parameters nested."""
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out.update(num_key_value_heads=1, n_shared_experts=1, norm_topk_prob=True,
                   qk_rope_head_dim=int(self.head_dim * self.partial_rotary_factor))
        out.update(self.extra)
        out.setdefault("architectures", ["DeepseekV4ForCausalLM"])
        return out

    @classmethod
    def from_json(cls, path: str | Path) -> "DeepseekV4Config":
        return cls.from_dict(json.loads(Path(path).read_text()))


def default(name: str):
    return DeepseekV4Config.__dataclass_fields__[name].default


def standard_rope(rope: dict, rope_theta: float, compress_rope_theta: float, partial_rotary_factor: float) -> dict:
    """{"main", "compress"} as transformers' DeepseekV4Config builds them: nested parameters kept as they are;
    otherwise main is the default RoPE at rope_theta and compress takes the top-level parameters (YaRN with
    attention_factor 1) at compress_rope_theta, both over partial_rotary_factor's slice."""
    if isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict):
        return {"main": dict(rope["main"]), "compress": dict(rope["compress"])}
    scaling = {k: v for k, v in rope.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": partial_rotary_factor}
    compress = {**scaling, "rope_theta": compress_rope_theta, "partial_rotary_factor": partial_rotary_factor}
    compress["rope_type"] = compress.get("rope_type", compress.get("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"main": main, "compress": compress}


def _legacy(raw: dict, kwargs: dict) -> dict:
    """The fields published checkpoints still name the old way, folded into the modern ones."""
    out = {}
    rates = dict(kwargs.get("compress_rates") or DEFAULT_COMPRESS_RATES)
    for name, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if name in raw:
            rates[kind] = raw[name]
            out["compress_rates"] = rates
    if "layer_types" not in raw and "compress_ratios" in raw:
        ratios = raw["compress_ratios"]
        bad = [(i, r) for i, r in enumerate(ratios) if r not in COMPRESS_RATIO_TYPES]
        if bad:
            raise ValueError(f"compress_ratios[{bad[0][0]}] = {bad[0][1]!r} is not a DeepSeek-V4 compress ratio: use "
                             f"{tuple(COMPRESS_RATIO_TYPES)} (sliding, CSA, HCA) and set the rates in compress_rates")
        out["layer_types"] = [COMPRESS_RATIO_TYPES[r] for r in ratios]
    if "mlp_layer_types" not in raw and "num_hash_layers" in raw:
        n, hashed = kwargs.get("num_hidden_layers", default("num_hidden_layers")), raw["num_hash_layers"]
        out["mlp_layer_types"] = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    if "partial_rotary_factor" not in raw and "qk_rope_head_dim" in raw:
        out["partial_rotary_factor"] = raw["qk_rope_head_dim"] / kwargs.get("head_dim", default("head_dim"))
    return out
