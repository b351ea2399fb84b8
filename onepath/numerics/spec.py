"""ExecutionSpec: the numeric contract both sides run under, as data (JSON, stable hash)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace

import torch

MODES = ("consistent", "baseline")
DEVICES = ("cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPS = ("embedding", "linear", "rmsnorm", "rope", "silu_mul", "attention", "lm_head", "logprobs", "topk", "sampling")
# Operators with no entry of their own: FP32 whatever the spec's dtype, the mode alone picks the recipe
# (ops/softmax.py, ops/sigmoid.py: the MoE router's probabilities, the shared-expert gate; ops/relu2.py and
# ops/conv1d.py: Nemotron-H's activation and Mamba-2's causal conv, rounded once to their input's dtype;
# DeepSeek-V4's router score, compressor pooling, indexer score and mHC: ops/sqrtsoftplus.py, compressor.py,
# indexer.py, mhc.py)
FP32_OPS = ("softmax", "sigmoid", "relu2", "causal_conv1d", "sqrtsoftplus", "compressor", "indexer", "mhc")
# Linear layers of one module class, named apart so a spec can give them their own formats (the Mamba mixers'
# in/out projections, the routed experts): until a spec sets one, it computes as the op it names here.
MODULE_OPS = {"mamba_proj": "linear", "expert": "linear"}
# Operators of one model family (the Mamba-2 scan, DeepSeek-V4's lightning indexer): absent from a spec's JSON, and
# so from its hash, until set, so the specs of other families keep theirs; FAMILY_DEFAULTS gives their entry until
# then. The indexer's entry holds its FP8 scoring only (the fp8_indexer preset): it stays FP32_OPS' otherwise.
FAMILY_OPS = ("ssd", "indexer")
SSD_CHUNK = 128  # tokens per chunk of the Mamba-2 scan (ops/ssd.py), Nemotron-H's chunk_size
# The tensors an operator may store quantised: a GEMM's weight and input activation, attention's K/V cache.
# The indexer's: its query heads (act) and its cached keys (kv), scored FP8 x FP8 (ops/indexer.py).
QUANT_ROLES = {"linear": ("weight", "act"), "lm_head": ("weight", "act"), "attention": ("kv",),
               "mamba_proj": ("weight", "act"), "expert": ("weight", "act"), "indexer": ("act", "kv")}
# How a MoE expert's router coefficient enters (no model reads it yet): on the expert's FP32
# down-proj output before the experts are summed, or folded into the down-proj input before it is
# quantised (then it moves the activation scales).
ROUTER_PLACEMENTS = ("down_proj_output", "down_proj_input")

# What each low-precision format allows, field by field (the first value is the usual one).
QUANT_CHOICES = {
    "fp8_e4m3": dict(scale_domain=("per_block", "per_token", "per_tensor"), scale_dtype=("fp32", "ue8m0"),
                     scale_rule=("amax/448",), scale_apply=("multiply_by_reciprocal", "divide"),
                     outer_scale=("none",), scales_applied=("accumulator", "load")),
    "nvfp4": dict(scale_domain=("per_block",), block=((1, 16),), scale_dtype=("e4m3",),
                  scale_rule=("amax*s_enc/6",), scale_apply=("multiply_by_reciprocal",),
                  outer_scale=("per_tensor", "per_token"), scales_applied=("operand",), amax_floor=(0.0,),
                  amax_ceil=(None,)),
}


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """How one tensor (a weight, an activation, the K/V cache) is stored in low precision. The rules
    themselves, op by op, are onepath/numerics/quant.py's docstring; the presets below name the usual ones.

    format:         "fp8_e4m3" (max 448) or "nvfp4" (E2M1 codes, max 6, E4M3 block scales, FP32 outer scale)
    scale_domain:   "per_block" (one scale per `block`), "per_token" (one per row, all leading dims
                    flattened: for the KV cache [tokens, heads, head_dim], per token and head), "per_tensor"
    block:          (rows, cols) sharing one scale, cols along the last (K) dim; ragged edges form smaller blocks
    scale_dtype:    "fp32", "ue8m0" (a power of two, rounded up) or "e4m3" (NVFP4's block scales)
    scale_rule:     "amax/448" (FP8) or "amax*s_enc/6" (NVFP4, s_enc = 2688/outer amax)
    amax_floor:     a block's amax is raised to this before the scale is formed (FP8: zero blocks)
    amax_ceil:      None, or a block's amax is lowered to this before the scale is formed, so the scale never
                    exceeds amax_ceil / 448 and larger values saturate (FP8_KV: 448 * 2^7, see KV_AMAX_CEIL)
    scale_apply:    the element is multiplied by the scale's FP32 reciprocal, or divided by the scale
    rounding:       "rne", round to nearest, ties to even
    saturation:     "clamp": clamp to +-max before the cast (torch's cast may make NaN above 464, Triton saturates)
    outer_scale:    NVFP4's FP32 second-level scale: "per_tensor" (weights) or "per_token" (W4A4 activations)
    scales_applied: where the scales come back: "accumulator" (FP8 GEMM: a fresh FP32 partial per K
                    block times scale_a * scale_b), "operand" (NVFP4: code * block scale, exact in BF16,
                    feeds a BF16 GEMM; the outer scales in the FP32 epilogue), "load" (KV cache:
                    dequantised to the op's dtype when read, before attention)
    """
    format: str = "fp8_e4m3"
    scale_domain: str = "per_block"
    block: tuple | None = (1, 128)
    scale_dtype: str = "fp32"
    scale_rule: str = "amax/448"
    amax_floor: float = 1e-4
    amax_ceil: float | None = None
    scale_apply: str = "multiply_by_reciprocal"
    rounding: str = "rne"
    saturation: str = "clamp"
    outer_scale: str = "none"
    scales_applied: str = "accumulator"

    def __post_init__(self):
        if self.block is not None:
            object.__setattr__(self, "block", tuple(self.block))  # JSON gives a list
        if self.format not in QUANT_CHOICES:
            raise ValueError(f"quant format {self.format!r} is unknown: use one of {tuple(QUANT_CHOICES)} "
                             "(leave the tensor's QuantSpec None to keep it unquantised)")
        choices = dict(rounding=("rne",), saturation=("clamp",), **QUANT_CHOICES[self.format])
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r} does not go with format {self.format!r}: "
                                 f"use one of {allowed}")
        per_block = self.scale_domain == "per_block"
        if per_block != (self.block is not None):
            raise ValueError(f"block {self.block} with scale_domain {self.scale_domain!r}: a per_block scale needs "
                             "a block such as (1, 128); per_token and per_tensor take block None")
        if per_block and (len(self.block) != 2 or not all(isinstance(b, int) and b >= 1 for b in self.block)):
            raise ValueError(f"block {self.block} must be (rows, cols) of positive ints, e.g. (1, 128) or (128, 128)")
        if not self.amax_floor >= 0.0:
            raise ValueError(f"amax_floor {self.amax_floor} must be >= 0 (DeepGEMM's 1e-4 for FP8)")
        if self.amax_ceil is not None and not self.amax_ceil > self.amax_floor:
            raise ValueError(f"amax_ceil {self.amax_ceil} must be above amax_floor {self.amax_floor} (or None: no "
                             "ceiling)")


FP8_ACT = QuantSpec()                                            # 1x128 groups along K, per token
FP8_WEIGHT = QuantSpec(block=(128, 128))                         # 128x128 blocks of [N, K]
# The KV cache's amax ceiling: with power-of-two (ue8m0) scales it keeps every scale at most 2^7, so the
# attention kernel dequantises a code by placing its bits in a BF16 (the value times 2^-120) and one BF16
# multiply by 2^120 * scale, finite up to 2^7: the product code * scale exactly, as the FP32 rule gives it
# (onepath/ops/cuda/attention.py, _e4m3_pow2_to_bf16). K/V elements beyond 448 * 2^7 = 57344 saturate.
KV_AMAX_CEIL = 448.0 * 2 ** 7
# per token and head, ue8m0 scales
FP8_KV = QuantSpec(scale_domain="per_token", block=None, scale_dtype="ue8m0", amax_ceil=KV_AMAX_CEIL,
                   scales_applied="load")
# The lightning indexer's FP8 scoring (DeepSeek-V3.2 / V4 inference, DeepGEMM's fp8 MQA logits): its query heads
# per (token, head) and its cached keys per row, e4m3 with one power-of-two scale per row, so a row's scale leaves
# the dot: the query's folds into its head weight, the key's multiplies the head-weighted sum (ops/indexer.py).
FP8_INDEX = QuantSpec(scale_domain="per_token", block=None, scale_dtype="ue8m0")
NVFP4_WEIGHT = QuantSpec(format="nvfp4", block=(1, 16), scale_dtype="e4m3", scale_rule="amax*s_enc/6",
                         amax_floor=0.0, outer_scale="per_tensor", scales_applied="operand")
NVFP4_ACT = replace(NVFP4_WEIGHT, outer_scale="per_token")
# Named quantisation settings for ExecutionSpec.default(..., quant=) and with_quant: op -> fields.
# Only the linear layers are quantised; the LM head, norms and router stay in the op's dtype.
QUANT_PRESETS = {
    "fp8": {"linear": dict(weight=FP8_WEIGHT, act=FP8_ACT)},
    "fp8_kv": {"attention": dict(kv=FP8_KV)},
    # DeepSeek-V4's lightning indexer scored in FP8, its key cache in e4m3 codes and row scales (the recipe's)
    "fp8_indexer": {"indexer": dict(act=FP8_INDEX, kv=FP8_INDEX)},
    "nvfp4_w4a16": {"linear": dict(weight=NVFP4_WEIGHT)},
    "nvfp4_w4a4": {"linear": dict(weight=NVFP4_WEIGHT, act=NVFP4_ACT)},
    # by module class (Nemotron-H's recipe: "fp8_mamba+nvfp4_experts+fp8_kv", the rest in the spec's dtype)
    "fp8_mamba": {"mamba_proj": dict(weight=FP8_WEIGHT, act=FP8_ACT)},
    "nvfp4_experts": {"expert": dict(weight=NVFP4_WEIGHT)},
}


# OpSpec's integer fields, settable by name (ExecutionSpec.with_settings, the benches' --spec)
SETTABLE = ("row_chunk", "reduce_tile", "kv_tile", "kv_split", "q_rows", "chunk")


@dataclass(frozen=True, slots=True)
class OpSpec:
    """How one operator computes: storage dtype, accumulation dtype, the fixed tiles its reductions use,
    and which of its tensors are quantised (None: kept in `dtype`, today's behaviour)."""
    dtype: str = "float32"
    accum_dtype: str = "float32"
    row_chunk: int = 16        # rows per fixed-shape launch (CPU): a row's kernel never depends on M
    reduce_tile: int = 16      # width of one tile of an ordered reduction
    kv_tile: int = 16          # keys per attention tile, absolute positions [i*kv_tile, (i+1)*kv_tile)
    kv_split: int = 256        # keys per split-KV partial (GPU), absolute positions, merged in ascending order
    q_rows: int | None = None  # attention (GPU): rows (query tokens x group heads) per program, so every
                               # dot's M; None = the kernel's 64
    weight: QuantSpec | None = None
    act: QuantSpec | None = None
    kv: QuantSpec | None = None
    router_placement: str | None = None  # MoE only: one of ROUTER_PLACEMENTS
    chunk: int | None = None   # ssd only: tokens per scan chunk, absolute positions [i*chunk, (i+1)*chunk)

    def __post_init__(self):
        for name in ("weight", "act", "kv"):
            value = getattr(self, name)
            if isinstance(value, dict):  # from JSON
                object.__setattr__(self, name, QuantSpec(**value))
            elif value is not None and not isinstance(value, QuantSpec):
                raise ValueError(f"{name} {value!r} must be a QuantSpec or None, e.g. FP8_ACT")
        if self.router_placement not in (None, *ROUTER_PLACEMENTS):
            raise ValueError(f"router_placement {self.router_placement!r} is unknown: use one of {ROUTER_PLACEMENTS}")
        for name in ("dtype", "accum_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} {getattr(self, name)!r} is unknown: use one of {sorted(DTYPES)}")
        for name in ("row_chunk", "reduce_tile", "kv_tile", "kv_split"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} {v} must be a power of two >= 1")
        if self.q_rows is not None and (self.q_rows < 16 or self.q_rows & (self.q_rows - 1)):
            raise ValueError(f"q_rows {self.q_rows} must be a power of two >= 16 (a dot's M), or None for 64")
        if self.chunk is not None and (self.chunk < 1 or self.chunk & (self.chunk - 1)):
            raise ValueError(f"chunk {self.chunk} must be a power of two >= 1 (tokens per scan chunk)")


@dataclass(frozen=True, slots=True)
class ExecutionSpec:
    mode: str = "consistent"
    device: str = "cpu"
    ops: dict = field(default_factory=lambda: {name: OpSpec() for name in OPS})

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is unknown: use one of {MODES}")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is unknown: use one of {DEVICES}")
        unknown = set(self.ops) - set(OPS) - set(MODULE_OPS) - set(FAMILY_OPS)
        if unknown:
            raise ValueError(f"ops {sorted(unknown)} are unknown: the operators are {OPS}, the module classes "
                             f"{tuple(MODULE_OPS)} and {FAMILY_OPS}")
        missing = set(OPS) - set(self.ops)
        if missing:
            object.__setattr__(self, "ops", {**self.ops, **{name: OpSpec() for name in missing}})
        for name, op in self.ops.items():
            for role in ("weight", "act", "kv"):
                if getattr(op, role) is not None and role not in QUANT_ROLES.get(name, ()):
                    raise ValueError(f"ops[{name!r}].{role} is set, but {name} has no quantisable {role}: "
                                     f"quantised tensors are {QUANT_ROLES}")
        check_indexer_quant(self.op("indexer"))

    @classmethod
    def default(cls, mode: str = "consistent", device: str = "cpu", quant: str | None = None) -> "ExecutionSpec":
        """FP32 on the CPU; on the GPU BF16 storage and GEMMs with FP32 accumulation, KV tiles of 32,
        FP32 log-probs. `quant` names QUANT_PRESETS joined by '+', e.g. "fp8+fp8_kv"."""
        if device == "cpu":
            spec = cls(mode=mode, device=device)
        else:
            bf16 = OpSpec(dtype="bfloat16", kv_tile=32)
            ops = {name: bf16 for name in OPS}
            ops.update(logprobs=OpSpec(dtype="float32"), sampling=OpSpec(dtype="float32"),
                       topk=OpSpec(dtype="float32"))
            spec = cls(mode=mode, device=device, ops=ops)
        for preset in quant.split("+") if quant else ():
            spec = spec.with_quant(preset)
        return spec

    def with_quant(self, preset: str) -> "ExecutionSpec":
        """This spec with QUANT_PRESETS[preset]'s tensors quantised; a tensor quantised already is an error."""
        if preset not in QUANT_PRESETS:
            raise ValueError(f"quant preset {preset!r} is unknown: use one of {tuple(QUANT_PRESETS)}, "
                             "several joined by '+' (e.g. 'fp8+fp8_kv')")
        ops = dict(self.ops)
        for name, fields in QUANT_PRESETS[preset].items():
            taken = [role for role in fields if getattr(ops.get(name), role, None) is not None]
            if taken:
                raise ValueError(f"quant preset {preset!r} sets {name}.{taken[0]}, which an earlier preset "
                                 "quantised already: combine presets that quantise different tensors")
            ops[name] = replace(self.op(name), **fields)
        return replace(self, ops=ops)

    def with_op(self, name: str, **fields) -> "ExecutionSpec":
        """This spec with ops[name]'s fields replaced, e.g. with_op("attention", q_rows=16)."""
        if name not in OPS + tuple(MODULE_OPS) + FAMILY_OPS:
            raise ValueError(f"op {name!r} is unknown: the operators are {OPS}, the module classes "
                             f"{tuple(MODULE_OPS)} and {FAMILY_OPS}")
        return replace(self, ops={**self.ops, name: replace(self.op(name), **fields)})

    def with_settings(self, settings: list[str]) -> "ExecutionSpec":
        """This spec with "op.field=value" settings applied (e.g. "attention.q_rows=16",
        "attention.kv_tile=64"): the integer fields of OpSpec, or null; quantisation is the presets' job."""
        spec = self
        for item in settings:
            key, _, value = item.partition("=")
            name, _, fname = key.partition(".")
            try:
                parsed = None if value.lower() in ("null", "none") else int(value)
            except ValueError:
                parsed = ...
            if fname not in SETTABLE or parsed is ...:
                raise ValueError(f"spec setting {item!r} is not op.field=value with an integer field "
                                 f"({', '.join(SETTABLE)}), e.g. attention.q_rows=16")
            spec = spec.with_op(name, **{fname: parsed})
        return spec

    def op(self, name: str) -> OpSpec:
        """ops[name]; a module class without an entry computes as the op it names (MODULE_OPS), a family's
        operator without one takes FAMILY_DEFAULTS'."""
        if name in self.ops:
            return self.ops[name]
        if name in MODULE_OPS:
            return self.ops[MODULE_OPS[name]]
        return FAMILY_DEFAULTS[name]

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.ops["linear"].dtype]

    def to_dict(self) -> dict:
        # Fields left None (an unquantised tensor, no router, no amax ceiling) are left out: a spec keeps the
        # JSON and hash it had before such a field existed, so checkpoints resume.
        def fields(value):
            if not isinstance(value, dict):
                return value
            return {k: fields(v) for k, v in value.items() if v is not None or k == "block"}
        # module classes and family operators join only once set: other specs keep their JSON and hash
        names = OPS + tuple(sorted(set(self.ops) - set(OPS)))
        return {"mode": self.mode, "device": self.device,
                "ops": {name: fields(asdict(self.ops[name])) for name in names}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    @classmethod
    def from_dict(cls, raw: dict) -> "ExecutionSpec":
        ops = {name: OpSpec(**value) for name, value in raw.get("ops", {}).items()}
        return cls(mode=raw.get("mode", "consistent"), device=raw.get("device", "cpu"), ops=ops)

    @classmethod
    def from_json(cls, text: str) -> "ExecutionSpec":
        return cls.from_dict(json.loads(text))

    def hash(self) -> str:
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def with_mode(self, mode: str) -> "ExecutionSpec":
        return replace(self, mode=mode)

    def __hash__(self):
        return hash(self.hash())


FAMILY_DEFAULTS = {"ssd": OpSpec(chunk=SSD_CHUNK), "indexer": OpSpec()}


def check_indexer_quant(op: OpSpec) -> None:
    """The indexer scores FP8 codes against FP8 codes with one scale per row, which leaves the dot: both of its
    tensors quantised or neither, each FP8 per row (FP8_INDEX, the fp8_indexer preset)."""
    if (op.act is None) != (op.kv is None):
        raise ValueError(f"ops['indexer'] quantises {'act' if op.kv is None else 'kv'} alone: the FP8 scorer takes "
                         "e4m3 query heads and e4m3 keys together; set both (the fp8_indexer preset) or neither")
    for role in ("act", "kv"):
        q = getattr(op, role)
        if q is not None and (q.format, q.scale_domain) != ("fp8_e4m3", "per_token"):
            raise ValueError(f"ops['indexer'].{role} is {q.format} {q.scale_domain}: the indexer's scale must leave "
                             "the dot, one per row: use fp8_e4m3 per_token (FP8_INDEX)")


def check_same_spec(engine_spec: ExecutionSpec, trainer_spec: ExecutionSpec) -> None:
    if engine_spec.hash() != trainer_spec.hash():
        raise RuntimeError(
            f"engine ExecutionSpec {engine_spec.hash()} != trainer ExecutionSpec {trainer_spec.hash()}: "
            "both sides must run under one numeric contract; build them from the same spec")
