"""`onepath check` and `onepath bisect` on a sliced Nemotron-H hybrid (CPU): a six-layer checkpoint in the hub layout
(backbone.*) is cut to four layers that still hold every kind (Mamba-2, MoE, attention, MLP); every gate C0..C10
passes on it with its evidence, C7 against the float64 Nemotron-H reference (consistency/reference_nemotron_h.py).
Controls: the baseline spec fails the bitwise gates; a scan whose backward is 1.01 times the true one fails C7 in
the Mamba groups; a planted one-ulp divergence inside the scan's decode (tests/planted.ScanDecodeUlpOps) is named by
bisect at the scan of the slice's Mamba layer, its repro reproducing alone, while the real path has none."""
import json
import subprocess
import sys

import pytest

from onepath.consistency.gates import main as check_main
from onepath.consistency.gates import run_gates
from onepath.consistency.slice import slice_checkpoint, slice_config
from onepath.models import build_decoder
from onepath.models.checkpoint import save_checkpoint
from onepath.models.config import NemotronHConfig
from onepath.ops import ExecutionSpec, Ops
from onepath.ops import ssd as _ssd
from onepath.ops.autograd import apply_kernel
from onepath.cli import main

CHUNK = 8
KINDS = ["linear_attention", "moe", "full_attention", "linear_attention", "mlp", "linear_attention"]


def spec(mode="consistent"):
    return ExecutionSpec.default(mode, "cpu").with_op("ssd", chunk=CHUNK)


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    """Layers 1..4 of a six-layer hybrid: moe, attention, Mamba, MLP; and the spec's JSON (ssd.chunk 8)."""
    root = tmp_path_factory.mktemp("hybrid")
    config = NemotronHConfig(vocab_size=61, hidden_size=32, layers_block_type=KINDS, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, intermediate_size=40, mamba_num_heads=4,
                             mamba_head_dim=6, ssm_state_size=5, n_groups=2, chunk_size=CHUNK, n_routed_experts=6,
                             num_experts_per_tok=2, moe_intermediate_size=12, moe_shared_expert_intermediate_size=20,
                             n_group=3, topk_group=2, max_position_embeddings=256, eos_token_id=2)
    model = build_decoder(config, Ops(ExecutionSpec("baseline")))
    model.init_weights(0, std=0.2)
    save_checkpoint(root / "full", model.hf_state_dict(), config)
    report = slice_checkpoint(root / "full", root / "sliced", layers=4, start=1)
    assert not report.missing_kinds and report.kinds == 4, report.format()
    (root / "spec.json").write_text(spec().to_json())
    return root


def test_slice_cuts_the_hybrid_pattern_and_its_backbone_tensors(sliced):
    config = json.loads((sliced / "sliced" / "config.json").read_text())
    assert config["layers_block_type"] == KINDS[1:5] and config["num_hidden_layers"] == 4
    from onepath.models.checkpoint import load_state_dict
    names = load_state_dict(sliced / "sliced")
    assert "backbone.layers.3.mixer.up_proj.weight" in names and "backbone.layers.2.mixer.A_log" in names
    assert not any(n.startswith("backbone.layers.4.") for n in names)
    raw = {"model_type": "nemotron_h", "hybrid_override_pattern": "ME*M-E", "num_hidden_layers": 6}
    assert slice_config(raw, 2, 3)["hybrid_override_pattern"] == "*M-"
    assert slice_config({"hybrid_override_pattern": "ME*M"}, 1, 2) == {"hybrid_override_pattern": "E*",
                                                                        "num_hidden_layers": 2}
    with pytest.raises(ValueError, match="hybrid_override_pattern has 3 letters for 6 layers"):
        slice_config({"hybrid_override_pattern": "ME*", "num_hidden_layers": 6}, 0, 2)


def test_every_gate_passes_on_the_sliced_hybrid(sliced, capsys):
    out = sliced / "check.json"
    assert check_main([str(sliced / "sliced"), "--spec", str(sliced / "spec.json"), "--json", str(out)]) == 0
    assert "11 of 11 gates passed" in capsys.readouterr().out
    gates = {g["gate"]: g for g in json.loads(out.read_text())["gates"]}
    assert {"ssd", "causal_conv1d", "gated_rmsnorm", "relu2", "attention"} <= set(gates["C0"]["evidence"]["ops"])
    assert {"mamba.in_proj", "mamba.out_proj", "mamba.conv1d", "mamba.ssm", "moe.router", "moe.experts",
            "moe.shared_expert", "attention.q_proj", "mlp.up_proj"} <= set(gates["C7"]["evidence"]["groups"])
    assert "chunks of 7" in gates["C4"]["detail"] and "prefill 1 then decode" in gates["C4"]["detail"]


def test_negative_control_baseline_spec_fails_the_bitwise_gates(sliced):
    results = run_gates(str(sliced / "sliced"), ("C3", "C4", "C5", "C6"), spec=spec("baseline"))
    assert not any(r.passed for r in results), [(r.name, r.detail) for r in results]


class ScaledScanBackwardOps(Ops):
    """Wrong backward: the scan's forward is the consistent kernel, its gradient SCALE times the true one."""
    SCALE = 1.01

    def ssd(self, x, dt, B, C, A_log, D, dt_bias, spans, state=None, dt_limit=_ssd.NO_LIMIT, state_dtype=None):
        forward = lambda *t: _ssd.KERNELS[self.spec.mode, self.spec.device](
            *t, spans=spans, state=state, chunk=CHUNK, dt_limit=dt_limit, state_dtype=state_dtype)
        wrong = lambda *t: self.SCALE * _ssd.reference(*t, spans=spans, chunk=CHUNK, dt_limit=dt_limit)
        return apply_kernel(forward, wrong, x, dt, B, C, A_log, D, dt_bias)


def test_a_wrong_scan_backward_fails_c7_in_the_mamba_groups(sliced):
    (c7,) = run_gates(str(sliced / "sliced"), ("C7",), spec=spec(), ops_factory=ScaledScanBackwardOps)
    failing = {g for g, v in c7.evidence["groups"].items() if v["rel_err"] > c7.evidence["bound"]}
    assert not c7.passed and {"mamba.ssm", "mamba.in_proj"} <= failing, c7.detail


def bf16_spec(mode="consistent"):
    """The CPU's ops in BF16 (log-probs, sampling and the router's top-k in FP32, as on the GPU)."""
    from onepath.numerics.spec import OPS, OpSpec
    ops = {name: OpSpec(dtype="bfloat16") for name in OPS}
    ops.update(logprobs=OpSpec(dtype="float32"), sampling=OpSpec(dtype="float32"), topk=OpSpec(dtype="float32"))
    return ExecutionSpec(mode=mode, device="cpu", ops=ops).with_op("ssd", chunk=16)


class WrongScanBackwardOps(ScaledScanBackwardOps):
    SCALE = 1.25


def test_c7_in_bf16_takes_the_stock_paths_error_as_a_floor_and_still_fails_a_wrong_backward():
    """In BF16 a group may pass within 2x the stock path's own error on the draw (lab/c7_bf16_draws.py: seed 7's
    mamba.ssm, a few per-head gradients summed over every token, lies past the fixed 0.05 on the CPU as on the
    GPU); a scan backward 1.25 times the true one still fails in the Mamba groups."""
    import tempfile
    from pathlib import Path

    from onepath.consistency.gates import STOCK_FACTOR
    from tests.consistency.test_hybrid_check_gpu import make_sliced

    sliced = str(make_sliced(Path(tempfile.mkdtemp())))
    (c7,) = run_gates(sliced, ("C7",), spec=bf16_spec(), seed=7)
    ssd = c7.evidence["groups"]["mamba.ssm"]
    assert c7.passed and c7.evidence["bound"] == 0.05 < ssd["rel_err"] <= STOCK_FACTOR * ssd["stock_rel_err"], ssd
    (wrong,) = run_gates(sliced, ("C7",), spec=bf16_spec(), seed=7, ops_factory=WrongScanBackwardOps)
    failing = {g for g, v in wrong.evidence["groups"].items() if v["rel_err"] > v["bound"]}
    assert not wrong.passed and {"mamba.ssm", "mamba.in_proj"} <= failing, wrong.detail


def test_bisect_names_a_planted_ulp_inside_the_scan_and_its_repro_reproduces(sliced, tmp_path, capsys):
    args = ["bisect", str(sliced / "sliced"), "--sides", "prefill-decode", "--spec-a", str(sliced / "spec.json"),
            "--spec-b", str(sliced / "spec.json"), "--length", "30", "--json", str(tmp_path / "bisect.json")]
    assert main([*args, "--out", str(tmp_path / "clean")]) == 0
    assert "no divergence" in capsys.readouterr().out
    assert main([*args, "--ops-b", "tests.planted:ScanDecodeUlpOps", "--out", str(tmp_path / "repro")]) == 1
    report = json.loads((tmp_path / "bisect.json").read_text())
    first = report["first"]
    assert (first["op"], first["module"], first["layer"]) == ("ssd", "model.layers.2.mixer", 2)
    assert first["first_position"] == 1 and 0 < first["max_ulp"] < 64 and report["reproduces"]
    earlier = [s for s in report["sites"] if s["site"] < first["site"]]
    assert earlier and not any(s["differing"] for s in earlier)
    repro = subprocess.run([sys.executable, report["repro"]], capture_output=True, text=True, cwd=tmp_path)
    assert repro.returncode == 1 and "the divergence reproduces" in repro.stdout, repro.stdout + repro.stderr
