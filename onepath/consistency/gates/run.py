"""The gates in order (GATES), and running them: a crashing gate fails with its error as evidence."""
from __future__ import annotations

import time
import traceback
from typing import Callable

from onepath.consistency.gates.context import GateContext, GateResult
from onepath.consistency.gates.inventory import gate_c0
from onepath.consistency.gates.kernels import gate_c2, gate_c3, gate_c4
from onepath.consistency.gates.rl import gate_c8, gate_c9
from onepath.consistency.gates.throughput import gate_c1, gate_c10
from onepath.consistency.gates.trainer import gate_c5, gate_c6, gate_c7
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops

GATES = {"C0": gate_c0, "C1": gate_c1, "C2": gate_c2, "C3": gate_c3, "C4": gate_c4, "C5": gate_c5, "C6": gate_c6,
         "C7": gate_c7, "C8": gate_c8, "C9": gate_c9, "C10": gate_c10}


def parse_gates(text: str | None) -> tuple[str, ...]:
    if not text:
        return tuple(GATES)
    names = [t.strip().upper() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in GATES]
    if unknown:
        raise ValueError(f"unknown gate {unknown[0]}: choose from {', '.join(GATES)}, e.g. --gates C2,C3")
    return tuple(n for n in GATES if n in names)  # always in gate order


def run_gate(ctx: GateContext, name: str) -> GateResult:
    start = time.perf_counter()
    try:
        result = GATES[name](ctx)
    except Exception as e:  # a gate that crashes fails with the error as its evidence; the others still run
        result = GateResult(name, False, {"error": f"{type(e).__name__}: {e}",
                                          "traceback": traceback.format_exc(limit=-4).splitlines()},
                            f"error: {type(e).__name__}: {e}")
    result.seconds = time.perf_counter() - start
    return result


def run_gates(model, gates=tuple(GATES), device: str = "cpu", *, spec: ExecutionSpec | str | None = None,
              ops_factory: Callable | None = None, **options) -> list[GateResult]:
    """Run `gates` in order on `model` ('tiny', a checkpoint directory or a ModelConfig). `ops_factory`
    (spec -> ops, e.g. an Ops subclass) builds every model under test; options are GateContext fields."""
    names = parse_gates(",".join(gates) if not isinstance(gates, str) else gates)
    ctx = GateContext.load(model, device, spec, ops_factory=ops_factory or Ops, **options)
    return [run_gate(ctx, name) for name in names]
