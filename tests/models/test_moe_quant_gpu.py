"""Quantised experts on the GPU (block-FP8 W8A8, NVFP4 W4A16, NVFP4 W4A4), the Qwen3-MoE-shaped model of
tests/models/test_moe_gpu.py with every linear quantised by the preset: the experts run as grouped launches
on their stacked quantised weights, read the group sizes on the device and so decode in CUDA graphs. Per
preset: a request alone vs inside batches; masked vs contiguous layout vs each pair alone; an expert layer
captured once replays other routings with the eager bits; decode replayed from graphs equals eager decode;
trainer == engine (graphs on) before and after in-place updates. Baseline negative controls on the same
procedures.

    python -m pytest -q -m gpu tests/models/test_moe_quant_gpu.py
"""
import pytest
import torch

from onepath.numerics.diff import is_exact
from tests.engine import test_cuda_graphs_gpu as graphs
from tests.engine import test_engine_gpu as dense
from tests.models import test_moe_gpu as moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PRESETS = ("fp8", "nvfp4_w4a16", "nvfp4_w4a4")


BUILD = moe.moe_model  # the unpatched builder: tests below patch moe.moe_model with a quantised one


def quantised(preset):
    return lambda mode, seed=0: BUILD(mode, seed, quant=preset)


@pytest.mark.parametrize("preset", PRESETS)
def test_quantised_moe_is_capturable(preset):
    assert all(quantised(preset)(mode).capturable for mode in ("consistent", "baseline"))


@pytest.mark.parametrize("preset", PRESETS)
def test_alone_equals_batch(monkeypatch, preset):
    monkeypatch.setattr(dense, "model", quantised(preset))
    assert all(dense.alone_vs_batches("consistent"))


def test_negative_control_alone_vs_batch_baseline(monkeypatch):
    monkeypatch.setattr(dense, "model", quantised("fp8"))
    assert not all(dense.alone_vs_batches("baseline"))


def pair_rows(mode, preset):
    """Per token count: (masked == contiguous, contiguous == each token alone)."""
    block = quantised(preset)(mode).model.layers[0].mlp
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    with torch.no_grad():
        for tokens in (1, 7, 33, 300):
            x = torch.randn(tokens, moe.SHAPE["hidden_size"], generator=g, device="cuda").bfloat16()
            _, experts = block.gate(x)
            contiguous = block.experts(x, experts, "contiguous")
            alone = torch.cat([block.experts(x[i:i + 1], experts[i:i + 1], "contiguous") for i in range(tokens)])
            results.append((torch.equal(block.experts(x, experts, "masked"), contiguous), torch.equal(alone, contiguous)))
    return results


@pytest.mark.parametrize("preset", PRESETS)
def test_masked_contiguous_and_alone(preset):
    # the negative control is the model-level one (baseline alone != batch): on the H100, torch._grouped_mm's
    # rows at these shapes did not move with the row count (2026-12-06), as cuBLAS's did not on the H200
    assert all(masked and alone for masked, alone in pair_rows("consistent", preset))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("tokens,layout", [(7, "masked"), (200, "contiguous")])
def test_captured_quantised_experts_replay_any_routing(monkeypatch, preset, tokens, layout):
    monkeypatch.setattr(moe, "moe_model", lambda mode, seed=0, quant=None: quantised(preset)(mode, seed))
    results = moe.replayed_experts("consistent", tokens, layout)
    assert all(torch.equal(graph, eager) and torch.equal(graph, contiguous) for graph, eager, contiguous, _ in results)
    assert not any(torch.equal(graph, stale) for graph, _, _, stale in results[1:])  # control: sizes baked in


@pytest.mark.parametrize("preset", PRESETS)
def test_graph_equals_eager(monkeypatch, preset):
    monkeypatch.setattr(graphs, "model", quantised(preset))
    assert all(graphs.graph_vs_eager("consistent"))


def test_negative_control_graph_vs_eager_baseline(monkeypatch):
    monkeypatch.setattr(graphs, "model", quantised("fp8"))
    assert not all(graphs.graph_vs_eager("baseline"))


@pytest.mark.parametrize("preset", PRESETS)
def test_trainer_equals_engine_with_cuda_graphs(monkeypatch, preset):
    monkeypatch.setattr(dense, "model", quantised(preset))
    diffs = moe.trainer_diffs_with_graphs(monkeypatch, "consistent")
    assert all(is_exact(d) for d in diffs), diffs


def test_negative_control_trainer_with_cuda_graphs_baseline(monkeypatch):
    monkeypatch.setattr(dense, "model", quantised("fp8"))
    diffs = moe.trainer_diffs_with_graphs(monkeypatch, "baseline")
    assert any(d["rollout_corr/tokens_differing_frac"] > 0 for d in diffs)
