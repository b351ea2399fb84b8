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


@dataclass(frozen=True, slots=True)
class OpSpec:
    """How one operator computes: storage dtype, accumulation dtype, and the fixed tiles its reductions use."""
    dtype: str = "float32"
    accum_dtype: str = "float32"
    row_chunk: int = 16        # rows per fixed-shape launch (CPU): a row's kernel never depends on M
    reduce_tile: int = 16      # width of one tile of an ordered reduction
    kv_tile: int = 16          # keys per attention tile, absolute positions [i*kv_tile, (i+1)*kv_tile)
    kv_split: int = 256        # keys per split-KV partial (GPU), absolute positions, merged in ascending order

    def __post_init__(self):
        for name in ("dtype", "accum_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} {getattr(self, name)!r} is unknown: use one of {sorted(DTYPES)}")
        for name in ("row_chunk", "reduce_tile", "kv_tile", "kv_split"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} {v} must be a power of two >= 1")


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
        unknown = set(self.ops) - set(OPS)
        if unknown:
            raise ValueError(f"ops {sorted(unknown)} are unknown: the operators are {OPS}")
        missing = set(OPS) - set(self.ops)
        if missing:
            object.__setattr__(self, "ops", {**self.ops, **{name: OpSpec() for name in missing}})

    @classmethod
    def default(cls, mode: str = "consistent", device: str = "cpu") -> "ExecutionSpec":
        """FP32 on the CPU; on the GPU BF16 storage and GEMMs with FP32 accumulation, KV tiles of 32,
        FP32 log-probs."""
        if device == "cpu":
            return cls(mode=mode, device=device)
        bf16 = OpSpec(dtype="bfloat16", kv_tile=32)
        ops = {name: bf16 for name in OPS}
        ops.update(logprobs=OpSpec(dtype="float32"), sampling=OpSpec(dtype="float32"), topk=OpSpec(dtype="float32"))
        return cls(mode=mode, device=device, ops=ops)

    def op(self, name: str) -> OpSpec:
        return self.ops[name]

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.ops["linear"].dtype]

    def to_dict(self) -> dict:
        return {"mode": self.mode, "device": self.device,
                "ops": {name: asdict(self.ops[name]) for name in OPS}}

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


def check_same_spec(engine_spec: ExecutionSpec, trainer_spec: ExecutionSpec) -> None:
    if engine_spec.hash() != trainer_spec.hash():
        raise RuntimeError(
            f"engine ExecutionSpec {engine_spec.hash()} != trainer ExecutionSpec {trainer_spec.hash()}: "
            "both sides must run under one numeric contract; build them from the same spec")
