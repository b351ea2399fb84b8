"""`onepath check` and `onepath bisect` on a sliced DeepSeek-V4-shaped checkpoint on the CPU: the slice keeps every
kind of layer (sliding, CSA, HCA; hash and top-k MoE), every gate C0-C10 passes on it (C7 against the float64
DeepSeek-V4 reference), and a one-ulp change planted in the indexer score of small launches (tests/planted.py) is
what bisect names first, with a repro that reproduces it, and what fails C4."""
import json

import pytest
import torch

from onepath.consistency.bisect import Side, bisect
from onepath.consistency.bisect import main as bisect_main
from onepath.consistency.gates import main, run_gates
from onepath.consistency.recorder import Layout
from onepath.consistency.reference_deepseek_v4 import ReferenceDeepseekV4
from onepath.consistency.slice import slice_checkpoint
from onepath.models import build_decoder
from onepath.models.checkpoint import load_config, load_state_dict, save_checkpoint
from onepath.ops import ExecutionSpec, Ops
from tests.planted import IndexerUlpInSmallLaunchesOps
from tests.tiny_deepseek_v4 import (CSA, HCA, SLIDING, onepath_model, sequences, ties_to_larger_position,
                                    transformers_logits, transformers_model)

PLANTED = "tests.planted:IndexerUlpInSmallLaunchesOps"
FULL = dict(num_hidden_layers=5, layer_types=[SLIDING, CSA, HCA, CSA, HCA], compress_rates={CSA: 3, HCA: 5},
            mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"], index_topk=2, sliding_window=6, hc_mult=3,
            max_position_embeddings=512)


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    """Layers 0..2 of a five-layer DeepSeek-V4 checkpoint (every kind of layer), as `onepath slice` writes it."""
    root = tmp_path_factory.mktemp("dsv4")
    model = onepath_model(transformers_model(FULL))
    save_checkpoint(root / "full", model.hf_state_dict(), model.config)
    report = slice_checkpoint(root / "full", root / "slice", layers=3, start=0)
    assert not report.missing_kinds, report.format()
    config = load_config(root / "slice")
    assert config.layer_types == [SLIDING, CSA, HCA] and config.mlp_layer_types == ["hash_moe", "moe", "moe"]
    return root / "slice"


@pytest.mark.slow
def test_every_gate_passes_on_a_sliced_deepseek_v4(sliced, tmp_path, capsys):
    path = tmp_path / "check.json"
    assert main([str(sliced), "--json", str(path), "--max-model-len", "128"]) == 0, capsys.readouterr().out
    report = json.loads(path.read_text())
    gates = {g["gate"]: g for g in report["gates"]}
    assert len(gates) == 11 and all(g["passed"] for g in gates.values())
    ops = gates["C0"]["evidence"]["ops"]
    assert {"hc_pre", "compress", "index_scores", "index_topk", "sparse_attention", "cache_read", "experts"} <= set(ops)
    assert gates["C7"]["evidence"]["groups"]["compressor"]["rel_err"] <= 1e-4


def test_bisect_names_a_one_ulp_indexer_change(sliced, tmp_path):
    """Whole prefill (36 queries a launch) against decode (one): the planted indexer scores one ulp higher in the
    decode launches, and bisect names index_scores of the CSA layer's indexer, one ulp, every earlier site
    equal; its repro reproduces. The same sides with the stock Ops agree everywhere: the control."""
    config, state = load_config(sliced), load_state_dict(sliced)
    probe = sequences(config.vocab_size, (36,))[0]
    for ops, planted in ((IndexerUlpInSmallLaunchesOps, True), (Ops, False)):
        model = build_decoder(config, ops(ExecutionSpec.default()), max_positions=128)
        model.load_hf_state_dict(state)
        report = bisect(Side(model), Side(model, Layout(prefill=1)), probe, tmp_path / str(planted))
        if not planted:
            assert report.first is None
            continue
        first = report.first
        assert (first.op, first.module) == ("index_scores", "model.layers.1.self_attn.compressor.indexer")
        assert first.max_ulp == 1 and first.first_position == 2  # the first query with an entry (rate 3)
        assert all(s.differing == 0 for s in report.sites[:first.site])
        assert report.reproduces and report.repro


def test_bisect_cli_and_c4_name_the_planted_indexer(sliced, capsys):
    assert bisect_main([str(sliced), "--sides", "prefill-decode", "--ops-a", PLANTED, "--ops-b", PLANTED,
                        "--length", "30", "--out", str(sliced.parent / "repro")]) == 1
    assert "FIRST DIVERGENCE: index_scores at model.layers.1.self_attn.compressor.indexer" in capsys.readouterr().out
    (c4,) = run_gates(str(sliced), ("C4",), ops_factory=IndexerUlpInSmallLaunchesOps, max_model_len=128)
    assert not c4.passed and "index_scores" in c4.detail


def test_float64_reference_matches_transformers(monkeypatch):
    """C7's yardstick is right: its logits are transformers' (FP32) within 1e-4 on a model with every layer kind."""
    ties_to_larger_position(monkeypatch)
    hf = transformers_model(FULL)
    seq = sequences(hf.config.vocab_size, (40,))[0]
    model = onepath_model(hf)
    reference = ReferenceDeepseekV4(model.config, model.hf_state_dict())
    with torch.no_grad():
        torch.testing.assert_close(reference.logits(seq).float(), transformers_logits(hf, [seq]), rtol=1e-4,
                                   atol=1e-4)
