"""Tool definitions: a plain Python function's JSON schema, from its signature and its docstring.

The schema is the one chat templates expect (and transformers' get_json_schema writes):
{"type": "function", "function": {"name", "description", "parameters": {"type": "object",
"properties", "required"}, "return"?}}. The description is the docstring before its Args: section;
each argument needs a type hint and a line `name: what it is` (or `name (type): ...`) under Args:, a
trailing `(choices: [...])` becoming an enum. Types: int, float, str, bool, None, list[X], tuple[X, Y],
dict[str, X], X | Y (Optional adds "nullable"), Literal[...], Enum classes, Any. Keys are written in
the order templates print them, since `tools | tojson` renders a schema as text.
"""
from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from typing import Any, Callable, Literal, Union

SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
CONTAINERS = {list: "array", tuple: "array", dict: "object"}
SECTIONS = ("Args:", "Returns:", "Raises:")


class SchemaError(ValueError):
    """A function that cannot be described to a model: no docstring, a missing hint or description."""


def tool_schema(tool) -> dict:
    """A tool as a chat template reads it: a JSON schema dict as given, a function's built from it."""
    if isinstance(tool, dict):
        return tool
    schema = getattr(tool, "schema", None)   # chat.tools.Tool and anything shaped like it
    if isinstance(schema, dict):
        return schema
    if inspect.isfunction(tool) or inspect.ismethod(tool):
        return function_schema(tool)
    raise SchemaError(f"tool {tool!r} is neither a JSON schema dict nor a function: give a function with type "
                      "hints and a docstring, or its schema")


def function_schema(fn: Callable) -> dict:
    name = getattr(fn, "__name__", "tool")
    doc = inspect.getdoc(fn)
    if not doc:
        raise SchemaError(f"tool {name} has no docstring: write one line on what it does and an Args: section "
                          "with a line per argument")
    description, arg_docs, returns_doc = parse_docstring(doc.strip())
    hints = typing.get_type_hints(fn)
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name in ("self", "cls") and params[0].annotation is inspect.Parameter.empty:
        params = params[1:]  # a method's receiver
    properties, required = {}, []
    for p in params:
        if p.name not in hints:
            raise SchemaError(f"argument {p.name} of tool {name} has no type hint: annotate it (str, int, ...)")
        if p.name not in arg_docs:
            raise SchemaError(f"argument {p.name} of tool {name} is not described: add `{p.name}: ...` under Args: "
                              "in its docstring")
        prop = type_schema(hints[p.name], f"argument {p.name} of tool {name}")
        text = arg_docs[p.name]
        choices = re.search(r"\(choices:\s*(.*?)\)\s*$", text, flags=re.IGNORECASE)
        if choices:
            try:
                values = json.loads(choices.group(1))
            except json.JSONDecodeError:
                raise SchemaError(f"argument {p.name} of tool {name}: (choices: ...) must hold a JSON list, "
                                  f"got {choices.group(1)!r}") from None
            prop["enum"] = [v.strip() if isinstance(v, str) else v for v in values]
            text = text[:choices.start()].strip()
        prop["description"] = text
        properties[p.name] = prop
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    function = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:
        try:
            returns = type_schema(hints["return"], "")
        except SchemaError:
            returns = None  # the model never writes the return value: an odd return hint costs nothing
        if returns is not None:
            if returns_doc is not None:
                returns["description"] = returns_doc
            function["return"] = returns
    return {"type": "function", "function": function}


def parse_docstring(doc: str) -> tuple[str | None, dict[str, str], str | None]:
    """(description, {argument: description}, returns description) of a Google-style docstring."""
    lines = doc.split("\n")
    starts = {s: i for i, line in enumerate(lines) for s in SECTIONS if line.strip() == s}
    first = min(starts.values(), default=len(lines))
    description = "\n".join(lines[:first]).strip() or None

    def section(title):
        if title not in starts:
            return []
        start = starts[title] + 1
        end = min([i for i in starts.values() if i > starts[title]], default=len(lines))
        return [line for line in lines[start:end] if line.strip()]

    args: dict[str, str] = {}
    body = section("Args:")
    indent = min((len(line) - len(line.lstrip()) for line in body), default=0)
    current = None
    for line in body:
        head = re.match(r"(\w+)\s*(?:\([^()\n]*\))?\s*:\s*(.*)$", line[indent:]) if \
            len(line) - len(line.lstrip()) == indent else None
        if head:
            current = head.group(1)
            args[current] = head.group(2).strip()
        elif current is not None:   # a continuation, indented deeper
            args[current] = f"{args[current]} {line.strip()}".strip()
    returns = " ".join(line.strip() for line in section("Returns:")) or None
    return description, args, returns


def type_schema(hint, where: str) -> dict:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return enum_schema([m.value for m in hint], where)
        if hint is Any:
            return {}
        if hint in SCALARS:
            return {"type": SCALARS[hint]}
        if hint in CONTAINERS:
            return {"type": CONTAINERS[hint]}
        raise SchemaError(f"{where}: no JSON schema for the type {hint!r}; use int, float, str, bool, list, dict, "
                          "Literal, an Enum or unions of them, or give the tool's schema by hand")
    if origin is Union or origin is types.UnionType:
        members = [type_schema(a, where) for a in args if a is not type(None)]
        if len(members) == 1:
            out = members[0]
        elif all(set(m) == {"type"} and isinstance(m["type"], str) for m in members):
            names = sorted({m["type"] for m in members})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": members}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is Literal:
        return enum_schema(list(args), where)
    if origin is list:
        return {"type": "array", "items": type_schema(args[0], where)} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or Ellipsis in args:
            raise SchemaError(f"{where}: tuple[{', '.join(map(str, args))}] has no fixed JSON form; use list[X] for "
                              "a sequence, or tuple[X, Y] for fixed positions")
        return {"type": "array", "prefixItems": [type_schema(a, where) for a in args]}
    if origin is dict:
        return {"type": "object", "additionalProperties": type_schema(args[1], where)} if len(args) == 2 \
            else {"type": "object"}
    raise SchemaError(f"{where}: no JSON schema for the type {hint!r}")


def enum_schema(values: list, where: str) -> dict:
    if not values or any(type(v) not in SCALARS for v in values):
        raise SchemaError(f"{where}: enum values {values!r} must be a non-empty list of JSON scalars")
    kinds = list(dict.fromkeys(SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(values)}
