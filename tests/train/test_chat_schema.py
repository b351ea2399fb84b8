"""A plain function's tool schema (onepath.chat.schema) equals transformers' get_json_schema, keys in the
same order (templates print `tools | tojson` as text); what cannot be described fails naming the function."""
import enum
import json
from typing import Any, Literal

import pytest

from onepath.chat.schema import SchemaError, function_schema, tool_schema


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


def weather(city: str, unit: Unit = Unit.C, days: int | None = None) -> dict[str, float]:
    """Get the weather forecast.

    A second paragraph of description.

    Args:
        city: The city to look up, e.g. "Paris".
            A continuation line, indented deeper.
        unit: The unit.
        days (int): How many days ahead; null for today.

    Returns:
        The temperature per day.
    """


def search(query: str, tags: list[str], filters: dict[str, int], mode: Literal["fast", "exact"] = "fast",
           pair: tuple[int, str] = (1, "a"), anything: Any = None, flag: bool = False, score: float | str = 1.0):
    """Search an index.

    Args:
        query: What to look for.
        tags: Tags to match.
        filters: Field to minimum value.
        mode: The search mode.
        pair: A pair.
        anything: Any value at all.
        flag: A switch (choices: [true, false])
        score: A threshold.
    """


def no_args() -> str:
    """Say hello."""


class Box:
    def get(self, key: str) -> str:
        """Read a key.

        Args:
            key: The key.
        """


@pytest.mark.parametrize("fn", [weather, search, no_args, Box().get])
def test_schema_equals_transformers(fn):
    from transformers.utils import get_json_schema
    want = get_json_schema(fn)
    got = function_schema(fn)
    assert got == want and json.dumps(got) == json.dumps(want)   # the same keys, in the same order


def test_schemas_pass_through_and_other_things_are_refused():
    schema = {"type": "function", "function": {"name": "x", "parameters": {"type": "object", "properties": {}}}}
    assert tool_schema(schema) is schema
    with pytest.raises(SchemaError, match="neither a JSON schema dict nor a function"):
        tool_schema(42)


def undocumented(x: int):
    pass


def unhinted(x):
    """Do.

    Args:
        x: A value.
    """


def undescribed(x: int, y: int):
    """Do.

    Args:
        x: A value.
    """


def odd_type(x: set):
    """Do.

    Args:
        x: A value.
    """


@pytest.mark.parametrize("fn, match", [
    (undocumented, r"tool undocumented has no docstring"),
    (unhinted, r"argument x of tool unhinted has no type hint"),
    (undescribed, r"argument y of tool undescribed is not described: add `y: ...` under Args:"),
    (odd_type, r"argument x of tool odd_type: no JSON schema for the type <class 'set'>"),
])
def test_what_cannot_be_described_fails_naming_the_function(fn, match):
    with pytest.raises(SchemaError, match=match):
        function_schema(fn)
