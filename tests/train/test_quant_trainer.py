"""Quantised linear layers on both sides: the trainer recomputes the engine's log-probs bit for bit under
"fp8", "nvfp4_w4a16" and "nvfp4_w4a4", before and after an update + in-place sync (the engine caches its
quantised weights, the trainer re-quantises at each forward: a stale engine cache would show). Negative control, the "naive" setting: engine quantised, trainer in
the unquantised spec, same weights and tokens: a diff."""
import pytest

from onepath.numerics.diff import is_exact
from onepath.engine.sampling_params import SamplingParams
from onepath.models.dense import DenseDecoder
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from tests.tiny import tiny_config
from tests.train.test_trainer_consistency import engine_vs_trainer

PARAMS = [SamplingParams(max_tokens=12, seed=1), SamplingParams(max_tokens=12, temperature=0.8, top_k=7, seed=2)]


def quant_model(quant: str | None, seed: int = 4) -> DenseDecoder:
    """tests.tiny's model (hidden 48, intermediate 136: K is never a multiple of 128) under a quant preset."""
    model = DenseDecoder(tiny_config(), Ops(ExecutionSpec.default("consistent", "cpu", quant=quant)), max_positions=256)
    model.init_weights(seed, std=0.15)
    return model


def rollout_and_recompute(engine_quant: str, trainer_quant: str | None, update: bool, sampling=PARAMS):
    policy = quant_model(trainer_quant)
    for p in policy.parameters():
        p.quant_cache = False  # the trainer re-quantises at every forward; the engine's cache must follow the sync
    return engine_vs_trainer(quant_model(engine_quant), policy, update, sampling, prompts=6, num_blocks=128,
                             max_model_len=96)


@pytest.mark.parametrize("quant", ["fp8", "nvfp4_w4a16", "nvfp4_w4a4"])
def test_quantised_engine_and_trainer_agree_before_and_after_sync(quant):
    before, after = rollout_and_recompute(quant, quant, update=True)
    assert before["rollout_corr/valid_tokens"] > 30
    assert is_exact(before) and is_exact(after), (before, after)


@pytest.mark.parametrize("quant", ["fp8", "nvfp4_w4a4"])
def test_naive_trainer_without_quantisation_differs(quant):
    # plain sampling: a consistent trainer refuses a token outside the top-k set its own logits give
    (metrics,) = rollout_and_recompute(quant, None, update=False, sampling=PARAMS[:1])
    assert metrics["rollout_corr/tokens_differing_frac"] > 0
