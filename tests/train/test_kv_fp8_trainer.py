"""With an FP8 KV cache (quant="fp8_kv") the trainer's private cache is written and read through the
engine's quantise/dequantise path: its log-probs equal the engine's bit for bit, before and after an
update + in-place sync, and the straight-through backward trains. Negative control, the "naive"
setting: the engine quantises its KV cache, the trainer does not; that shows a diff."""
import torch

from onepath.consistency.diff import is_exact, rollout_diff
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.train.actor import Actor, Responses
from onepath.train.grpo import policy_loss
from tests.engine.test_kv_fp8 import fp8_model
from tests.tiny import random_prompts

PARAMS = [SamplingParams(max_tokens=16, seed=1), SamplingParams(max_tokens=16, temperature=0.8, top_k=7, seed=2),
          SamplingParams(max_tokens=16, temperature=1.2, top_p=0.85, seed=3)]


def rollout_and_recompute(trainer_quant: str | None, update: bool, sampling=PARAMS):
    engine_model, policy = fp8_model(seed=4), fp8_model(trainer_quant, seed=4)
    engine = LLMEngine(engine_model, num_blocks=128, block_size=16, scheduler=SchedulerConfig(max_model_len=128))
    actor = Actor(policy, block_size=16, lr=1e-2)
    gen = torch.Generator().manual_seed(9)
    diffs = []
    for step in range(2 if update else 1):
        prompts = random_prompts(gen, 8)
        params = [sampling[i % len(sampling)] for i in range(len(prompts))]
        outs = engine.generate(prompts, params, request_ids=[step * 100 + i for i in range(len(prompts))])
        r = Responses.build([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], params,
                            [o.logprobs for o in outs])
        lp, _ = actor.logprobs(r)
        diffs.append(rollout_diff(r.rollout_logprobs, lp.detach(), r.mask))
        if update:
            loss, _ = policy_loss(lp, lp.detach(), torch.randn(len(outs), generator=gen), r.mask, 0.2)
            before = {n: p.detach().clone() for n, p in policy.named_parameters()}
            actor.update(loss)
            assert any(not torch.equal(p, before[n]) for n, p in policy.named_parameters())
            engine.update_weights(policy.named_parameters())
    return diffs


def test_trainer_equals_engine_before_and_after_an_update():
    before, after = rollout_and_recompute("fp8_kv", update=True)
    assert before["rollout_corr/valid_tokens"] > 50
    assert is_exact(before) and is_exact(after), (before, after)


def test_negative_control_naive_trainer_without_kv_quantisation_differs():
    # no top-k / top-p: the naive trainer's own top-k set could leave out a sampled token
    (metrics,) = rollout_and_recompute(None, update=False, sampling=PARAMS[:1])
    assert metrics["rollout_corr/tokens_differing_frac"] > 0
