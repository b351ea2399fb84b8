"""The engine and trainer contract on the GPU (BF16): alone vs batch, chunked prefill and preemption,
trainer == engine before and after an update and in-place sync; baseline (cuBLAS, SDPA) must differ."""
import pytest
import torch

from onepath.numerics.diff import is_exact, rollout_diff
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.train.actor import Actor, Responses
from onepath.train.grpo import policy_loss
from tests.tiny import random_prompts, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, vocab_size=1000)
PARAMS = [SamplingParams(max_tokens=40, seed=5), SamplingParams(max_tokens=40, temperature=0.7, top_k=50, seed=6),
          SamplingParams(max_tokens=40, temperature=1.1, top_p=0.9, seed=7)]


def model(mode, seed=0):
    return tiny_model(mode, seed=seed, std=0.05, device="cuda", max_positions=1024, **SHAPE)


def engine(m, **scheduler):
    return LLMEngine(m, num_blocks=scheduler.pop("num_blocks", 512), block_size=16,
                     scheduler=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=4096, **scheduler))


def same(a, b):
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs


def alone_vs_batches(mode):
    m = model(mode)
    gen = torch.Generator().manual_seed(3)
    results = []
    for trial in range(4):
        probe = random_prompts(gen, 1, high=300)[0]
        alone = engine(m).generate([probe], PARAMS[trial % 3], request_ids=[7])[0]
        others = random_prompts(gen, int(torch.randint(2, 17, (1,), generator=gen)), high=300)
        at = int(torch.randint(0, len(others) + 1, (1,), generator=gen))
        prompts = others[:at] + [probe] + others[at:]
        ids = [100 + i for i in range(len(prompts))]
        ids[at] = 7
        params = [PARAMS[(trial + i) % 3] for i in range(len(prompts))]
        params[at] = PARAMS[trial % 3]
        results.append(same(alone, engine(m).generate(prompts, params, request_ids=ids)[at]))
    return results


def test_alone_equals_batch_on_gpu():
    assert all(alone_vs_batches("consistent"))


def test_negative_control_baseline_on_gpu():
    assert not all(alone_vs_batches("baseline"))


def chunking(mode):
    m = model(mode, seed=1)
    gen = torch.Generator().manual_seed(4)
    prompts = random_prompts(gen, 6, low=100, high=200)
    ids = list(range(6))
    ref = engine(m).generate(prompts, PARAMS[0], request_ids=ids)
    outs = [engine(m, prefill_chunk_size=c).generate(prompts, PARAMS[0], request_ids=ids) for c in (1, 7, 64, 1000)]
    small = engine(m, num_blocks=40)
    outs.append(small.generate(prompts, PARAMS[0], request_ids=ids))
    assert small.scheduler.num_preemptions > 0
    return [all(same(a, b) for a, b in zip(ref, o)) for o in outs]


def test_chunked_prefill_and_preemption_on_gpu():
    assert all(chunking("consistent"))


def test_negative_control_chunking_baseline_on_gpu():
    assert not all(chunking("baseline"))


def trainer_diffs(mode):
    e_model, policy = model(mode, seed=2), model(mode, seed=2)
    eng = engine(e_model)
    actor = Actor(policy, block_size=16, lr=1e-4)
    gen = torch.Generator().manual_seed(5)
    diffs = []
    for step in range(2):
        prompts = random_prompts(gen, 16, high=200)
        params = [PARAMS[i % 3] for i in range(16)]
        outs = eng.generate(prompts, params, request_ids=[step * 100 + i for i in range(16)])
        r = Responses.build([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], params,
                            [o.logprobs for o in outs])
        lp, _ = actor.logprobs(r)
        mask = r.mask.cuda()
        diffs.append(rollout_diff(r.rollout_logprobs.cuda(), lp.detach(), mask))
        loss, _ = policy_loss(lp, lp.detach(), torch.randn(16, generator=gen).cuda(), mask, 0.2)
        actor.update(loss)
        eng.update_weights(policy.named_parameters())
    return diffs


@pytest.mark.gpu_smoke
def test_trainer_equals_engine_before_and_after_update_on_gpu():
    diffs = trainer_diffs("consistent")
    assert all(is_exact(d) for d in diffs), diffs


@pytest.mark.gpu_smoke
def test_negative_control_trainer_baseline_on_gpu():
    diffs = trainer_diffs("baseline")
    assert any(d["rollout_corr/tokens_differing_frac"] > 0 for d in diffs)


def test_topk_ties_and_sampling_on_gpu():
    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops import Ops
    ops = Ops(ExecutionSpec.default("consistent", "cuda"))
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -0.0, 0.0]], device="cuda").repeat(5, 1)
    values, idx = ops.topk(x, 3)
    assert idx.tolist() == [[4, 2, 1]] * 5 and values.tolist() == [[3.0, 3.0, 3.0]] * 5
    probs = torch.softmax(torch.randn(64, 1000, device="cuda", generator=torch.Generator("cuda").manual_seed(0)), -1)
    keys = list(range(1000, 1064))
    alone = torch.cat([ops.sample(probs[i:i + 1], keys[i:i + 1]) for i in range(64)])
    assert torch.equal(alone, ops.sample(probs, keys))
    cpu = Ops(ExecutionSpec.default("consistent", "cpu")).sample(probs.cpu().double().float(), keys)
    # the keyed noise is integer arithmetic: the same draws on both devices for the same probabilities
    assert (cpu == alone.cpu()).float().mean() > 0.95
