"""Tool calls read from a model's turn in the Hermes / Qwen, Llama-3 and DeepSeek formats, checked on the
text the family's own template renders for the calls; malformed calls, unknown tools, bad arguments and a
tool's exception become tool messages ("error: ..."), never an exception."""
import json

import pytest

from onepath.chat.template import ChatTemplate, special_tokens
from onepath.chat.tool_calls import ToolCall, detect_format, parse
from onepath.chat.tools import Toolbox, calculator, load_toolbox
from tests.chat_families import template_text, tokenizer_config


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divide.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def rendered_turn(family: str, calls: list[tuple[str, dict]], content: str = "") -> str:
    """The assistant turn the family's template renders for these calls: what a model trained on it writes."""
    config = tokenizer_config(family)
    text_args = family.startswith("deepseek")
    message = {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a) if text_args else a}}
        for i, (n, a) in enumerate(calls)]}
    user = {"role": "user", "content": "q"}
    t = ChatTemplate({"default": config["chat_template"]}, family, special_tokens(config))
    before = t.render([user], add_generation_prompt=True)
    after = t.render([user, message])
    assert after.startswith(before)
    turn = after[len(before):]
    ends = [turn.index(e) for e in ("<|im_end|>", "<|eot_id|>", "<｜end▁of▁sentence｜>") if e in turn]
    return turn[:min(ends)]   # the policy's turn stops at its end token, which it does not hand the parser


@pytest.mark.parametrize("family, fmt, many", [("qwen3", "hermes", True), ("llama3.1", "llama3", False),
                                               ("llama3.2", "llama3", False), ("deepseek_v3", "deepseek", True)])
def test_calls_the_template_renders_are_read_back(family, fmt, many):
    assert detect_format(template_text(family)) == fmt
    calls = [("add", {"a": 2, "b": 3}), ("get_weather", {"city": "Paris", "days": [1, 2]})][:2 if many else 1]
    turn = parse(rendered_turn(family, calls, "" if fmt == "llama3" else "Let me compute."), fmt)
    assert [(c.name, c.arguments) for c in turn.calls] == calls and not turn.errors
    assert turn.content.endswith("" if fmt == "llama3" else "Let me compute.")   # Qwen3's empty think block first
    assert [c.id for c in turn.calls] == [f"call_{i}" for i in range(len(calls))]


def test_no_call_is_a_final_answer():
    for fmt in ("hermes", "llama3", "deepseek"):
        turn = parse("  The answer is 5.\n", fmt)
        assert turn.content == "The answer is 5." and not turn.has_calls


@pytest.mark.parametrize("text, fmt, match", [
    ("<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1,}}\n</tool_call>", "hermes", "not JSON"),
    ("<tool_call>\n{\"arguments\": {}}\n</tool_call>", "hermes", 'no "name" string'),
    ("<tool_call>\n{\"name\": \"add\", \"arguments\": [1, 2]}\n</tool_call>", "hermes", "must be a JSON object"),
    ("<tool_call>\n{\"name\": \"add\", \"arguments\": \"{oops\"}\n</tool_call>", "hermes", "string that is not JSON"),
    ("thinking... <tool_call>\n{\"name\": \"add\"", "hermes", "<tool_call> without </tool_call>"),
    ('{"name": "add", "parameters": {"a": 1}', "llama3", "not JSON"),
    ("<|python_tag|>brave_search.call(query=cats)", "llama3", "arguments must be literals"),
    ("<|python_tag|>print('x')", "llama3", "write name.call"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{\"a\": \n```<｜tool▁call▁end｜>"
     "<｜tool▁calls▁end｜>", "deepseek", "string that is not JSON"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{}\n```", "deepseek", "without"),
])
def test_malformed_calls_become_errors(text, fmt, match):
    turn = parse(text, fmt)
    assert turn.has_calls and not turn.calls and len(turn.errors) >= 1
    assert any(match in e for e in turn.errors), turn.errors


def test_llama3_variants():
    turn = parse('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "arguments": '
                 '{"a": 3, "b": 4}}', "llama3")
    assert [c.arguments for c in turn.calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    turn = parse('<|python_tag|>brave_search.call(query="cats", count=3)', "llama3")
    assert turn.calls == [ToolCall("brave_search", {"query": "cats", "count": 3}, "call_0")]


def test_deepseek_v31_form():
    turn = parse("ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 1, \"b\": 2}<｜tool▁call▁end｜>"
                 "<｜tool▁calls▁end｜>", "deepseek")
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2}, "call_0")] and turn.content == "ok"


def test_toolbox_runs_calls_and_returns_failures_as_tool_messages():
    box = Toolbox([add, divide, calculator])
    assert [s["function"]["name"] for s in box.schemas] == ["add", "divide", "calculator"]
    ok = box.call(ToolCall("add", {"a": 2, "b": 40}, "call_0"))
    assert ok == {"role": "tool", "name": "add", "tool_call_id": "call_0", "content": "42"}
    assert box.call(ToolCall("calculator", {"expression": "3*(4+5)"}, "c"))["content"] == "27"
    assert box.result(ToolCall("divide", {"a": 1, "b": 0}, "c")) == \
        "error: divide raised ZeroDivisionError: division by zero"
    assert box.result(ToolCall("calculator", {"expression": "3*"}, "c")).startswith("error: calculator raised "
                                                                                      "ValueError: expected a number")
    assert box.result(ToolCall("mul", {}, "c")) == "error: no tool named 'mul'; the tools are add, divide, calculator"
    assert box.result(ToolCall("add", {"a": 1, "c": 2}, "c")) == \
        "error: bad arguments for add (missing b; unknown c); it takes a, b"
    assert box.result(ToolCall("add", {"a": "x", "b": 1}, "c")).startswith("error: add raised TypeError")


def test_toolboxes_by_name_and_from_a_file(tmp_path):
    assert [s["function"]["name"] for s in load_toolbox("calculator").schemas] == ["calculator"]
    (tmp_path / "my_tools.py").write_text(
        "def shout(text: str) -> str:\n    \"\"\"Shout.\n\n    Args:\n        text: What to shout.\n    \"\"\"\n"
        "    return text.upper()\n\nTOOLS = [shout]\n")
    box = load_toolbox(f"{tmp_path / 'my_tools.py'}:TOOLS")
    assert box.result(ToolCall("shout", {"text": "hi"}, "c")) == "HI"
    assert load_toolbox(f"{tmp_path / 'my_tools.py'}:shout").schemas == box.schemas
    with pytest.raises(ValueError, match="has no tool list or function 'NOPE'"):
        load_toolbox(f"{tmp_path / 'my_tools.py'}:NOPE")
    with pytest.raises(ValueError, match="give a built-in toolbox \\(calculator\\) or path/to/file.py:NAME"):
        load_toolbox("abacus")
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        Toolbox([add, add])
