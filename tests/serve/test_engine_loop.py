"""Weight versions: a weight sync through EngineLoop.held() waits for the requests in flight, so a request racing
it is computed by one version, the one its response names: its numbers are bitwise those of that version's
weights on a fresh engine. After the sync nothing computed before it is read: a sync that kept the prefix cache
(the control) serves numbers of neither version, and so does a request whose weights change mid-way."""
import threading
import time

import torch

from onepath.engine.sampling_params import SamplingParams
from tests.serving import MODEL, chat_engine, post, serving

SHARED = list(range(10, 50))  # 2.5 KV blocks every prompt starts with: later requests hit the prefix cache


def prompt(i: int) -> list[int]:
    return SHARED + [60 + i, 61 + i, 62][:1 + i % 3]


def body(i: int) -> dict:
    return {"model": MODEL, "prompt": prompt(i), "max_tokens": 12 + i % 5, "seed": 40 + i}


def reference(weights_seed: int, b: dict) -> tuple[list[int], list[float]]:
    """The request alone on a fresh engine holding the weights of `weights_seed`."""
    engine = chat_engine(seed=weights_seed)
    out = engine.generate([b["prompt"]], SamplingParams(max_tokens=b["max_tokens"], seed=b["seed"]), [0])[0]
    return out.token_ids, out.logprobs


def numbers(answer: dict) -> tuple[list[int], list[float]]:
    choice = answer["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def same(a, b) -> bool:
    return a[0] == b[0] and torch.equal(torch.tensor(a[1]), torch.tensor(b[1]))


def new_weights() -> dict:
    return {name: p.detach().clone() for name, p in chat_engine(seed=1).model.named_parameters()}


def test_a_request_racing_a_sync_is_computed_by_one_weight_version():
    engine, weights = chat_engine(), new_weights()
    bodies = [body(i) for i in range(12)]
    answers = [None] * len(bodies)

    def send(i):
        answers[i] = post(url + "/v1/completions", bodies[i])[1]
    with serving(engine) as (url, served):
        first = [threading.Thread(target=send, args=(i,)) for i in range(6)]
        for t in first:
            t.start()
        while not served.loop.streams:  # requests in flight
            time.sleep(0.001)
        second = [threading.Thread(target=send, args=(i,)) for i in range(6, 12)]
        for t in second:
            t.start()  # racing the sync: admitted before it or after it
        with served.loop.held() as held:
            held.update_weights(weights.items())
        for t in first + second:
            t.join()
    versions = [a["weight_version"] for a in answers]
    assert set(versions) == {0, 1} and engine.weight_version == 1
    for b, a, v in zip(bodies, answers, versions):
        assert same(numbers(a), reference(v, b)), (b, v)
        assert not same(numbers(a), reference(1 - v, b))  # the two versions' numbers differ here


def test_no_request_after_a_sync_reads_the_prefix_cache_from_before():
    engine, weights = chat_engine(), new_weights()
    b = body(0)
    with serving(engine) as (url, served):
        assert post(url + "/v1/completions", b)[1]["weight_version"] == 0  # its prefix is cached now
        with served.loop.held() as held:  # the control: weights copied, the cache and the version kept
            params = dict(held.model.named_parameters())
            with torch.no_grad():
                for name, tensor in weights.items():
                    params[name].copy_(tensor)
        hits = engine.block_manager.num_cached_tokens_hit
        stale = post(url + "/v1/completions", b)[1]
        assert engine.block_manager.num_cached_tokens_hit - hits == 32  # two blocks of K/V from the old weights
        with served.loop.held() as held:  # the sync: the prefix cache dropped, the version moves
            held.update_weights(weights.items())
        fresh = post(url + "/v1/completions", b)[1]
    assert fresh["weight_version"] == 1 and same(numbers(fresh), reference(1, b))
    assert stale["weight_version"] == 0 and not same(numbers(stale), reference(1, b)) \
        and not same(numbers(stale), reference(0, b))


def test_a_request_whose_weights_change_midway_matches_neither_version():
    """What held() rules out, done by hand: the numbers are a mix the comparison above would catch."""
    engine, weights = chat_engine(), new_weights()
    b = body(3)
    engine.add_request(b["prompt"], SamplingParams(max_tokens=b["max_tokens"], seed=b["seed"]), 0)
    engine.step()
    engine.step()
    params = dict(engine.model.named_parameters())
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    while engine.has_unfinished():
        for seq in engine.step():
            mixed = seq.completion_token_ids, seq.logprobs
    assert not same(mixed, reference(0, b)) and not same(mixed, reference(1, b))
