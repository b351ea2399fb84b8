"""The low-precision contract on the GPU: under each quant preset (block-FP8 W8A8, NVFP4 W4A16 and W4A4,
FP8 weights + FP8 KV cache) the procedures of tests/engine/test_engine_gpu.py hold with the Triton kernels
and CUDA-graph decode: a request alone == inside batches, chunked prefill (1, 7, 64, 1000) and
preemption == whole prefill, and the trainer (re-quantising its BF16 master weights at each forward)
== the engine before and after an update with in-place sync. Negative control, the "naive" setting:
the same engine, a trainer in plain BF16: a diff on the same tokens."""
import pytest
import torch

from onepath.numerics.diff import is_exact, rollout_diff
from onepath.engine.sampling_params import SamplingParams
from onepath.train.actor import Actor, Responses
from tests.engine import test_engine_gpu as dense
from tests.tiny import random_prompts, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PRESETS = ["fp8", "nvfp4_w4a16", "nvfp4_w4a4", "fp8+fp8_kv"]


def quantised(quant, trainer_quant=None):
    """dense.model under `quant` (the engine) and, for the trainer side, `trainer_quant`."""
    def model(mode, seed=0, side="engine"):
        q = quant if side == "engine" else trainer_quant
        m = tiny_model(mode, seed=seed, std=0.05, device="cuda", max_positions=1024, quant=q, **dense.SHAPE)
        for p in m.parameters():
            p.quant_cache = side == "engine"  # the trainer re-quantises at every forward
        return m
    return model


@pytest.mark.parametrize("quant", PRESETS)
def test_alone_equals_batch_quant_gpu(quant, monkeypatch):
    monkeypatch.setattr(dense, "model", quantised(quant))
    assert all(dense.alone_vs_batches("consistent"))


@pytest.mark.parametrize("quant", PRESETS)
def test_chunked_prefill_and_preemption_quant_gpu(quant, monkeypatch):
    monkeypatch.setattr(dense, "model", quantised(quant))
    assert all(dense.chunking("consistent"))


@pytest.mark.parametrize("quant", PRESETS)
def test_trainer_equals_engine_quant_gpu(quant, monkeypatch):
    build = quantised(quant, trainer_quant=quant)
    sides = iter(["engine", "trainer"])
    monkeypatch.setattr(dense, "model", lambda mode, seed=0: build(mode, seed, next(sides)))
    diffs = dense.trainer_diffs("consistent")
    assert all(d["rollout_corr/valid_tokens"] > 100 for d in diffs)
    assert all(is_exact(d) for d in diffs), diffs


@pytest.mark.parametrize("quant", ["fp8", "nvfp4_w4a4", "fp8+fp8_kv"])
def test_naive_trainer_differs_quant_gpu(quant):
    engine_model = quantised(quant)("consistent", seed=2)
    trainer_model = quantised(quant, trainer_quant=None)("consistent", seed=2, side="trainer")
    prompts = random_prompts(torch.Generator().manual_seed(8), 16, high=200)
    plain = SamplingParams(max_tokens=40, seed=5)  # no top-k / top-p: the naive trainer keeps every token
    outs = dense.engine(engine_model).generate(prompts, plain, request_ids=list(range(16)))
    r = Responses.build([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], [plain] * 16,
                        [o.logprobs for o in outs])
    with torch.no_grad():
        lp, _ = Actor(trainer_model, block_size=16, lr=0.0).logprobs(r)
    assert rollout_diff(r.rollout_logprobs.cuda(), lp, r.mask.cuda())["rollout_corr/tokens_differing_frac"] > 0
