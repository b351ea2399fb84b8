"""`onepath check`: every gate passes on the real path and fails on the defect it exists to catch.

Planted defects (Ops subclasses given through the gates' ops_factory hook, or a patched sync):
  C2 a kernel whose output depends on global RNG state (not a function of its input);
  C3 linear with an M-dependent branch: launches of at most 8 rows take the stock F.linear, the
     consistent 16-row chunks above. (torch 2.13 CPU, measured: unpadded F.linear differs from the
     16-row chunk only at M <= 3, so 'stock F.linear above 8 rows' changes no bit on this machine;
     a split-K reduction above 8 rows is planted too, as bisect's test does);
  C4 decode with another reduction order: launches of single-token queries take the baseline attention;
  C7 a wrong backward: linear's reference gradient scaled by 1.01 (forward values untouched);
  C8, C9 a stale weight: the engine's weight sync skips one parameter;
  C4's graph-vs-eager part: an engine asked for CUDA graphs that replays none (a CPU engine posing as CUDA).
The same gates on the GPU, with their controls there: tests/consistency/test_gates_gpu.py.
"""
import json

import pytest
import torch

from onepath.consistency import gates
from onepath.consistency.gates import (GATES, GRAD_BOUNDS, GateContext, engine_has_graphs, main, param_group,
                                       parse_gates, run_gate, run_gates)
from onepath.engine.llm_engine import LLMEngine
from onepath.models.checkpoint import save_checkpoint
from onepath.models.config import ModelConfig
from onepath.ops import Ops
from onepath.ops import linear as _linear
from onepath.ops.autograd import apply_kernel
from tests.tiny import tiny_config, tiny_model
from tests.planted import DecodeBaselineAttentionOps, SplitKAboveEightOps

STALE = "model.layers.1.mlp.down_proj.weight"


def inputs(x, weight, bias):
    return (x, weight) if bias is None else (x, weight, bias)


class SmallLaunchStockGemmOps(Ops):
    """M-dependent branch: a launch of at most 8 rows runs the stock F.linear (no fixed row chunk)."""

    def linear(self, x, weight, bias=None):
        if x.reshape(-1, x.shape[-1]).shape[0] > 8:
            return super().linear(x, weight, bias)
        return apply_kernel(_linear.reference, _linear.reference, *inputs(x, weight, bias))


class ScaledBackwardOps(Ops):
    """Wrong backward: linear's forward is the consistent kernel, its gradient 1.01 times the true one."""

    def linear(self, x, weight, bias=None):
        forward = super().linear
        return apply_kernel(forward, lambda *t: 1.01 * _linear.reference(*t), *inputs(x, weight, bias))


class NoisyNormOps(Ops):
    """Not deterministic: rmsnorm's output moves with the global RNG."""

    def rmsnorm(self, x, weight, eps):
        out = super().rmsnorm(x, weight, eps)
        return out + 1e-6 * torch.rand(out.shape)


def one(name, **options) -> gates.GateResult:
    (result,) = run_gates("tiny", (name,), **options)
    return result


def test_every_gate_passes_on_the_real_path_with_its_evidence(tmp_path, capsys):
    path = tmp_path / "check.json"
    assert main(["tiny", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "11 of 11 gates passed" in out and "FAIL" not in out
    report = json.loads(path.read_text())
    assert report["passed"] and [g["gate"] for g in report["gates"]] == list(GATES)
    g = {r["gate"]: r for r in report["gates"]}
    assert all(r["passed"] for r in g.values()), [(r["gate"], r["detail"]) for r in g.values() if not r["passed"]]
    c0 = g["C0"]["evidence"]
    assert {"embedding", "linear", "rmsnorm", "rope", "attention", "silu_mul", "lm_head",
            "sample_with_logprobs"} <= set(c0["ops"])
    assert c0["spec_hash"] == report["spec_hash"] and c0["parallel"]["tensor_parallel"] == 1
    assert g["C1"]["evidence"]["tokens_per_s"] > 0 and g["C1"]["evidence"]["mode"] == "baseline"
    assert all(r["differing_site_rows"] == 0 and r["elements"] > 0 for r in g["C2"]["evidence"]["forward_twice"])
    assert len(g["C3"]["evidence"]["trials"]) == 4 and max(t["batch"] for t in g["C3"]["evidence"]["trials"]) >= 16
    assert g["C4"]["evidence"]["graph_vs_eager"].startswith("N/A on CPU")
    assert g["C5"]["evidence"]["valid_tokens"] > 50 and g["C5"]["evidence"]["k3_kl"] == 0.0
    assert all(row["differing_sites"] == 0 for row in g["C6"]["evidence"]["layers"].values())
    c7 = g["C7"]["evidence"]
    assert c7["bound"] == GRAD_BOUNDS["float32"] == 1e-4
    assert set(c7["groups"]) == {"embeddings", "attention.q_proj", "attention.k_proj", "attention.v_proj",
                                 "attention.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "norms",
                                 "lm_head"}
    assert all(0 < v["rel_err"] <= 1e-4 for v in c7["groups"].values())  # fp32 vs float64: close, not equal
    assert [s["exact"] for s in g["C8"]["evidence"]["steps"]] == [True, True]
    assert g["C9"]["evidence"]["hf_export_fresh_engine"]["equals_running_engine"]
    assert g["C10"]["evidence"]["ratio"] > 0


@pytest.mark.parametrize("ops", [SmallLaunchStockGemmOps, SplitKAboveEightOps])
def test_m_dependent_linear_fails_c3_and_names_linear(ops):
    result = one("C3", ops_factory=ops)
    assert not result.passed
    bad = [t for t in result.evidence["trials"] if not t["equal"]]
    assert bad and bad[0]["first_difference"] is not None
    located = result.evidence["first_divergence"]
    assert located["found"] and located["op"] == "linear" and located["layer"] == 0, located
    assert "linear" in result.detail


def test_decode_with_another_reduction_order_fails_c4_at_attention():
    result = one("C4", ops_factory=DecodeBaselineAttentionOps)
    assert not result.passed
    bad = [r for r in result.evidence["replays"] if r["first"]]
    assert {r["layout"] for r in bad} >= {"prefill 1 then decode", "prefill 12 then decode"}
    assert all(r["first"]["op"] == "attention" and r["first"]["layer"] == 0 for r in bad)
    # chunked prefill launches are multi-token queries: they keep the consistent path
    assert not any(r["first"] for r in result.evidence["replays"] if "chunks" in r["layout"])


class CudaLabelledContext(GateContext):
    """A CPU context that says it runs on CUDA, so C4 runs its graph-vs-eager part. A CPU model cannot
    capture: its engines drop the request for graphs, and the 'graph' side runs eager."""

    @property
    def device(self) -> str:
        return "cuda"

    def engine(self, model, prompts, max_tokens, prefix_caching=True, graphs=None, **scheduler):
        return super().engine(model, prompts, max_tokens, prefix_caching, None, **scheduler)


@pytest.mark.skipif(not engine_has_graphs(), reason="the engine has no cuda_graphs switch")
def test_graph_engine_that_replays_no_graph_fails_c4():
    result = run_gate(CudaLabelledContext.load("tiny"), "C4")
    assert not result.passed and "replayed no CUDA graph" in result.detail
    graph = result.evidence["graph_vs_eager"]
    assert graph["cuda_graphs"]["graph_steps"] == 0 < graph["cuda_graphs"]["eager_steps"]
    # the comparison itself ran: every token of requests of 2..20 tokens, equal (both sides eager)
    assert graph["differing_requests"] == 0 and graph["tokens"] == sum(graph["max_tokens"]) == 110


def test_c4_graph_part_is_na_for_an_engine_without_cuda_graphs(monkeypatch):
    monkeypatch.setattr(gates.kernels, "engine_has_graphs", lambda: False)
    result = run_gate(CudaLabelledContext.load("tiny"), "C4")
    assert result.passed and result.evidence["graph_vs_eager"].startswith("N/A: engine has no CUDA graphs")
    assert result.detail.endswith("graph vs eager N/A")


def test_wrong_backward_fails_c7_per_group():
    result = one("C7", ops_factory=ScaledBackwardOps)
    assert not result.passed
    groups = result.evidence["groups"]
    for name in ("attention.q_proj", "attention.o_proj", "mlp.gate_proj", "mlp.down_proj", "embeddings"):
        assert groups[name]["rel_err"] > 100 * result.evidence["bound"], (name, groups[name])
    # the kernel's forward values are untouched: only the gradient is wrong
    assert result.evidence["forward_logprob_rel_err"] < 1e-6


def test_stale_weight_after_sync_fails_c8_and_c9(monkeypatch):
    sync = LLMEngine.update_weights

    def skipping_one(self, named_tensors):
        sync(self, [(n, t) for n, t in named_tensors if n != STALE])

    monkeypatch.setattr(LLMEngine, "update_weights", skipping_one)
    c8, c9 = run_gates("tiny", ("C8", "C9"))
    assert not c8.passed and not c9.passed
    steps = c8.evidence["steps"]
    assert steps[0]["exact"] and steps[0]["stale_after_sync"] == [STALE] and not steps[1]["exact"]
    assert STALE in c8.detail
    assert not c9.evidence["first_step_after_restore"]["exact"]
    assert not c9.evidence["hf_export_fresh_engine"]["equals_running_engine"]
    assert not c9.evidence["restored_weights_differ"] and not c9.evidence["next_update_differs"]


def test_trainer_engine_divergence_fails_c5_and_c6_names_the_layer():
    c5, c6 = run_gates("tiny", ("C5", "C6"), ops_factory=DecodeBaselineAttentionOps)
    assert not c5.passed and not c6.passed
    located = c5.evidence["C6"]["first_divergence"]
    assert located["found"] and (located["op"], located["layer"]) == ("attention", 0)
    layers = c6.evidence["layers"]
    assert layers["0"]["differing_sites"] > 0 and layers["0"]["first"] == "attention at model.layers.0.self_attn"
    assert "attention" in c6.detail and "layer 0" in c6.detail


def test_nondeterministic_kernel_fails_c2():
    result = one("C2", ops_factory=NoisyNormOps)
    assert not result.passed
    first = result.evidence["forward_twice"][0]["first"]
    assert first["op"] == "rmsnorm" and first["module"] == "model.layers.0.input_layernorm"


def test_negative_control_baseline_spec_fails_the_bitwise_gates(capsys):
    assert main(["tiny", "--spec", "baseline", "--gates", "C5,C3,C4"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL") >= 3 and "0 of 3 gates passed" in out
    assert out.index("C3 ") < out.index("C4 ") < out.index("C5 ")  # gate order, whatever the flag's order


def test_c10_gates_on_min_ratio():
    result = one("C10", min_throughput_ratio=1e6)
    assert not result.passed and 0 < result.evidence["ratio"] < 1e6


@pytest.mark.parametrize("overrides", [
    dict(model_type="qwen2", tie_word_embeddings=True),
    dict(model_type="llama", attention_bias=True, mlp_bias=True,
         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}),
    dict(model_type="mistral", sliding_window=6, num_key_value_heads=1),
])
def test_c7_reference_covers_architecture_variants(overrides):
    config = tiny_config(**overrides)
    (result,) = run_gates(config, ("C7",))
    assert result.passed, result.detail
    assert result.evidence["forward_logprob_rel_err"] < 1e-6


def test_checkpoint_directory_as_model(tmp_path, capsys):
    save_checkpoint(tmp_path / "ckpt", tiny_model("consistent").hf_state_dict(), tiny_config())
    assert main([str(tmp_path / "ckpt"), "--gates", "c0,C5"]) == 0
    assert "2 of 2 gates passed" in capsys.readouterr().out


def test_gate_names_and_groups():
    assert parse_gates("C3,c2") == ("C2", "C3") and parse_gates(None) == tuple(GATES)
    with pytest.raises(ValueError, match="unknown gate C11"):
        parse_gates("C2,C11")
    assert param_group("model.layers.3.self_attn.k_proj.bias") == "attention.k_proj"
    assert param_group("model.layers.0.self_attn.q_norm.weight") == "norms"
    assert isinstance(ModelConfig(**gates.TINY), ModelConfig)


def test_cli_backend_flag_and_repro_dir(tmp_path, capsys):
    ops = "tests.planted:SplitKAboveEightOps"
    assert main(["tiny", "--ops", ops, "--gates", "C3", "--repro-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "backend SplitKAboveEightOps" in out and "first op: linear" in out
    case = json.loads((tmp_path / "C3" / "case.json").read_text())
    assert case["op"] == "linear" and case["a"]["ops_class"] == ops
    assert (tmp_path / "C3" / "repro.py").is_file()


def test_c0_knows_the_spec_entry_of_every_ops_method():
    """C0 flags a call it cannot place in the ExecutionSpec: each Ops method a model calls (Qwen3's fused QK-norm
    and RoPE on CUDA, the MoE router and experts) names its entry, is one of the FP32 ops whose recipe the mode
    alone picks (softmax, sigmoid), or is a query that computes nothing."""
    import inspect

    from onepath.consistency.gates.inventory import OP_SPEC, QUERIES
    from onepath.numerics.spec import FAMILY_OPS, FP32_OPS, OPS
    methods = {name for name, _ in inspect.getmembers(Ops) if not name.startswith("_")} - set(QUERIES)
    assert sorted(m for m in methods if OP_SPEC.get(m, m) not in OPS + FAMILY_OPS + FP32_OPS) == []
    assert {"softmax", "sigmoid"} <= methods and not {"softmax", "sigmoid"} & set(OPS)


def test_c0_places_the_moe_router_softmax_and_shared_gate_sigmoid(monkeypatch):
    """On a Qwen2-MoE model (softmax router, sigmoid-gated shared expert) C0 passes with both ops recorded; the
    control, the same run with the FP32 ops unknown to it, fails naming them."""
    from onepath.consistency.gates import inventory
    from tests.tiny import tiny_moe_config
    ctx = GateContext.load(tiny_moe_config(model_type="qwen2_moe", shared_expert_intermediate_size=24))
    result = inventory.gate_c0(ctx)
    assert result.passed, result.detail
    assert {"softmax", "sigmoid"} <= set(result.evidence["ops"])
    monkeypatch.setattr(inventory, "FP32_OPS", ())
    control = inventory.gate_c0(ctx)
    assert not control.passed and "['sigmoid', 'softmax']" in control.detail, control.detail
