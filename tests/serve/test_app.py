"""The OpenAI API over the engine (`onepath serve`): every response carries the engine's own token ids and
log-probs, bitwise what the request gets alone on a fresh engine however the server batched it (the baseline
engine, batched, does not: negative control); streamed = not streamed; chat prompts are the template's
rendering with the tools; temperature 0 is greedy; a bad request gets a 4xx naming its field and fails
alone while the others finish."""
import json
import threading
import time
import urllib.request

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from onepath.chat.encoder import ChatEncoder
from onepath.chat.tools import Toolbox, calculator
from onepath.engine.sampling_params import SamplingParams
from onepath.serve.app import assistant_message
from onepath.serve.text import IncrementalText, streamable_content
from tests.chat_families import FAMILIES
from tests.chat_families import tokenizer as bpe_tokenizer
from tests.serving import MODEL, chat_engine, get, hang_up_mid_stream, post, qwen3_template, serving

PROMPT_LENGTHS = (1, 5, 17, 33, 48)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, vocab - 9, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def alone(mode: str, prompt: list[int], params: SamplingParams, sample_id: int):
    """(tokens, log-probs) of one request on a fresh engine of its own."""
    engine = chat_engine(mode)
    engine.add_request(prompt, params, 0, sample_id)
    while engine.has_unfinished():
        for seq in engine.step():
            return seq.completion_token_ids, seq.logprobs


def concurrently(url: str, bodies: list[dict], path: str = "/v1/completions") -> list[tuple[int, dict]]:
    out = [None] * len(bodies)

    def send(i):
        out[i] = post(url + path, bodies[i])
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def sse(url: str, body: dict, path: str) -> list[dict]:
    request = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        events = [line[len(b"data: "):].decode() for line in r.read().split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_batched_requests_get_the_tokens_and_logprobs_they_get_alone(mode):
    engine = chat_engine(mode)
    cases = prompts(engine.model.config.vocab_size)
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 9 + i, "seed": 100 + i, "n": 2, "top_k": 40}
              for i, p in enumerate(cases)]
    with serving(engine) as (url, _):
        answers = concurrently(url, bodies)
    same = []
    for body, (status, answer) in zip(bodies, answers):
        assert status == 200, answer
        params = SamplingParams(top_k=40, max_tokens=body["max_tokens"], seed=body["seed"],
                                stop_token_ids=(), ignore_eos=False)
        for i, choice in enumerate(answer["choices"]):
            assert choice["prompt_token_ids"] == body["prompt"] and answer["weight_version"] == 0
            tokens, logprobs = alone(mode, body["prompt"], params, i)
            same.append(choice["token_ids"] == tokens and
                        torch.equal(torch.tensor(choice["logprobs"]["token_logprobs"]), torch.tensor(logprobs)))
    if mode == "consistent":
        assert all(same)
    else:  # the stock path's bits depend on the batch: the comparison sees it
        assert not all(same)


def test_a_stream_carries_what_the_response_does():
    engine = chat_engine()
    with serving(engine, qwen3_template()) as (url, _):
        body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 12, "seed": 3, "n": 2}
        _, whole = post(url + "/v1/completions", body)
        chunks = sse(url, {**body, "stream_options": {"include_usage": True}}, "/v1/completions")
        for i, choice in enumerate(whole["choices"]):
            mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
            assert sum((c["token_ids"] for c in mine), []) == choice["token_ids"]
            assert sum((c["logprobs"]["token_logprobs"] for c in mine), []) == choice["logprobs"]["token_logprobs"]
            assert "".join(c["text"] for c in mine) == choice["text"]
            assert mine[0]["prompt_token_ids"] == choice["prompt_token_ids"]
            assert mine[-1]["finish_reason"] == choice["finish_reason"]
        assert chunks[-1]["usage"] == whole["usage"]

        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 12, "seed": 4}
        _, whole = post(url + "/v1/chat/completions", chat)
        chunks = sse(url, chat, "/v1/chat/completions")
        assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        deltas = [c["choices"][0] for c in chunks[1:]]
        assert sum((d["token_ids"] for d in deltas), []) == whole["choices"][0]["token_ids"]
        assert "".join(d["delta"].get("content", "") for d in deltas) == whole["choices"][0]["message"]["content"]
        assert [e for d in deltas for e in d["logprobs"]["content"]] == whole["choices"][0]["logprobs"]["content"]
        assert all(c["weight_version"] == 0 for c in chunks)


def test_chat_prompts_are_the_templates_rendering_with_the_tools():
    engine = chat_engine(max_model_len=1024)
    toolbox = Toolbox([calculator])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6*7?"}]
    encoder = ChatEncoder(qwen3_template(), engine.tokenizer, tools=toolbox.schemas,
                          stop_token_ids=engine.eos_token_ids)
    with serving(engine, qwen3_template()) as (url, _):
        status, body = post(url + "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4,
                                                           "tools": toolbox.schemas})
    assert status == 200 and body["prompt_token_ids"] == encoder.prompt_ids(messages)
    assert "<tool_call>" in engine.tokenizer.decode(body["prompt_token_ids"], skip_special_tokens=False)


def test_tool_calls_come_back_parsed_and_streamed_content_is_a_prefix_of_the_message():
    text = 'Let me add.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    message, reason = assistant_message(text, "hermes", "stop", "call_0")
    assert reason == "tool_calls" and message["content"] == "Let me add."
    assert message["tool_calls"] == [{"id": "call_0_0", "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression": "6*7"}'}}]
    for end in range(len(text) + 1):  # what a stream shows is never taken back
        assert message["content"].startswith(streamable_content(text[:end], "hermes"))
    broken, reason = assistant_message("<tool_call>{not json</tool_call>", "hermes", "stop", "call_1")
    assert reason == "stop" and "tool_calls" not in broken and "not JSON" in broken["tool_call_errors"][0]
    assert broken["content"] == "<tool_call>{not json</tool_call>"
    assert assistant_message(text, None, "stop", "c")[0] == {"role": "assistant", "content": text}
    assert streamable_content('  {"name": "f"', "llama3") == "" and streamable_content("Sure.", "llama3") == "Sure."


@pytest.mark.parametrize("family", ["qwen3", "llama3", "deepseek_v3", "wordpiece"])
def test_incremental_text_is_the_whole_decode(family):
    """Byte-level BPE families (multi-byte characters cut across tokens) and a WordPiece decoder (its first word
    has no space before it), special tokens kept or skipped, a skipped id, deltas of 1, 3 and 7 tokens."""
    if family == "wordpiece":
        tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(600)}, unk_token="w0"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix="##")
        head = tok.encode("w5 w17 w0 w599").ids
    else:
        tok = bpe_tokenizer(family)
        head = tok.encode("Ünïcödé → 6 * 7 = 42 ✓ {\"a\": 1} 天气").ids
    g = torch.Generator().manual_seed(2)
    special = tok.get_vocab_size() - 1 if family == "wordpiece" else tok.token_to_id(FAMILIES[family]["special"][1])
    ids = head + torch.randint(0, 500, (40,), generator=g).tolist() + [special] + head[:5]
    for skip_special in (False, True):
        for skip in ((), (head[1],)):
            kept = [t for t in ids if t not in skip]
            full = tok.decode(kept, skip_special_tokens=skip_special)
            for step in (1, 3, 7):
                text = IncrementalText(tok, skip_special, skip)
                pieces = "".join(text.add(ids[i:i + step]) for i in range(0, len(ids), step))
                assert text.ids == kept and text.text == pieces
                assert full.startswith(pieces) and full.rstrip("\ufffd") == pieces.rstrip("\ufffd"), \
                    (family, skip_special, skip, step)
            # control: each token decoded alone and joined is not the whole decode (cut characters, lost spaces)
            assert "".join(tok.decode([t], skip_special_tokens=skip_special) for t in kept) != full


def test_temperature_zero_is_greedy():
    with serving(chat_engine()) as (url, _):
        answers = [post(url + "/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 8, "temperature": 0,
                                                  "seed": seed})[1]["choices"][0] for seed in (1, 2)]
        sampled = [post(url + "/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 8,
                                                  "seed": seed})[1]["choices"][0] for seed in (1, 2)]
    assert answers[0]["token_ids"] == answers[1]["token_ids"]
    assert sampled[0]["token_ids"] != sampled[1]["token_ids"]  # control: sampling follows the seed


def test_models_lists_the_served_model_and_its_weight_version():
    with serving(chat_engine()) as (url, _):
        (entry,) = get(url + "/v1/models")["data"]
    assert entry["id"] == MODEL and entry["max_model_len"] == 256 and entry["weight_version"] == 0


BAD = [
    (b"{not json", None, 400, "not JSON"),
    (b"[1, 2]", None, 400, "not an object"),
    ({"model": "gpt-4", "prompt": "x"}, "model", 404, "is not served here"),
    ({"model": MODEL, "prompt": "x" * 300}, "prompt", 400, "max_model_len is 256"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 400}, "max_tokens", 400, "ask for 255 or fewer"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature", 400, "finite number >= 0"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p", 400, "in (0, 1]"),
    ({"model": MODEL, "prompt": "x", "top_k": 2.5}, "top_k", 400, "an integer"),
    ({"model": MODEL, "prompt": "x", "n": 0}, "n", 400, "in [1, 64]"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens", 400, ">= 1"),
    ({"model": MODEL, "prompt": "x", "stop": ["\n"]}, "stop", 400, "stop_token_ids"),
    ({"model": MODEL, "prompt": "x", "logprobs": 5}, "logprobs", 400, "sampled token's log-prob only"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty", 400, "not supported"),
    ({"model": MODEL, "prompt": [1, 99999]}, "prompt", 400, "outside the vocabulary"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt", 400, "one non-empty string"),
    ({"model": MODEL, "prompt": "x", "temprature": 0.5}, "temprature", 400, "unknown field"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, "stream", 400, "true or false"),
]
BAD_CHAT = [
    ({"model": MODEL, "messages": []}, "messages", 400, "non-empty list"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", 400, "give one of"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", 400,
     "text parts only"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice", 400,
     "constrained decoding"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs", 400,
     "not supported"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]",
     400, "must be"),
]


@pytest.mark.parametrize("body, param, status, message", BAD + [(b, p, s, m) for b, p, s, m in BAD_CHAT])
def test_a_bad_request_gets_a_4xx_naming_the_field(body, param, status, message, served_url):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    got, answer = post(served_url + path, None, body) if isinstance(body, bytes) else post(served_url + path, body)
    assert got == status and answer["error"]["param"] == param and message in answer["error"]["message"], answer


@pytest.fixture(scope="module")
def served_url():
    with serving(chat_engine(), qwen3_template()) as (url, _):
        yield url


def bad_requests_fail_alone(url: str) -> list:
    """Two good requests beside one the engine refuses (more KV than its 96 tokens) and one bad top_p, at once:
    the bad two fail with 400, the good two get what the good request gets alone; the answers."""
    good = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 40, "seed": 9}
    _, expected = post(url + "/v1/completions", good)
    answers = concurrently(url, [good, {**good, "max_tokens": 200}, {**good, "top_p": 7}, good])
    assert [status for status, _ in answers] == [200, 400, 400, 200]
    assert "the engine refused the request" in answers[1][1]["error"]["message"]
    for _, answer in (answers[0], answers[3]):
        assert answer["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
    return answers


def test_a_bad_request_fails_alone():
    with serving(chat_engine(num_blocks=6)) as (url, _):  # 96 tokens of KV
        bad_requests_fail_alone(url)


def test_a_client_that_goes_away_frees_its_rows():
    with serving(chat_engine()) as (url, served):
        hang_up_mid_stream(url)
        deadline = time.monotonic() + 10
        while served.loop.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not served.loop.streams and not served.loop.engine.has_unfinished()
        assert served.loop.engine.stats.generated_tokens < 200
