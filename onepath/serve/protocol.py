"""The OpenAI request bodies onepath serves, read and checked: a bad field is a RequestError (HTTP 4xx) that
names it, what it holds and what to give instead, as OpenAI's `error.param` does. What onepath does not
do is refused by name rather than ignored (docs/serve.md lists it).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from starlette.responses import JSONResponse

ROLES = ("system", "developer", "user", "assistant", "tool")
# fields OpenAI clients send that change nothing here
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options")
SAMPLING = ("temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "n", "seed", "stop",
            "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
            "stream", "model", "logit_bias")
CHAT_FIELDS = SAMPLING + ("messages", "tools", "tool_choice", "chat_template_kwargs", "response_format")
COMPLETION_FIELDS = SAMPLING + ("prompt", "echo", "suffix", "best_of")
MAX_N = 64


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


@dataclass
class Sampling:
    """The sampling fields of a request, checked (the server turns them into SamplingParams)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]
    sampling: Sampling
    tools: list[dict] | None = None
    tool_choice: str = "auto"
    template_kwargs: dict = field(default_factory=dict)


@dataclass
class CompletionRequest:
    model: str
    prompt: str | list[int]
    sampling: Sampling


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" ({e.msg} at character {e.pos})" if isinstance(e, json.JSONDecodeError) else ""
        raise RequestError(f"the request body is not JSON{where}: send a JSON object") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body is a JSON {type(body).__name__}, not an object: send "
                           "{\"model\": ..., ...}")
    return body


def chat_request(body: dict) -> ChatRequest:
    known(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages {short(messages)} must be a non-empty list of {{\"role\", \"content\"}} "
                           "objects", "messages")
    messages = [message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError(f"tools {short(tools)} must be a list of {{\"type\": \"function\", \"function\": "
                               "{...}} objects", "tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)
                    and isinstance(fn.get("name"), str) and fn["name"]):
                raise RequestError(f"tools[{i}] {short(tool)} must be {{\"type\": \"function\", \"function\": "
                                   "{\"name\": ..., \"parameters\": {...}}}", f"tools[{i}]")
        tools = tools or None
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none") and choice is not None:
        raise RequestError(f"tool_choice {short(choice)} is not supported: onepath lets the model choose (\"auto\", "
                           "the default) or parses no calls (\"none\"); forcing a call needs constrained decoding, "
                           "which it does not do", "tool_choice")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise RequestError(f"chat_template_kwargs {short(kwargs)} must map template variable names to values, e.g. "
                           "{\"enable_thinking\": false}", "chat_template_kwargs")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise RequestError(f"response_format {short(fmt)} is not supported: onepath does not constrain the output "
                           "(JSON mode, schemas); leave it out", "response_format")
    return ChatRequest(model_name(body), messages, sampling(body, chat=True), tools, choice or "auto", kwargs)


def completion_request(body: dict) -> CompletionRequest:
    known(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ok = (isinstance(prompt, str) and prompt) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))
    if not ok:
        what = "several prompts" if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) \
            else short(prompt)
        raise RequestError(f"prompt {what} must be one non-empty string or one list of token ids (send a request "
                           "per prompt)", "prompt")
    if body.get("echo"):
        raise RequestError("echo is not supported: the prompt's tokens come back as prompt_token_ids", "echo")
    if body.get("suffix") is not None:
        raise RequestError("suffix is not supported: onepath does not insert text", "suffix")
    s = sampling(body, chat=False)
    if body.get("best_of") not in (None, s.n):
        raise RequestError(f"best_of {short(body['best_of'])} is not supported: ask for n samples and rank them "
                           "yourself with the log-probs returned", "best_of")
    return CompletionRequest(model_name(body), prompt, s)


def known(body: dict, names: tuple[str, ...]) -> None:
    unknown = [k for k in body if k not in names and k not in IGNORED]
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}: onepath reads {', '.join(sorted(names))}", unknown[0])


def model_name(body: dict) -> str:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise RequestError(f"model {short(name)} must be the served model's name (GET /v1/models lists it)", "model")
    return name


def sampling(body: dict, chat: bool) -> Sampling:
    s = Sampling()
    s.temperature = number(body, "temperature", lo=0.0, rule="a finite number >= 0 (0 decodes greedily)")
    s.top_p = number(body, "top_p", lo=0.0, hi=1.0, open_lo=True, rule="in (0, 1] (1 turns it off)")
    top_k = integer(body, "top_k", lo=-1, rule="an integer >= 1, or 0 or -1 to turn it off")
    s.top_k = None if top_k is None else max(top_k, 0)
    for key in ("max_completion_tokens", "max_tokens"):
        value = integer(body, key, lo=1, rule="an integer >= 1")
        s.max_tokens = value if value is not None else s.max_tokens
    s.n = integer(body, "n", lo=1, hi=MAX_N, rule=f"an integer in [1, {MAX_N}]") or 1
    s.seed = integer(body, "seed", rule="an integer")
    stop = body.get("stop")
    if stop not in (None, [], ""):
        raise RequestError(f"stop {short(stop)} is not supported: stop strings would cut a token in two; give "
                           "stop_token_ids (token ids) instead", "stop")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise RequestError(f"stop_token_ids {short(ids)} must be a list of token ids (integers >= 0)", "stop_token_ids")
    s.stop_token_ids = tuple(ids)
    s.ignore_eos = flag(body, "ignore_eos")
    s.stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and isinstance(options.get("include_usage", False), bool)):
        raise RequestError(f"stream_options {short(options)} must be {{\"include_usage\": true | false}}",
                           "stream_options")
    s.include_usage = bool(options and options.get("include_usage"))
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise RequestError(f"{key} {short(body[key])} is not supported: a penalty changes the distribution the "
                               "log-probs are reported under; leave it out or give 0", key)
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported: it changes the distribution the log-probs are reported "
                           "under; leave it out", "logit_bias")
    if chat:
        if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
            raise RequestError(f"logprobs {short(body['logprobs'])} must be true or false (the sampled tokens' "
                               "log-probs come back either way)", "logprobs")
        top = "top_logprobs"
    else:
        top = "logprobs"
    alternatives = integer(body, top, lo=0, rule="an integer >= 0")
    if alternatives:
        raise RequestError(f"{top} {alternatives} is not supported: onepath returns the sampled token's log-prob "
                           f"only; leave it out or give 0", top)
    return s


def number(body, key, lo=None, hi=None, open_lo=False, rule="") -> float | None:
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (lo is None or (value > lo if open_lo else value >= lo)) and (hi is None or value <= hi)
    if not ok:
        raise RequestError(f"{key} {short(value)} must be {rule}", key)
    return float(value)


def integer(body, key, lo=None, hi=None, rule="") -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"{key} {short(value)} must be {rule}", key)
    return value


def flag(body, key) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{key} {short(value)} must be true or false", key)
    return value


def message(m, where: str) -> dict:
    """A message as the chat template reads it: text content (parts joined), tool-call arguments as objects."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        role = m.get("role") if isinstance(m, dict) else None
        raise RequestError(f"{where} has role {short(role)}: give one of {', '.join(ROLES)}", f"{where}.role")
    out = {k: v for k, v in m.items() if v is not None}
    out["role"] = "system" if m["role"] == "developer" else m["role"]
    out["content"] = text_content(m.get("content"), where, m["role"] == "assistant" and bool(m.get("tool_calls")))
    if m.get("tool_calls"):
        if m["role"] != "assistant" or not isinstance(m["tool_calls"], list):
            raise RequestError(f"{where}.tool_calls: only an assistant message holds tool_calls, as a list",
                               f"{where}.tool_calls")
        out["tool_calls"] = [tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(m["tool_calls"])]
    return out


def text_content(content, where: str, may_be_empty: bool) -> str:
    if content is None and may_be_empty:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(f"{where}.content[{i}] {short(part)}: onepath reads text parts only "
                                   "({\"type\": \"text\", \"text\": ...})", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.content {short(content)} must be a string or a list of text parts",
                       f"{where}.content")


def tool_call(c, where: str) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"{where} {short(c)} must be {{\"id\", \"type\": \"function\", \"function\": "
                           "{\"name\", \"arguments\"}}", where)
    args = fn.get("arguments", {})
    if isinstance(args, str):  # the wire form: a JSON string; templates print an object
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise RequestError(f"{where}.function.arguments {short(args)} is not JSON", where) from None
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if c.get("id") is not None:
        out["id"] = c["id"]
    return out


def short(value, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
