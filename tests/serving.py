"""A served tiny chat model for the server tests, raw HTTP calls, and the agent the external-rollout tests run:
a plain loop over the OpenAI Python client that answers tool calls with a Toolbox, as a user would write it."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from onepath.chat.template import ChatTemplate
from onepath.chat.tool_calls import ToolCall
from onepath.chat.tools import Toolbox, tool_message
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.scheduler import SchedulerConfig
from onepath.serve.app import HTTPServer, ServedModel, build_app
from onepath.serve.engine_loop import EngineLoop
from tests.chat_families import char_tokenizer, template_text
from tests.tiny import tiny_model

MODEL = "tiny-chat"


def chat_engine(mode: str = "consistent", seed: int = 0, max_model_len: int = 256, device: str = "cpu",
                **engine) -> LLMEngine:
    """A random tiny model over the qwen3 character tokenizer, its engine."""
    tok = char_tokenizer("qwen3")
    model = tiny_model(mode, seed=seed, vocab_size=tok.get_vocab_size(), eos_token_id=tok.token_to_id("<|im_end|>"),
                       max_positions=max_model_len, device=device)
    config = SchedulerConfig(max_num_seqs=engine.pop("max_num_seqs", 16), max_num_batched_tokens=512,
                             max_model_len=max_model_len)
    return LLMEngine(model, num_blocks=engine.pop("num_blocks", 256), scheduler=config, tokenizer=tok, **engine)


def qwen3_template() -> ChatTemplate:
    return ChatTemplate({"default": template_text("qwen3")}, "qwen3.jinja")


@contextmanager
def serving(engine: LLMEngine, template: ChatTemplate | None = None, episodes=None, **served):
    """(server URL, the served model) while a server over `engine` runs."""
    loop = EngineLoop(engine).start()
    model = ServedModel(MODEL, loop, engine.tokenizer, template, episodes=episodes, **served)
    server = HTTPServer(build_app(model), "127.0.0.1", 0).start()
    try:
        yield server.url, model
    finally:
        server.stop()
        loop.stop()


def post(url: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a POST."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str, retry_s: float = 0.0) -> dict:
    """GET url's JSON; a refused connection is tried again for retry_s seconds (a server still coming up)."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                return json.loads(r.read())
        except urllib.error.URLError as e:
            if not isinstance(e.reason, ConnectionRefusedError) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def run_episode(client, model: str, prompt: list[dict], toolbox: Toolbox, max_turns: int) -> list[dict]:
    """One tool episode as ToolEnv runs it: every call answered by the toolbox, a call the server could not
    read answered with its error, a turn without calls the last; the conversation."""
    import openai
    messages = list(prompt)
    for turn in range(max_turns):
        try:
            response = client.chat.completions.create(model=model, messages=messages, tools=toolbox.schemas)
        except openai.BadRequestError:  # the conversation outgrew max_model_len
            break
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        errors = (message.model_extra or {}).get("tool_call_errors", [])
        if not message.tool_calls and not errors or turn == max_turns - 1:
            break
        messages += [toolbox.call(ToolCall(c.function.name, json.loads(c.function.arguments), c.id))
                     for c in message.tool_calls or []]
        messages += [tool_message(None, f"error: {e}") for e in errors]
    return messages


def run_agent(url: str, toolbox: Toolbox, max_turns: int, reward=None, timeout_s: float = 600) -> int:
    """Run every episode the trainer opens until it is done; the episodes run. reward(messages): a reward to
    post with each (None: the trainer's reward function scores the final answer)."""
    from openai import OpenAI
    done, start = 0, time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            listing = get(f"{url}/onepath/rollout", retry_s=0 if done else 10)
        except urllib.error.URLError as e:
            # The server runs for the whole run: refused once it answered, it has stopped, and the trainer
            # may stop it between the agent's polls of the last step (then "done" was never seen). The caller
            # joins the trainer and checks its result and the count returned here.
            if done and isinstance(e.reason, ConnectionRefusedError):
                return done
            raise
        if listing["status"] == "done":
            return done
        todo = [e for e in listing["episodes"] if not e["finished"]]
        if not todo:
            time.sleep(0.02)
            continue

        def episode(task):
            client = OpenAI(base_url=url + task["base_url"], api_key="none", max_retries=0)
            messages = run_episode(client, listing["model"], task["prompt"], toolbox, max_turns)
            body = {} if reward is None else {"reward": reward(messages)}
            status, answer = post(f"{url}/episodes/{task['id']}/finish", body)
            assert status == 200, answer
        with ThreadPoolExecutor(8) as pool:  # episodes run side by side, their requests batched by the engine
            list(pool.map(episode, todo))
        done += len(todo)
    raise TimeoutError(f"the trainer did not finish in {timeout_s} s")


CALCULATOR_PROMPTS = [[{"role": "system", "content": "Use the calculator."},
                       {"role": "user", "content": f"What is {i}*{i + 3}?"}] for i in range(6)]


def calculator_episodes(max_model_len: int = 1024):
    """(toolbox, params, episode ids, the episodes run_episodes samples in process) for CALCULATOR_PROMPTS, 3 turns
    at most: what an agent over HTTP must get back, bit for bit."""
    from onepath.chat.encoder import ChatEncoder
    from onepath.chat.tools import calculator
    from onepath.engine.sampling_params import SamplingParams
    from onepath.train.episodes import run_episodes
    from onepath.train.tool_env import ToolEnv
    toolbox = Toolbox([calculator])
    engine = chat_engine(max_model_len=max_model_len)
    chat = ChatEncoder(qwen3_template(), engine.tokenizer, tools=toolbox.schemas, stop_token_ids=engine.eos_token_ids)
    params = SamplingParams(max_tokens=24, seed=0, stop_token_ids=(chat.end_of_turn_id,))
    ids = [3_000_000 + i for i in range(len(CALCULATOR_PROMPTS))]
    expected = run_episodes(engine, [chat.prompt_ids(m) for m in CALCULATOR_PROMPTS], ToolEnv(chat, toolbox, "hermes"),
                            params, 3, episode_ids=ids, conversations=CALCULATOR_PROMPTS)
    assert any(e.turns > 1 for e in expected)  # the case has multi-turn episodes
    return toolbox, params, ids, expected


def hang_up_mid_stream(url: str, max_tokens: int = 200) -> None:
    """A streaming completion over a raw socket, closed once tokens flow (a client that goes away)."""
    import socket
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    seen = b""
    while b"token_ids" not in seen:  # tokens are streaming
        seen += sock.recv(4096)
    sock.close()

