"""`onepath check --device cuda` (BF16) on a sliced Nemotron-H hybrid: every gate passes (C4 comparing decode
replayed from CUDA graphs with eager decode, C7 against the float64 Nemotron-H reference under bf16's bound), the
scan's chunk 16 so that the sequences cross it; the baseline spec fails the bitwise gates; bisect names a planted
one-ulp divergence inside the scan's decode. The CPU version, with the wrong-backward control: test_hybrid_check.py.
"""
import json

import pytest
import torch

from onepath.cli import main
from onepath.consistency.gates import GATES, run_gates
from onepath.consistency.slice import slice_checkpoint
from onepath.models import build_decoder
from onepath.models.checkpoint import save_checkpoint
from onepath.models.config import NemotronHConfig, pattern_layers
from onepath.ops import ExecutionSpec, Ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CHUNK = 16


def spec(mode="consistent"):
    return ExecutionSpec.default(mode, "cuda").with_op("ssd", chunk=CHUNK)


def make_sliced(root):
    """The hybrid under check, sliced to 4 layers (one of each kind), at root/"sliced" (root/"full": the whole)."""
    config = NemotronHConfig(vocab_size=512, hidden_size=256, layers_block_type=pattern_layers("ME*M-M"),
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                             mamba_num_heads=4, mamba_head_dim=64, ssm_state_size=64, n_groups=2, chunk_size=CHUNK,
                             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                             moe_shared_expert_intermediate_size=256, max_position_embeddings=512, eos_token_id=2)
    model = build_decoder(config, Ops(ExecutionSpec("baseline")))
    model.init_weights(0, std=0.1)
    save_checkpoint(root / "full", model.hf_state_dict(), config)
    slice_checkpoint(root / "full", root / "sliced", layers=4, start=1)
    return root / "sliced"


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    make_sliced(root)
    (root / "spec.json").write_text(spec().to_json())
    return root


@pytest.mark.gpu_smoke
def test_every_gate_passes_on_the_sliced_hybrid_gpu(sliced, capsys):
    out = sliced / "check.json"
    assert main(["check", str(sliced / "sliced"), "--device", "cuda", "--spec", str(sliced / "spec.json"),
                 "--json", str(out)]) == 0, capsys.readouterr().out
    gates = {g["gate"]: g for g in json.loads(out.read_text())["gates"]}
    assert list(gates) == list(GATES) and all(g["passed"] for g in gates.values())
    graph = gates["C4"]["evidence"]["graph_vs_eager"]
    assert graph["cuda_graphs"]["graph_steps"] > 0 and graph["differing_requests"] == 0


def test_negative_control_baseline_spec_fails_the_bitwise_gates_gpu(sliced):
    results = run_gates(str(sliced / "sliced"), ("C4", "C5"), device="cuda", spec=spec("baseline"))
    assert not any(r.passed for r in results), [(r.name, r.detail) for r in results]


def test_bisect_names_a_planted_ulp_inside_the_scan_gpu(sliced, tmp_path):
    spec_path = str(sliced / "spec.json")
    assert main(["bisect", str(sliced / "sliced"), "--device", "cuda", "--sides", "prefill-decode", "--spec-a",
                 spec_path, "--spec-b", spec_path, "--length", "40", "--ops-b", "tests.planted:ScanDecodeUlpOps",
                 "--out", str(tmp_path / "repro"), "--json", str(tmp_path / "bisect.json")]) == 1
    first = json.loads((tmp_path / "bisect.json").read_text())["first"]
    # a decode position (prefill 1): where the one ulp of dt first reaches the output's rounding
    assert (first["op"], first["layer"]) == ("ssd", 2) and first["first_position"] >= 1
