"""Quantised linear layers on both sides: the trainer recomputes the engine's log-probs bit for bit under
"fp8", "nvfp4_w4a16" and "nvfp4_w4a4", before and after an update + in-place sync (the engine caches its
quantised weights, the trainer re-quantises at each forward: a stale engine cache would show). Negative control, the "naive" setting: engine quantised, trainer in
the unquantised spec, same weights and tokens: a diff."""
import pytest
import torch

from onepath.consistency.diff import is_exact, rollout_diff
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.dense import DenseDecoder
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from onepath.train.actor import Actor, Responses
from onepath.train.grpo import policy_loss
from tests.tiny import random_prompts, tiny_config

PARAMS = [SamplingParams(max_tokens=12, seed=1), SamplingParams(max_tokens=12, temperature=0.8, top_k=7, seed=2)]


def quant_model(quant: str | None, seed: int = 4) -> DenseDecoder:
    """tests.tiny's model (hidden 48, intermediate 136: K is never a multiple of 128) under a quant preset."""
    model = DenseDecoder(tiny_config(), Ops(ExecutionSpec.default("consistent", "cpu", quant=quant)), max_positions=256)
    model.init_weights(seed, std=0.15)
    return model


def rollout_and_recompute(engine_quant: str, trainer_quant: str | None, update: bool, sampling=PARAMS):
    engine_model, policy = quant_model(engine_quant), quant_model(trainer_quant)
    for p in policy.parameters():
        p.quant_cache = False  # the trainer re-quantises at every forward; the engine's cache must follow the sync
    engine = LLMEngine(engine_model, num_blocks=128, block_size=16, scheduler=SchedulerConfig(max_model_len=96))
    actor = Actor(policy, block_size=16, lr=1e-2)
    gen = torch.Generator().manual_seed(9)
    diffs = []
    for step in range(2 if update else 1):
        prompts = random_prompts(gen, 6)
        params = [sampling[i % len(sampling)] for i in range(len(prompts))]
        outs = engine.generate(prompts, params, request_ids=[step * 100 + i for i in range(len(prompts))])
        r = Responses.build([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], params,
                            [o.logprobs for o in outs])
        lp, _ = actor.logprobs(r)
        diffs.append(rollout_diff(r.rollout_logprobs, lp.detach(), r.mask))
        if update:
            loss, _ = policy_loss(lp, lp.detach(), torch.randn(len(outs), generator=gen), r.mask, 0.2)
            actor.update(loss)
            engine.update_weights(policy.named_parameters())
    return diffs


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
