"""Greedy decoding (temperature 0) on the engine: each token is the largest logit (ties to the larger id)
of the model's own forward, whatever the batch, seed or request id; the trainer recomputes its reported
log-prob (temperature 1's) bit for bit in consistent mode, and the baseline trainer differs (control)."""
import torch

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.batch import ForwardBatch
from onepath.numerics.diff import is_exact, rollout_diff
from onepath.ops.sampling import greedy_tokens
from tests.tiny import random_prompts, tiny_model
from tests.train.test_trainer_consistency import engine_vs_trainer

GREEDY = [SamplingParams(temperature=0.0, max_tokens=12, seed=1), SamplingParams(temperature=0.0, max_tokens=12,
                                                                                 top_k=5, seed=2)]


def engine(mode="consistent"):
    return LLMEngine(tiny_model(mode, seed=4), num_blocks=256, block_size=16,
                     scheduler=SchedulerConfig(max_model_len=128))


def test_greedy_tokens_are_the_argmax_of_the_models_forward():
    eng = engine()
    prompts = random_prompts(torch.Generator().manual_seed(3), 6)
    outs = eng.generate(prompts, GREEDY[0])
    model = eng.model
    for o in outs:
        seq = o.prompt_token_ids + o.token_ids
        batch, num_blocks, rows = ForwardBatch.for_completions([o.prompt_token_ids], [o.token_ids], 16, model.device)
        with torch.no_grad():
            logits = model.compute_logits(model(batch, model.make_cache(num_blocks, 16))[rows])
        assert greedy_tokens(logits).tolist() == seq[len(o.prompt_token_ids):]


def test_greedy_ignores_seed_request_id_and_batch():
    prompts = random_prompts(torch.Generator().manual_seed(5), 9)
    a = engine().generate(prompts, GREEDY[0], request_ids=list(range(9)))
    b = engine().generate(prompts[4:5], SamplingParams(temperature=0.0, max_tokens=12, seed=77), request_ids=[991])
    assert (a[4].token_ids, a[4].logprobs) == (b[0].token_ids, b[0].logprobs)
    sampled = engine().generate(prompts, SamplingParams(max_tokens=12, seed=1), request_ids=list(range(9)))
    assert any(s.token_ids != g.token_ids for s, g in zip(sampled, a))   # control: sampling moves the tokens


def test_trainer_recomputes_greedy_logprobs_bit_for_bit():
    (metrics,) = engine_vs_trainer(tiny_model("consistent", seed=4), tiny_model("consistent", seed=4), False,
                                   sampling=GREEDY)
    assert metrics["rollout_corr/valid_tokens"] > 100 and is_exact(metrics), metrics


def test_negative_control_baseline_trainer_differs_on_greedy_tokens():
    (metrics,) = engine_vs_trainer(tiny_model("baseline", seed=4), tiny_model("baseline", seed=4), False,
                                   sampling=GREEDY)
    assert metrics["rollout_corr/tokens_differing_frac"] > 0, metrics


def test_greedy_logprob_is_the_untempered_distributions():
    out = engine().generate(random_prompts(torch.Generator().manual_seed(8), 1), GREEDY[0])[0]
    model = engine().model
    batch, num_blocks, rows = ForwardBatch.for_completions([out.prompt_token_ids], [out.token_ids], 16, model.device)
    with torch.no_grad():
        logits = model.compute_logits(model(batch, model.make_cache(num_blocks, 16))[rows]).double()
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), want, rtol=0, atol=1e-5)
