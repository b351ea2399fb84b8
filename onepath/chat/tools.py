"""Tools: plain Python functions with a JSON schema, called on a model's tool calls.

A tool's answer, its exception, an unknown name or bad arguments all come back as a tool message
(role "tool", name, tool_call_id, content) the model reads on its next turn: nothing a model writes
stops the episode. Toolboxes by name: `calculator` (built in), or `path/to/file.py:NAME` where NAME is
a function or a list of functions.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from onepath.chat.schema import function_schema
from onepath.chat.tool_calls import ToolCall
from onepath.user_code import load_object


@dataclass(frozen=True)
class Tool:
    fn: Callable
    schema: dict          # {"type": "function", "function": {"name", "description", "parameters"}}

    @classmethod
    def of(cls, fn: Callable | Tool, schema: dict | None = None) -> Tool:
        if isinstance(fn, Tool):
            return fn
        if not callable(fn):
            raise ValueError(f"tool {fn!r} is not callable: give a function")
        return cls(fn, schema or function_schema(fn))

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


class Toolbox:
    def __init__(self, tools: list[Callable | Tool]):
        self.tools = {}
        for tool in map(Tool.of, tools):
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}: give each tool its own name")
            self.tools[tool.name] = tool
        if not self.tools:
            raise ValueError("a toolbox needs at least one tool")

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def call(self, call: ToolCall) -> dict:
        """The tool message answering `call`; a failure is its content, starting "error:"."""
        return tool_message(call, self.result(call))

    def result(self, call: ToolCall) -> str:
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: no tool named {call.name!r}; the tools are {', '.join(self.tools)}"
        params = tool.schema["function"].get("parameters", {})
        known, required = params.get("properties", {}), params.get("required", [])
        missing = [k for k in required if k not in call.arguments]
        unknown = [k for k in call.arguments if k not in known]
        if missing or unknown:
            what = ([f"missing {', '.join(missing)}"] if missing else []) + \
                   ([f"unknown {', '.join(unknown)}"] if unknown else [])
            return f"error: bad arguments for {call.name} ({'; '.join(what)}); it takes {', '.join(known) or 'none'}"
        try:
            value = tool.fn(**call.arguments)
        except Exception as e:  # a tool's failure is the model's information, not the run's end
            return f"error: {call.name} raised {type(e).__name__}: {e}"
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def tool_message(call: ToolCall | None, content: str) -> dict:
    if call is None:
        return {"role": "tool", "content": content}
    return {"role": "tool", "name": call.name, "tool_call_id": call.id, "content": content}


def calculator(expression: str) -> int:
    """Evaluate an arithmetic expression of integers: + - * / and parentheses, exact division only.

    Args:
        expression: The expression, e.g. "3*(4+5)".
    """
    from onepath.tasks.calculator import evaluate, parse
    return evaluate(parse(expression))


BUILTIN = {"calculator": [calculator]}


def load_toolbox(spec: str) -> Toolbox:
    """A built-in toolbox name, or path/to/file.py:NAME (a function or a list of functions)."""
    if spec in BUILTIN:
        return Toolbox(BUILTIN[spec])
    if not spec.rpartition(":")[0].endswith(".py"):
        raise ValueError(f"tools {spec!r}: give a built-in toolbox ({', '.join(BUILTIN)}) or path/to/file.py:NAME")
    value = load_object(spec, "tools", "NAME = [a_function, ...] (or def NAME(...))", kind="tool list or function")
    return Toolbox(list(value) if isinstance(value, (list, tuple)) else [value])
