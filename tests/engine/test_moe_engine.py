"""The engine's contract on CPU holds for the MoE model: tests/engine/test_engine_consistency.py's
procedures (a request alone vs inside random batches; prefill vs chunked prefill, decode and
preemption), each with its baseline negative control, run on a tiny Qwen3-MoE. Decode steps and
small prefills route through the masked expert layout, large prefills through the contiguous one."""
import pytest
import torch

from onepath.models import moe
from tests.engine import test_engine_consistency as dense
from tests.tiny import random_prompts, tiny_moe_model


@pytest.fixture(autouse=True)
def moe_model(monkeypatch):
    monkeypatch.setattr(dense, "tiny_model", tiny_moe_model)


def test_request_alone_equals_inside_random_batches():
    assert all(dense.alone_vs_batches("consistent"))


def test_negative_control_baseline_depends_on_the_batch():
    assert not all(dense.alone_vs_batches("baseline"))


def test_prefill_chunked_prefill_decode_and_preemption_agree():
    assert all(dense.chunks_agree("consistent"))


def test_negative_control_baseline_depends_on_chunking():
    assert not all(dense.chunks_agree("baseline"))


def test_a_generation_runs_both_expert_layouts(monkeypatch):
    calls = {"masked": 0, "contiguous": 0}

    def counted(layout, fn):
        def wrapper(*args, **kwargs):
            calls[layout] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(moe, "experts_masked", counted("masked", moe.experts_masked))
    monkeypatch.setattr(moe, "experts_contiguous", counted("contiguous", moe.experts_contiguous))
    prompts = random_prompts(torch.Generator().manual_seed(1), 4, low=30, high=40)
    dense.engine(tiny_moe_model("consistent")).generate(prompts, dense.PARAMS[0])
    assert calls["masked"] > 0 and calls["contiguous"] > 0, calls


def test_moe_decode_is_not_captured_and_asking_for_graphs_is_a_clear_error():
    from onepath.engine.llm_engine import LLMEngine
    from onepath.engine.scheduler import SchedulerConfig
    model, scheduler = tiny_moe_model("consistent"), SchedulerConfig(max_model_len=128)
    assert not model.capturable
    with pytest.raises(ValueError, match="MoeDecoder cannot be captured in a CUDA graph"):
        LLMEngine(model, num_blocks=16, scheduler=scheduler, cuda_graphs=True)
    assert LLMEngine(model, num_blocks=16, scheduler=scheduler).runner.graphs is None
