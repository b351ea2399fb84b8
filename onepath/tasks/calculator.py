"""A calculator tool for multi-turn episodes, in the arithmetic task's alphabet.

The policy calls the tool by ending a turn with "=" (its stop token): the environment evaluates
the longest suffix of the turn that is an expression ("3+(12*7)=" -> 87) and appends "87 "; where
none parses or the arithmetic fails it appends ". ". A turn that ends without "=" (max_tokens)
gets "=" first. A turn that ends with EOS is the final answer: the episode is done. So every turn
but the last appends something, and a random policy still makes multi-turn episodes.

Expressions are parsed here, never eval()'d: integers, + - * /, unary minus, parentheses; "/"
only where it divides exactly; every value within +-10**12.
"""
from __future__ import annotations

from onepath.tasks import arithmetic

MAX_CHARS = 64
MAX_ABS = 10 ** 12
NO_RESULT = "."


def parse(text: str):
    """Expression tree of text: an int or (op, left, right). ValueError if text is not one expression."""
    s = text.strip()
    if not s or len(s) > MAX_CHARS:
        raise ValueError(f"expression of {len(s)} characters: give 1 to {MAX_CHARS}")
    pos = 0

    def peek():
        return s[pos] if pos < len(s) else ""

    def skip_spaces():
        # spaces may separate tokens, never split a number
        nonlocal pos
        while peek() == " ":
            pos += 1

    def take(chars):
        nonlocal pos
        skip_spaces()
        if peek() and peek() in chars:
            pos += 1
            return s[pos - 1]
        return None

    def expr():
        node = term()
        while (op := take("+-")) is not None:
            node = (op, node, term())
        return node

    def term():
        node = factor()
        while (op := take("*/")) is not None:
            node = (op, node, factor())
        return node

    def factor():
        nonlocal pos
        if take("-") is not None:
            return ("-", 0, factor())
        if take("(") is not None:
            node = expr()
            if take(")") is None:
                raise ValueError(f"missing ')' at {pos} in {s!r}")
            return node
        skip_spaces()
        start = pos
        while peek().isdigit() and peek().isascii():
            pos += 1
        if pos == start:
            raise ValueError(f"expected a number at {pos} in {s!r}")
        return int(s[start:pos])

    node = expr()
    skip_spaces()
    if pos != len(s):
        raise ValueError(f"unexpected {s[pos]!r} at {pos} in {s!r}")
    return node


def evaluate(node) -> int:
    """Value of a parse() tree. ArithmeticError on division by zero, inexact division or overflow."""
    if isinstance(node, int):
        value = node
    else:
        op, a, b = node[0], evaluate(node[1]), evaluate(node[2])
        if op == "/":
            if b == 0 or a % b:
                raise ArithmeticError(f"{a}/{b} is not an exact integer division")
            value = a // b
        else:
            value = {"+": a + b, "-": a - b, "*": a * b}[op]
    if abs(value) > MAX_ABS:
        raise ArithmeticError(f"{value} exceeds the calculator's range +-{MAX_ABS}")
    return value


def last_expression(text: str) -> str | None:
    """The longest suffix of text that parses as an expression, or None."""
    for start in range(len(text)):
        try:
            parse(text[start:])
        except ValueError:
            continue
        return text[start:].strip()
    return None


def calculate(text: str) -> int | None:
    try:
        return evaluate(parse(text))
    except (ValueError, ArithmeticError):
        return None


class CalculatorEnv:
    """Environment for onepath.train.episodes.run_episodes. Stateless: its answer depends on the episode alone."""

    def __init__(self, tokenizer=None, eos_token_ids: tuple[int, ...] = (arithmetic.EOS_ID,)):
        self.tokenizer = tokenizer or arithmetic.build_tokenizer()
        self.eos_token_ids = tuple(eos_token_ids)
        self.stop_token_ids = (self.tokenizer.token_to_id("="),)  # the policy calls the tool with "="

    def step(self, episode) -> tuple[list[int] | None, dict]:
        segment = episode.last_segment
        if segment and segment[-1] in self.eos_token_ids:
            answer = self.tokenizer.decode(segment[:-1], skip_special_tokens=True)
            return None, {"answer": answer.strip(), "calls": episode.turns - 1}
        text = self.tokenizer.decode(segment, skip_special_tokens=True).rstrip()
        ends_with_call = text.endswith("=")
        expression = last_expression(text[:-1] if ends_with_call else text)
        result = None if expression is None else calculate(expression)
        reply = ("" if ends_with_call else "=") + (NO_RESULT if result is None else str(result)) + " "
        info = {"answer": text.removesuffix("=").strip(), "calls": episode.turns, "expression": expression,
                "result": result}
        return self.tokenizer.encode(reply, add_special_tokens=False).ids, info
