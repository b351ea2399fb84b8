"""The OpenAI-compatible HTTP API over an EngineLoop (Starlette, served by uvicorn in a thread of the engine's
process, HTTPServer, or in a process of its own, serve/frontend.py).

    GET  /v1/models              the served model, its max_model_len and weight version
    POST /v1/completions         a prompt (text or token ids) -> samples
    POST /v1/chat/completions    messages (+ tools) rendered by the chat template -> assistant turns, tool calls
    .../episodes/{id}/v1/...     the same, continuing one token-in-token-out episode (serve/episodes.py)

Every response carries the token ids (prompt_token_ids, and token_ids per choice, as vLLM's
return_token_ids gives them), the sampled tokens' log-probs in OpenAI's logprobs fields, and
weight_version: the engine's weights that computed every token of it. A request that is wrong gets a 4xx
naming the field (serve/protocol.py) before it reaches the engine; one the engine refuses fails alone.
docs/serve.md.
"""
from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from tokenizers import Tokenizer

from onepath.chat.encoder import ChatEncoder
from onepath.chat.template import ChatTemplate, ChatTemplateError
from onepath.chat.tool_calls import detect_format, parse
from onepath.engine.sampling_params import SamplingParams
from onepath.serve.engine_loop import Delta, EngineLoop, Stream
from onepath.serve.protocol import (ChatRequest, CompletionRequest, RequestError, Sampling, chat_request,
                                    completion_request, error_response, parse_json)
from onepath.serve.text import IncrementalText, TokenStrings, streamable_content

SEED_RANGE = 1 << 62


@dataclass
class ServedModel:
    """What the handlers serve: the engine loop (in a front end process, serve/frontend.EngineClient, which takes
    the same calls), its tokenizer and chat template, and the defaults."""
    name: str
    loop: EngineLoop
    tokenizer: Tokenizer
    template: ChatTemplate | None = None
    template_kwargs: dict = field(default_factory=dict)
    tool_format: str = "auto"      # auto: the format the template teaches
    max_tokens: int | None = None  # a request's default; None fills the context
    seed: int = 0                  # seeds the seeds of requests that give none
    episodes: object | None = None  # serve.episodes.AgentEpisodes while `onepath train` serves an agent
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.strings = TokenStrings(self.tokenizer)
        self.rng = random.Random(self.seed)
        self.encoders: dict[str, ChatEncoder] = {}

    @property
    def max_model_len(self) -> int:
        return self.loop.max_model_len

    def encoder(self, tools: list[dict] | None, kwargs: dict) -> ChatEncoder:
        if self.template is None:
            raise RequestError(f"model {self.name} has no chat template: use /v1/completions, or start the server "
                               "with --data.chat_template PATH", "messages")
        key = json.dumps([tools, {**self.template_kwargs, **kwargs}], sort_keys=True)
        if key not in self.encoders:
            try:
                self.encoders[key] = ChatEncoder(self.template, self.tokenizer, tools=tools,
                                                 stop_token_ids=self.loop.eos_token_ids,
                                                 **{**self.template_kwargs, **kwargs})
            except ChatTemplateError as e:
                raise RequestError(str(e), "messages") from None
            if len(self.encoders) > 256:
                self.encoders.pop(next(iter(self.encoders)))
        return self.encoders[key]

    def tool_format_for(self, tools: list[dict] | None) -> str | None:
        if not tools:
            return None
        if self.tool_format != "auto":
            return self.tool_format
        fmt = detect_format(self.template.source_for(tools))
        if fmt is None:
            raise RequestError(f"tools: the chat template {self.template.source} shows no tool-call format, so the "
                               "calls cannot be read back; start the server with --rollout.tool_format hermes | "
                               "llama3 | deepseek", "tools")
        return fmt

    def params(self, s: Sampling, prompt_len: int, stop: tuple[int, ...], fixed: SamplingParams | None,
               param: str) -> SamplingParams:
        """SamplingParams of a request; `fixed`: the trainer's, which an episode's request may not change."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise RequestError(f"the prompt is {prompt_len} tokens, the server's max_model_len is {self.max_model_len}: "
                               "shorten the conversation", param)
        if s.max_tokens is not None and s.max_tokens > room:
            raise RequestError(f"max_tokens {s.max_tokens} + the prompt's {prompt_len} tokens > max_model_len "
                               f"{self.max_model_len}: ask for {room} or fewer", "max_tokens")
        default = fixed.max_tokens if fixed is not None else self.max_tokens
        max_tokens = s.max_tokens or min(default or room, room)
        if fixed is not None:
            for key in ("temperature", "top_p", "top_k", "seed"):
                value = getattr(s, key)
                if value is not None and value != getattr(fixed, key):
                    raise RequestError(f"{key} {value}: the trainer samples this episode with {key} "
                                       f"{getattr(fixed, key)}, and trains on those log-probs; leave {key} out",
                                       key)
            stop = tuple(dict.fromkeys((*fixed.stop_token_ids, *stop, *s.stop_token_ids)))
            return SamplingParams(fixed.temperature, fixed.top_k, fixed.top_p, max_tokens, stop, s.ignore_eos,
                                  fixed.seed)
        seed = s.seed if s.seed is not None else self.rng.randrange(SEED_RANGE)
        try:
            return SamplingParams(1.0 if s.temperature is None else s.temperature, s.top_k or 0,
                                  1.0 if s.top_p is None else s.top_p, max_tokens,
                                  tuple(dict.fromkeys((*stop, *s.stop_token_ids))), s.ignore_eos, seed)
        except ValueError as e:
            raise RequestError(str(e)) from None


def handler(fn):
    async def wrapped(request: Request):
        try:
            return await fn(request)
        except RequestError as e:
            return error_response(e)
    return wrapped


def build_app(served: ServedModel) -> Starlette:
    s = served

    @handler
    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": s.name, "object": "model", "created": s.created, "owned_by": "onepath",
             "max_model_len": s.max_model_len, "weight_version": s.loop.weight_version}]})

    @handler
    async def completions(request: Request):
        req = completion_request(parse_json(await request.body()))
        check_model(s, req.model)
        if request.path_params.get("episode") is not None:
            raise RequestError("an episode continues a chat: use chat/completions under /episodes/{id}/v1")
        ids = prompt_ids(s, req)
        params = s.params(req.sampling, len(ids), (), None, "prompt")
        streams = s.loop.submit([(ids, params, i) for i in range(req.sampling.n)])
        rid = f"cmpl-{id(streams[0]):x}"
        decoders = [IncrementalText(s.tokenizer, True) for _ in streams]
        if req.sampling.stream:
            return sse(completion_chunks(s, req, rid, ids, streams, decoders), s.loop, streams)
        results = await collect(s.loop, streams)
        fail_on_error(results)
        choices = []
        for i, (tokens, logprobs, reason, _) in enumerate(results):
            text = s.tokenizer.decode(tokens)
            choices.append({"index": i, "text": text, "finish_reason": reason, "prompt_token_ids": ids,
                            "token_ids": tokens, "logprobs": completion_logprobs(s, tokens, logprobs)})
        return JSONResponse(envelope(s, rid, "text_completion", results[0][3], choices,
                                     usage(len(ids), results)))

    @handler
    async def chat(request: Request):
        req = chat_request(parse_json(await request.body()))
        check_model(s, req.model)
        encoder = s.encoder(req.tools, req.template_kwargs)
        fmt = s.tool_format_for(req.tools) if req.tool_choice == "auto" else None
        key = request.path_params.get("episode")
        episode = s.episodes.begin(key, req, encoder) if key is not None else None
        try:
            if episode is not None:
                ids, fixed, sample_ids = episode.prompt_ids, episode.params, [episode.sample_id]
                if req.sampling.n != 1:
                    raise RequestError(f"n {req.sampling.n}: an episode is one conversation, give n 1", "n")
            else:
                try:
                    ids = encoder.prompt_ids(req.messages)
                except ChatTemplateError as e:
                    raise RequestError(str(e), "messages") from None
                fixed, sample_ids = None, list(range(req.sampling.n))
            params = s.params(req.sampling, len(ids), encoder.stop_ids, fixed, "messages")
        except RequestError:
            if episode is not None:
                s.episodes.release(episode)
            raise
        streams = s.loop.submit([(ids, params, i) for i in sample_ids])
        rid = f"chatcmpl-{id(streams[0]):x}"
        call_prefix = episode.call_prefix if episode is not None else f"call_{id(streams[0]):x}"
        if req.sampling.stream:
            return sse(chat_chunks(s, req, rid, ids, streams, encoder, fmt, call_prefix, episode), s.loop, streams,
                       episode)
        try:
            results = await collect(s.loop, streams)
            fail_on_error(results)
        except BaseException:
            if episode is not None:
                s.episodes.release(episode)
            raise
        choices = []
        for i, (tokens, logprobs, reason, _) in enumerate(results):
            text = encoder.turn_text(tokens)
            message, reason = assistant_message(text, fmt, reason, call_prefix)
            choices.append({"index": i, "message": message, "finish_reason": reason, "token_ids": tokens,
                            "logprobs": {"content": [s.strings.entry(t, lp) for t, lp in zip(tokens, logprobs)]}})
        if episode is not None:
            tokens, logprobs, reason, version = results[0]
            s.episodes.record(episode, tokens, logprobs, reason, version, encoder.turn_text(tokens),
                              choices[0]["message"])
        body = envelope(s, rid, "chat.completion", results[0][3], choices, usage(len(ids), results))
        body["prompt_token_ids"] = ids
        return JSONResponse(body)

    routes = [Route("/v1/models", models, methods=["GET"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"])]
    if s.episodes is not None:
        routes += [Route("/episodes/{episode}" + r.path, r.endpoint, methods=r.methods) for r in list(routes)]
        routes += s.episodes.routes()
    return Starlette(routes=routes, exception_handlers={
        404: lambda request, exc: error_response(RequestError(f"{request.url.path} is not served: the endpoints are "
                                                              "/v1/models, /v1/completions, /v1/chat/completions",
                                                              status=404)),
        405: lambda request, exc: error_response(RequestError(f"{request.method} {request.url.path} is not served "
                                                              "(POST a completion, GET the models)", status=405))})


def check_model(s: ServedModel, name: str) -> None:
    if name != s.name:
        raise RequestError(f"model {name!r} is not served here: this server serves {s.name!r}", "model", 404,
                           "model_not_found")


def prompt_ids(s: ServedModel, req: CompletionRequest) -> list[int]:
    if isinstance(req.prompt, str):
        return s.tokenizer.encode(req.prompt).ids
    vocab = s.loop.vocab_size
    bad = [t for t in req.prompt if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"prompt holds token id {bad[0]}, outside the vocabulary [0, {vocab})", "prompt")
    return list(req.prompt)


def envelope(s: ServedModel, rid: str, kind: str, version: int, choices: list[dict], use: dict | None) -> dict:
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": s.name, "weight_version": version,
            "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def usage(prompt_len: int, results) -> dict:
    completion = sum(len(r[0]) for r in results)
    prompts = prompt_len * len(results)
    return {"prompt_tokens": prompts, "completion_tokens": completion, "total_tokens": prompts + completion}


def completion_logprobs(s: ServedModel, tokens: list[int], logprobs: list[float], offset: int = 0) -> dict:
    texts = [s.strings.text(t) for t in tokens]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def assistant_message(text: str, fmt: str | None, reason: str, call_prefix: str) -> tuple[dict, str]:
    """(the assistant message, finish_reason): the calls parsed out of the turn where tools are on; a call that
    cannot be read leaves the turn's whole text as content and says why in tool_call_errors (onepath's field)."""
    if fmt is None:
        return {"role": "assistant", "content": text}, reason
    turn = parse(text, fmt, id_prefix=call_prefix)
    message = {"role": "assistant", "content": (text.strip() if turn.errors else turn.content) or None}
    if turn.calls:
        message["tool_calls"] = [c.openai(arguments_as_text=True) for c in turn.calls]
        reason = "tool_calls" if reason == "stop" else reason
    if turn.errors:
        message["tool_call_errors"] = turn.errors
    return message, reason


async def collect(loop: EngineLoop, streams: list[Stream]) -> list[tuple[list[int], list[float], str, int]]:
    """Each request's (tokens, log-probs, finish_reason, weight version); an error leaves its reason "error"
    and the message in place of the log-probs."""
    out = []
    try:
        for stream in streams:
            tokens, logprobs = [], []
            while True:
                delta: Delta = await stream.queue.get()
                tokens += delta.token_ids
                logprobs += delta.logprobs
                if delta.finish_reason is not None:
                    out.append((tokens, delta.error if delta.error else logprobs, delta.finish_reason,
                                delta.weight_version))
                    break
    except asyncio.CancelledError:
        loop.abort(streams)
        raise
    return out


def fail_on_error(results) -> None:
    for tokens, logprobs, reason, _ in results:
        if reason == "error":
            raise RequestError(f"the engine refused the request: {logprobs}")


def sse(chunks, loop: EngineLoop, streams: list[Stream], episode=None) -> StreamingResponse:
    async def body():
        done = False
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            done = True
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away, or the stream failed: free the batch's rows
                loop.abort(streams)
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def merged(streams: list[Stream]):
    """(choice index, Delta) as they come, from every stream, until each has finished. The deltas that wait in
    a stream's queue go out as one: a client that reads slower than the engine steps gets fewer, larger chunks."""
    if len(streams) == 1:
        queue = streams[0].queue
        while True:
            delta = joined(await queue.get(), queue)
            yield 0, delta
            if delta.finish_reason is not None:
                return
    out: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        while True:
            delta = joined(await stream.queue.get(), stream.queue)
            await out.put((i, delta))
            if delta.finish_reason is not None:
                return
    tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, delta = await out.get()
            left -= delta.finish_reason is not None
            yield i, delta
    finally:
        for task in tasks:
            task.cancel()


def joined(delta: Delta, queue: asyncio.Queue) -> Delta:
    """delta and the deltas after it already in the queue, as one."""
    while delta.finish_reason is None and not queue.empty():
        more = queue.get_nowait()
        delta = Delta(delta.token_ids + more.token_ids, delta.logprobs + more.logprobs, more.finish_reason,
                      more.error, more.weight_version)
    return delta


async def completion_chunks(s: ServedModel, req: CompletionRequest, rid: str, ids: list[int], streams, decoders):
    created, total, version = int(time.time()), [0] * len(streams), s.loop.weight_version
    head = {"id": rid, "object": "text_completion", "created": created, "model": s.name}
    offsets = [0] * len(streams)
    async for i, delta in merged(streams):
        if delta.error:
            yield {"error": RequestError(f"the engine refused the request: {delta.error}").body()["error"]}
            return
        version = delta.weight_version
        text = decoders[i].add(delta.token_ids)
        if delta.finish_reason is not None:  # the full decode, where a piece still waited for its bytes
            full = s.tokenizer.decode(decoders[i].ids)
            text += full[len(decoders[i].text):] if full.startswith(decoders[i].text) else ""
        total[i] += len(delta.token_ids)
        choice = {"index": i, "text": text, "finish_reason": delta.finish_reason, "token_ids": delta.token_ids,
                  "logprobs": completion_logprobs(s, delta.token_ids, delta.logprobs, offsets[i])}
        offsets[i] += sum(len(s.strings.text(t)) for t in delta.token_ids)
        if total[i] == len(delta.token_ids):
            choice["prompt_token_ids"] = ids
        yield {**head, "weight_version": version, "choices": [choice]}
    if req.sampling.include_usage:
        use = {"prompt_tokens": len(ids) * len(streams), "completion_tokens": sum(total),
               "total_tokens": len(ids) * len(streams) + sum(total)}
        yield {**head, "weight_version": version, "choices": [], "usage": use}


async def chat_chunks(s: ServedModel, req: ChatRequest, rid: str, ids: list[int], streams, encoder: ChatEncoder,
                      fmt: str | None, call_prefix: str, episode):
    created, version = int(time.time()), s.loop.weight_version
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": s.name}
    decoders = [IncrementalText(s.tokenizer, False, encoder.stop_ids) for _ in streams]
    shown = [""] * len(streams)
    tokens = [[] for _ in streams]
    logprobs = [[] for _ in streams]
    recorded = False
    try:
        for i in range(len(streams)):
            yield {**head, "weight_version": version, "prompt_token_ids": ids,
                   "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]}
        async for i, delta in merged(streams):
            if delta.error:
                yield {"error": RequestError(f"the engine refused the request: {delta.error}").body()["error"]}
                return
            version = delta.weight_version
            tokens[i] += delta.token_ids
            logprobs[i] += delta.logprobs
            decoders[i].add(delta.token_ids)
            out: dict = {}
            reason = None
            if delta.finish_reason is None:
                content = decoders[i].text if fmt is None else streamable_content(decoders[i].text, fmt)
            else:
                text = encoder.turn_text(tokens[i])
                message, reason = assistant_message(text, fmt, delta.finish_reason, call_prefix)
                content = message["content"] or ""
                if "tool_calls" in message:
                    out["tool_calls"] = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
                if "tool_call_errors" in message:
                    out["tool_call_errors"] = message["tool_call_errors"]
                if episode is not None:
                    s.episodes.record(episode, tokens[i], logprobs[i], delta.finish_reason, version, text, message)
                    recorded = True
            if content.startswith(shown[i]) and len(content) > len(shown[i]):
                out["content"] = content[len(shown[i]):]
                shown[i] = content
            entries = [s.strings.entry(t, lp) for t, lp in zip(delta.token_ids, delta.logprobs)]
            yield {**head, "weight_version": version, "choices": [
                {"index": i, "delta": out, "logprobs": {"content": entries}, "token_ids": delta.token_ids,
                 "finish_reason": reason}]}
        if req.sampling.include_usage:
            total = sum(map(len, tokens))
            yield {**head, "weight_version": version, "choices": [], "usage": {
                "prompt_tokens": len(ids) * len(streams), "completion_tokens": total,
                "total_tokens": len(ids) * len(streams) + total}}
    finally:
        if episode is not None and not recorded:
            s.episodes.release(episode)


class HTTPServer:
    """uvicorn serving an app from a background thread of this process, on a socket bound before it starts (port 0:
    a free port, read back from .port). serve/frontend.FrontEnd serves it from a process of its own instead."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 8000):
        self.sock = listen(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn_server(app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="onepath-http")

    @property
    def url(self) -> str:
        return url_of(self.host, self.port)

    def start(self) -> HTTPServer:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the HTTP server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.sock.close()


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: a free port), for a server to start on."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}): pick another port (0: any free one)") \
            from None
    return sock


def uvicorn_server(app):
    import uvicorn
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                         timeout_graceful_shutdown=1))


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
