"""`onepath check MODEL`: the consistency gates C0..C10, in order, each with its evidence.

Each gate is a function `gate_cN(ctx) -> GateResult` over a GateContext: the model's config and
weights, the ExecutionSpec under test, and the backend factory (`ops_factory`, an `Ops` subclass or
any callable spec -> ops) that builds every model the gate runs. Tests plant defects through that
hook; the baseline that C1 and C10 time always runs the stock `Ops` under the spec's baseline mode.

  C0 inventory       operators recorded in one generate, dtypes, quantisation, layout, spec and hash
  C1 baseline        the baseline engine's tokens/s on a fixed workload (the denominator)
  C2 determinism     the same forward twice, every op output bitwise; the same generate twice
  C3 batch           a request alone vs inside batches of random sizes at random places (engine)
  C4 phase           whole prefill vs chunked prefill vs decode, every op output; engine chunking; CUDA graphs
  C5 trainer=engine  engine generate -> Actor.logprobs -> rollout_diff exactly 0 (C6 locates a failure)
  C6 layer by layer  trainer vs engine replay, every op of every layer, first divergence
  C7 gradients       d(sum of completion log-probs)/d(every parameter) vs the float64 reference
  C8 RL updates      two rollout -> update -> in-place sync steps, diff exactly 0 before each update
  C9 checkpoint      save, restore: first step diff 0 and exact resume; HF export -> fresh engine
  C10 overhead       consistent / baseline engine tokens/s on C1's workload

A gate passes on exact equality where the contract is bitwise (C2..C6, C8, C9), within a stated
relative-error bound where it compares against float64 (C7), and records numbers for C1 and C10
(C10 gates on --min-ratio when given).

  context.py     GateContext (model, weights, spec, backend factory), GateResult, shared helpers
  inventory.py   C0
  throughput.py  C1, C10
  kernels.py     C2..C4
  trainer.py     C5..C7
  rl.py          C8, C9
  run.py         GATES in order, run_gate, run_gates
  cli.py         `onepath check` (main)
"""
from onepath.consistency.bisect import TINY
from onepath.consistency.gates.cli import format_result, main
from onepath.consistency.gates.context import (SAMPLING, TITLES, GateContext, GateResult, Workload,
                                               compare_traces, diff_evidence, engine_has_graphs, first_difference,
                                               locate, recompute, rollout, sampling_params, site_summary)
from onepath.consistency.gates.inventory import OP_SPEC, gate_c0
from onepath.consistency.gates.kernels import gate_c2, gate_c3, gate_c4, graph_vs_eager
from onepath.consistency.gates.rl import gate_c8, gate_c9, stale_parameters, train_step
from onepath.consistency.gates.run import GATES, parse_gates, run_gate, run_gates
from onepath.consistency.gates.throughput import gate_c1, gate_c10, measure_throughput
from onepath.consistency.gates.trainer import (GRAD_BOUNDS, STOCK_FACTOR, engine_trainer_layers, gate_c5, gate_c6,
                                              gate_c7, param_group)

__all__ = ["GATES", "GRAD_BOUNDS", "OP_SPEC", "SAMPLING", "STOCK_FACTOR", "TINY", "TITLES", "GateContext", "GateResult",
           "Workload",
           "compare_traces", "diff_evidence", "engine_has_graphs", "engine_trainer_layers", "first_difference",
           "format_result", "gate_c0", "gate_c1", "gate_c2", "gate_c3", "gate_c4", "gate_c5", "gate_c6", "gate_c7",
           "gate_c8", "gate_c9", "gate_c10", "graph_vs_eager", "locate", "main", "measure_throughput", "param_group",
           "parse_gates", "recompute", "rollout", "run_gate", "run_gates", "sampling_params", "site_summary",
           "stale_parameters", "train_step"]
