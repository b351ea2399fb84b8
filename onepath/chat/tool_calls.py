"""The tool calls in a model's turn, in the formats chat templates teach.

hermes    Qwen / Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number per turn.
llama3    Llama 3.x: the turn is a JSON object {"name": ..., "parameters": {...}} (several joined by ';'),
          optionally after <|python_tag|>; or <|python_tag|>name.call(key="value", ...) (built-in tools).
deepseek  DeepSeek V3 / R1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
          ```json ARGS ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜> (and V3.1's NAME<｜tool▁sep｜>ARGS).

parse() never raises on what a model writes: a call it cannot read becomes an error line (what is
wrong, and the expected form) for the environment to return to the model as a tool message.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

FORMATS = ("hermes", "llama3", "deepseek")
PYTHON_TAG = "<|python_tag|>"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
EXPECTED = {
    "hermes": '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    "llama3": '{"name": <function-name>, "parameters": <args-json-object>}',
    "deepseek": f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}<function-name>\\n```json\\n<args-json-object>"
                f"\\n```{DS_CALL_END}{DS_CALLS_END}",
}


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict
    id: str

    def openai(self, arguments_as_text: bool = False) -> dict:
        """The call as an OpenAI-style message's tool_calls entry (arguments a JSON string where asked)."""
        args = json.dumps(self.arguments, ensure_ascii=False) if arguments_as_text else self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": args}}


@dataclass(slots=True)
class ParsedTurn:
    content: str                                   # the text outside the calls
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one per call that could not be read

    @property
    def has_calls(self) -> bool:
        return bool(self.calls or self.errors)


def detect_format(template_source: str) -> str | None:
    """The tool-call format a chat template teaches, from its text; None when it shows none."""
    if "<tool_call>" in template_source:
        return "hermes"
    if DS_CALL_BEGIN in template_source:
        return "deepseek"
    if PYTHON_TAG in template_source or '"parameters": ' in template_source:
        return "llama3"
    return None


def parse(text: str, fmt: str, id_prefix: str = "call") -> ParsedTurn:
    if fmt not in FORMATS:
        raise ValueError(f"tool-call format {fmt!r} is not known: use one of {', '.join(FORMATS)}")
    turn = {"hermes": parse_hermes, "llama3": parse_llama3, "deepseek": parse_deepseek}[fmt](text)
    turn.calls = [ToolCall(c.name, c.arguments, f"{id_prefix}_{i}") for i, c in enumerate(turn.calls)]
    return turn


def read_call(body: str, arguments_key: str, fmt: str) -> tuple[ToolCall | None, str | None]:
    """A call from its JSON text: (call, None) or (None, what is wrong)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"malformed tool call: not JSON ({e.msg} at character {e.pos}); write {EXPECTED[fmt]}"
    return call_from(obj, arguments_key, fmt)


def call_from(obj, arguments_key: str, fmt: str) -> tuple[ToolCall | None, str | None]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None, f"malformed tool call: no \"name\" string in {short(obj)}; write {EXPECTED[fmt]}"
    keys = (arguments_key, "arguments", "parameters")
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # arguments given as a JSON string, OpenAI's wire form
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None, f"malformed tool call to {obj['name']}: its arguments are a string that is not JSON"
    if not isinstance(args, dict):
        return None, f"malformed tool call to {obj['name']}: its arguments must be a JSON object, got {short(args)}"
    return ToolCall(obj["name"], args, ""), None


def short(value, limit: int = 80) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[:limit] + "..."


HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    turn = ParsedTurn(HERMES_CALL.sub("", text))
    for body in HERMES_CALL.findall(text):
        call, error = read_call(body.strip(), "arguments", "hermes")
        turn.calls += [call] if call else []
        turn.errors += [error] if error else []
    tail = text[text.rfind("</tool_call>") + len("</tool_call>"):] if "</tool_call>" in text else text
    if "<tool_call>" in tail:  # opened and never closed (the turn ended first)
        turn.errors.append(f"malformed tool call: <tool_call> without </tool_call>; write {EXPECTED['hermes']}")
        turn.content = turn.content[:turn.content.rfind("<tool_call>")]
    turn.content = turn.content.strip()
    return turn


def parse_llama3(text: str) -> ParsedTurn:
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    body = body.removeprefix(PYTHON_TAG).strip()
    if not tagged and not body.startswith("{"):
        return ParsedTurn(text.strip())
    turn = ParsedTurn("")
    if tagged and not body.startswith("{"):
        call, error = python_call(body)
        turn.calls += [call] if call else []
        turn.errors += [error] if error else []
        return turn
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            turn.errors.append(f"malformed tool call: not JSON ({e.msg} at character {e.pos}); write "
                               f"{EXPECTED['llama3']}")
            break
        call, error = call_from(obj, "parameters", "llama3")
        turn.calls += [call] if call else []
        turn.errors += [error] if error else []
        pos = end
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
    return turn


def python_call(body: str) -> tuple[ToolCall | None, str | None]:
    """<|python_tag|>name.call(key=literal, ...), Llama 3.1's built-in tool form."""
    expected = 'name.call(key="value", ...)'
    try:
        node = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None, f"malformed tool call after {PYTHON_TAG}: not {expected} or a JSON object"
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "call"
            and isinstance(node.func.value, ast.Name) and not node.args):
        return None, f"malformed tool call after {PYTHON_TAG}: write {expected}"
    try:
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except ValueError:
        return None, f"malformed tool call to {node.func.value.id}: arguments must be literals"
    return ToolCall(node.func.value.id, args, ""), None


def parse_deepseek(text: str) -> ParsedTurn:
    start = text.find(DS_CALLS_BEGIN)
    if start < 0 and DS_CALL_BEGIN not in text:
        return ParsedTurn(text.strip())
    start = start if start >= 0 else text.find(DS_CALL_BEGIN)
    end = text.find(DS_CALLS_END, start)
    block = text[start:end if end >= 0 else len(text)].removeprefix(DS_CALLS_BEGIN)
    turn = ParsedTurn((text[:start] + (text[end + len(DS_CALLS_END):] if end >= 0 else "")).strip())
    for piece in block.split(DS_CALL_BEGIN)[1:]:
        if DS_CALL_END not in piece or DS_SEP not in piece:
            turn.errors.append(f"malformed tool call: {DS_CALL_BEGIN} without {DS_SEP} and {DS_CALL_END}; write "
                               f"{EXPECTED['deepseek']}")
            continue
        left, right = piece[:piece.index(DS_CALL_END)].split(DS_SEP, 1)
        fenced = re.match(r"\s*([^\n`]+?)\s*\n```(?:json)?\s*\n?(.*?)\n?```\s*$", right, re.DOTALL)
        if fenced:   # V3 / R1: function<sep>NAME ```json ARGS ```
            name, args = fenced.group(1), fenced.group(2)
        else:        # V3.1: NAME<sep>ARGS
            name, args = left.strip(), right
        call, error = read_call(json.dumps({"name": name, "arguments": args.strip()}), "arguments", "deepseek")
        turn.calls += [call] if call else []
        turn.errors += [error] if error else []
    if end < 0:
        turn.errors.append(f"malformed tool call: {DS_CALLS_BEGIN} without {DS_CALLS_END}")
    return turn
