"""The HTTP front end in a process of its own (serve/frontend.py), the engine in this one: streamed tokens and
log-probs are bitwise the request's alone on a fresh engine however the streams were batched (the baseline
engine, batched, is not: negative control); a request the engine refuses fails alone; a client that goes away
frees its rows; a weight sync in FrontEnd.held() waits for the requests in flight, each answered by one weight
version; an agent's episodes, kept in the front end process, are bitwise those the trainer samples in process;
the child's death is an error here and frees its rows, and the child does not outlive this process."""
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from onepath.engine.sampling_params import SamplingParams
from onepath.serve.app import ServedModel
from onepath.serve.engine_loop import EngineLoop
from onepath.serve.episodes import AgentEpisodes
from onepath.serve.frontend import FrontEnd
from onepath.train.episodes import turn_request_id
from tests.serve.test_app import alone, bad_requests_fail_alone, prompts, sse
from tests.serve.test_engine_loop import body, new_weights, numbers, reference, same
from tests.serving import (CALCULATOR_PROMPTS, MODEL, calculator_episodes, chat_engine, get, hang_up_mid_stream, post,
                           qwen3_template, run_agent)

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def split(engine, template=None, episodes=None):
    """(URL, the FrontEnd) while a front end process serves `engine`, which runs in this process."""
    loop = EngineLoop(engine).start()
    front = FrontEnd(ServedModel(MODEL, loop, engine.tokenizer, template, episodes=episodes), "127.0.0.1", 0).start()
    try:
        yield front.url, front
    finally:
        front.stop()
        loop.stop()


def streamed(chunks: list[dict], n: int) -> list[tuple[list[int], list[float], str]]:
    """Each choice's (tokens, log-probs, text) from a completion stream's chunks."""
    out = [([], [], "") for _ in range(n)]
    for chunk in chunks:
        for c in chunk["choices"]:
            tokens, logprobs, text = out[c["index"]]
            out[c["index"]] = (tokens + c["token_ids"], logprobs + c["logprobs"]["token_logprobs"], text + c["text"])
    return out


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_streams_through_the_front_end_process_are_the_engines_bits(mode):
    engine = chat_engine(mode)
    cases = prompts(engine.model.config.vocab_size)
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 9 + i, "seed": 100 + i, "n": 2, "top_k": 40}
              for i, p in enumerate(cases)]
    out = [None] * len(bodies)

    def stream(i):
        out[i] = sse(url, bodies[i], "/v1/completions")
    with split(engine) as (url, _):
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _, whole = post(url + "/v1/completions", bodies[0])
    same_bits = []
    for b, chunks in zip(bodies, out):
        params = SamplingParams(top_k=40, max_tokens=b["max_tokens"], seed=b["seed"])
        for i, (tokens, logprobs, text) in enumerate(streamed(chunks, 2)):
            expected = alone(mode, b["prompt"], params, i)
            same_bits.append(tokens == expected[0] and torch.equal(torch.tensor(logprobs), torch.tensor(expected[1])))
            assert text == engine.tokenizer.decode(tokens) and all(c["weight_version"] == 0 for c in chunks)
    assert [c["token_ids"] for c in whole["choices"]] == [t for t, _, _ in streamed(out[0], 2)]
    if mode == "consistent":
        assert all(same_bits)
    else:  # the stock path's bits depend on the batch: the comparison sees it
        assert not all(same_bits)


def test_a_chat_stream_through_the_front_end_process_carries_what_the_response_does():
    with split(chat_engine(), qwen3_template()) as (url, _):
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 12, "seed": 4}
        _, whole = post(url + "/v1/chat/completions", chat)
        chunks = sse(url, chat, "/v1/chat/completions")
        (entry,) = get(url + "/v1/models")["data"]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    deltas = [c["choices"][0] for c in chunks[1:]]
    assert sum((d["token_ids"] for d in deltas), []) == whole["choices"][0]["token_ids"]
    assert "".join(d["delta"].get("content", "") for d in deltas) == whole["choices"][0]["message"]["content"]
    assert [e for d in deltas for e in d["logprobs"]["content"]] == whole["choices"][0]["logprobs"]["content"]
    assert entry["id"] == MODEL and entry["max_model_len"] == 256 and entry["weight_version"] == 0


def test_a_request_the_engine_refuses_fails_alone_through_the_front_end_process():
    with split(chat_engine(num_blocks=6)) as (url, _):  # 96 tokens of KV
        answers = bad_requests_fail_alone(url)
    assert answers[2][1]["error"]["param"] == "top_p"


def test_a_client_that_goes_away_frees_its_rows_in_the_engine():
    engine = chat_engine()
    with split(engine) as (url, front):
        hang_up_mid_stream(url)
        deadline = time.monotonic() + 10
        while (engine.has_unfinished() or front.streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not front.streams and not front.loop.streams and not engine.has_unfinished()
        assert engine.stats.generated_tokens < 200


def test_a_sync_in_held_waits_for_the_requests_in_flight_and_each_has_one_version():
    engine, weights = chat_engine(), new_weights()
    bodies = [body(i) for i in range(12)]
    answers = [None] * len(bodies)

    def send(i):
        answers[i] = post(url + "/v1/completions", bodies[i])[1]
    with split(engine) as (url, front):
        first = [threading.Thread(target=send, args=(i,)) for i in range(6)]
        for t in first:
            t.start()
        while not front.loop.streams:  # requests in flight
            time.sleep(0.001)
        second = [threading.Thread(target=send, args=(i,)) for i in range(6, 12)]
        for t in second:
            t.start()  # racing the sync: admitted before it or after it
        with front.held() as held:
            assert not engine.has_unfinished()
            held.update_weights(weights.items())
        for t in first + second:
            t.join()
        with front.held() as held:  # nothing in flight: the front end learns the version from held() alone
            held.update_weights(weights.items())
        (entry,) = get(url + "/v1/models")["data"]
    versions = [a["weight_version"] for a in answers]
    assert set(versions) == {0, 1} and entry["weight_version"] == 2
    for b, a, v in zip(bodies, answers, versions):
        assert same(numbers(a), reference(v, b)), (b, v)
        assert not same(numbers(a), reference(1 - v, b))  # the two versions' numbers differ here


def test_an_agent_through_the_front_end_process_gets_the_episodes_the_trainer_samples_itself():
    """The episodes live in the front end process; the trainer's side (RemoteEpisodes) opens them, gets them back
    bitwise as run_episodes samples them in process, and a sync in held() between steps moves the version."""
    toolbox, params, ids, expected = calculator_episodes()
    served = chat_engine(max_model_len=1024)
    with split(served, qwen3_template(), AgentEpisodes(MODEL, turn_request_id)) as (url, front):
        store = front.episodes
        store.open(3, 0, [(eid, {"prompt": p}) for eid, p in zip(ids, CALCULATOR_PROMPTS)], params)
        agent = threading.Thread(target=run_agent, args=(url, toolbox, 3))
        agent.start()
        got = store.wait(120)
        with front.held() as held:
            held.update_weights(new_weights().items())
        store.open(4, 1, [(7, {"prompt": CALCULATOR_PROMPTS[0]})], params)
        (later,) = store.wait(120)
        store.close()
        agent.join()
        with pytest.raises(TimeoutError, match="the agent finished 0 of 1 episodes"):
            store.open(5, 1, [(8, {"prompt": CALCULATOR_PROMPTS[0]})], params)
            store.wait(0.1)
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids and g.policy_mask == e.policy_mask and g.segments == e.segments
        assert torch.equal(torch.tensor(g.logprobs), torch.tensor(e.logprobs)) and g.weight_versions == [0] * g.turns
    assert later.weight_versions == [1] * later.turns


def test_the_front_end_process_dying_is_an_error_that_frees_its_rows():
    engine = chat_engine()
    with split(engine) as (url, front):
        out = {}
        client = threading.Thread(target=lambda: out.update(answer=post_or_error(url, {
            "model": MODEL, "prompt": "abc", "max_tokens": 200, "ignore_eos": True})))
        client.start()
        while not front.loop.streams:
            time.sleep(0.001)
        front.process.send_signal(signal.SIGKILL)
        front.wait()
        client.join()
        assert "exited with code -9" in str(front.failure) and "nothing serves the engine" in str(front.failure)
        deadline = time.monotonic() + 10
        while engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished() and not front.streams and engine.stats.generated_tokens < 200
        assert isinstance(out["answer"], OSError)  # the client's connection broke


def test_a_front_end_process_that_cannot_start_is_an_error_naming_it(monkeypatch):
    engine = chat_engine()
    loop = EngineLoop(engine)
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the child exits at once
    front = FrontEnd(ServedModel(MODEL, loop, engine.tokenizer), "127.0.0.1", 0)
    with pytest.raises(RuntimeError, match=r"the HTTP front end process for http://127.0.0.1:\d+ did not start "
                                           r"\(exit code 1\)"):
        front.start()
    served = ServedModel(MODEL, loop, engine.tokenizer, template_kwargs={"today": lambda: "Monday"})
    with pytest.raises(ValueError, match="cannot go to a front end process"):
        FrontEnd(served, "127.0.0.1", 0)


def post_or_error(url: str, b: dict):
    try:
        return post(url + "/v1/completions", b)
    except OSError as e:
        return e


def test_the_front_end_process_does_not_outlive_its_parent():
    script = ("import os, sys, time\n"
              "from tests.serving import MODEL, chat_engine\n"
              "from onepath.serve.app import ServedModel\n"
              "from onepath.serve.engine_loop import EngineLoop\n"
              "from onepath.serve.frontend import FrontEnd\n"
              "engine = chat_engine()\n"
              "front = FrontEnd(ServedModel(MODEL, EngineLoop(engine).start(), engine.tokenizer), '127.0.0.1', 0)\n"
              "print(front.start().process.pid, flush=True)\n"
              "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.kill()  # no clean-up runs: the child sees its link close
        parent.wait()
        deadline = time.monotonic() + 20
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child)
    finally:
        parent.kill()


def alive(pid: int) -> bool:
    """pid runs (a zombie waiting for its reaper has exited)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
