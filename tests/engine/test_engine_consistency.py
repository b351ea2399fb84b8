"""The engine's contract on CPU: a request's tokens and log-probs do not depend on its batch, its
position in it, chunked prefill, or preemption. Each claim runs on the baseline backend too,
which must show a difference (negative control)."""
import torch

from onepath.engine.sampling_params import SamplingParams
from tests.engine.engines import chunking_runs, engine, same
from tests.tiny import random_prompts, tiny_model

PARAMS = [SamplingParams(max_tokens=24, seed=5),
          SamplingParams(max_tokens=24, temperature=0.7, top_k=9, seed=6),
          SamplingParams(max_tokens=24, temperature=1.3, top_p=0.8, seed=7)]


def alone_vs_batches(mode: str) -> list[bool]:
    """For each trial: is the probe's output inside a batch of 2..16 other requests (random place) equal to alone?"""
    model = tiny_model(mode)
    gen = torch.Generator().manual_seed(11)
    results = []
    for trial in range(6):
        probe = random_prompts(gen, 1)[0]
        params = PARAMS[trial % len(PARAMS)]
        alone = engine(model).generate([probe], params, request_ids=[1000])[0]
        others = random_prompts(gen, int(torch.randint(2, 17, (1,), generator=gen)))
        at = int(torch.randint(0, len(others) + 1, (1,), generator=gen))
        prompts = others[:at] + [probe] + others[at:]
        ids = [2000 + i for i in range(len(prompts))]
        ids[at] = 1000
        other_params = [PARAMS[(trial + i) % len(PARAMS)] for i in range(len(prompts))]
        other_params[at] = params
        inside = engine(model, max_num_batched_tokens=int(torch.randint(64, 512, (1,), generator=gen))) \
            .generate(prompts, other_params, request_ids=ids)[at]
        assert len(alone.token_ids) > 0
        results.append(same(alone, inside))
    return results


def test_request_alone_equals_inside_random_batches():
    assert all(alone_vs_batches("consistent"))


def test_negative_control_baseline_depends_on_the_batch():
    assert not all(alone_vs_batches("baseline"))


def chunks_agree(mode: str) -> list[bool]:
    prompts = random_prompts(torch.Generator().manual_seed(5), 5, low=40, high=60)
    return chunking_runs(tiny_model(mode, seed=3), prompts, PARAMS[0], chunks=(1, 7, 64), small_cache=9)


def test_prefill_chunked_prefill_decode_and_preemption_agree():
    assert all(chunks_agree("consistent"))


def test_negative_control_baseline_depends_on_chunking():
    assert not all(chunks_agree("baseline"))


def test_bad_requests_fail_alone_and_the_others_finish():
    model = tiny_model("consistent")
    gen = torch.Generator().manual_seed(2)
    good = random_prompts(gen, 3)
    ids = [10, 11, 12]
    expected = engine(model).generate(good, PARAMS[0], request_ids=ids)
    bad = {20: [], 21: [5] * 200, 22: [4, 99, 7], 23: [4, -1]}
    prompts = [good[0], bad[20], good[1], bad[21], bad[22], good[2], bad[23]]
    out = engine(model).generate(prompts, PARAMS[0], request_ids=[10, 20, 11, 21, 22, 12, 23])
    by_id = {o.request_id: o for o in out}
    for rid, exp in zip(ids, expected):
        assert by_id[rid].error is None and same(by_id[rid], exp)
    assert "empty prompt" in by_id[20].error
    assert "200" in by_id[21].error and "max_model_len" in by_id[21].error
    assert "99" in by_id[22].error and "vocabulary" in by_id[22].error
    assert "-1" in by_id[23].error
    assert all(by_id[r].finish_reason == "error" for r in bad)


def test_logprobs_are_of_the_sampled_distribution():
    """With top-k = 1 the sampled distribution is one token: its log-prob is exactly 0."""
    model = tiny_model("consistent")
    out = engine(model).generate([[4, 5, 6]], SamplingParams(max_tokens=5, top_k=1, seed=1))[0]
    assert out.logprobs == [0.0] * len(out.token_ids)
