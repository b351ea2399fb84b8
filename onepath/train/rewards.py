"""Reward functions: `fn(prompt: str, completion: str, **row) -> float`.

`row` is the dataset row flattened by `data.reward_kwargs`: at least ground_truth, data_source and
extra_info; the trainer adds response_length (completion tokens). A reward may also have
`fn.batch(calls) -> list[float]` for a step's calls at once (the code rewards run them on the
sandbox's workers); score_batch uses it where there is one.
"""

import functools
import math
import threading

from onepath.user_code import load_object

from onepath.tasks.code import code_pass_rate, code_tests


def exact_answer(prompt: str, completion: str, ground_truth, **row) -> float:
    return float(completion.strip() == str(ground_truth).strip())


def math_answer(prompt: str, completion: str, ground_truth, **row) -> float:
    """1.0 if math_verify finds the completion's answer equal to ground_truth.

    Reads "#### 42" (GSM8K), \\boxed{...} and a plain final number; garbage scores 0.
    """
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    # math_verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    if "####" in completion:
        # GSM8K's marker: its answer is the token right after it, whatever text follows.
        completion = (completion.rsplit("####", 1)[1].split() or [""])[0]
    try:
        gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=timeout)
        answer = parse(completion, parsing_timeout=timeout)
        return float(bool(gold and answer and verify(gold, answer, timeout_seconds=timeout)))
    except (Exception, TimeoutException):  # TimeoutException is a BaseException
        return 0.0


def overlong_penalty(reward_fn, max_response_tokens: int, buffer_tokens: int,
                     penalty_factor: float = 1.0):
    """DAPO's soft overlong punishment: 0 up to max - buffer tokens, then falls linearly to
    -penalty_factor at max_response_tokens; added to reward_fn's score."""
    if not 0 < buffer_tokens <= max_response_tokens:
        raise ValueError(f"overlong buffer_tokens {buffer_tokens} must be in "
                         f"(0, max_response_tokens {max_response_tokens}]: lower the buffer")
    expected = max_response_tokens - buffer_tokens

    def penalty(row: dict) -> float:
        if "response_length" not in row:
            raise KeyError("overlong_penalty needs response_length=<completion tokens> "
                           "in the reward call")
        return min(0.0, (expected - row["response_length"]) / buffer_tokens) * penalty_factor

    @functools.wraps(reward_fn)
    def wrapped(prompt: str, completion: str, **row) -> float:
        extra = penalty(row)
        return reward_fn(prompt, completion, **row) + extra

    def batch(calls: list[tuple[str, str, dict]]) -> list[float]:
        extra = [penalty(row) for _, _, row in calls]
        return [score + e for score, e in zip(score_batch(reward_fn, calls), extra)]

    wrapped.batch = batch  # always: functools.wraps copied reward_fn's own batch, which skips the penalty
    return wrapped


def score_batch(reward_fn, calls: list[tuple[str, str, dict]]) -> list:
    """reward_fn over (prompt, completion, row) calls: reward_fn.batch(calls) where it has one, else one by one."""
    batch = getattr(reward_fn, "batch", None)
    if batch is not None:
        return list(batch(calls))
    return [reward_fn(prompt, completion, **row) for prompt, completion, row in calls]


REWARDS = {"exact_answer": exact_answer, "math_answer": math_answer, "code_tests": code_tests,
           "code_pass_rate": code_pass_rate}


def get_reward(name_or_path: str):
    """A reward by name (exact_answer, math_answer, code_tests, code_pass_rate) or as "path/to/file.py:function_name"."""
    if name_or_path in REWARDS:
        return REWARDS[name_or_path]
    path, sep, name = name_or_path.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise ValueError(f"unknown reward {name_or_path!r}: use one of {', '.join(REWARDS)}, "
                         "or path/to/file.py:function_name")
    fn = load_object(name_or_path, "reward", "def NAME(prompt, completion, **row) -> float")
    if not callable(fn):
        raise ValueError(f"reward file {path}: {name!r} is a {type(fn).__name__}, not a function: define "
                         f"def {name}(prompt, completion, **row) -> float")
    return fn


def reward_problem(value) -> str | None:
    """None when value is a usable reward, a finite number (bool, int and numpy or 0-d torch
    scalars count), else what it is, for an error message."""
    if getattr(type(value), "__float__", None) is None:
        return f"{value!r:.80} (a {type(value).__name__}), not a number"
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):  # e.g. a tensor of several numbers
        return f"{value!r:.80} (a {type(value).__name__}), not one number"
    return None if math.isfinite(number) else str(number)


def check_reward(fn, name: str, prompt: str, completion: str, row: dict) -> None:
    """Call the reward once, before any training, so that a broken one fails in a line at start."""
    where = f"reward {name} on the first training row (its ground truth as the completion)"
    try:
        value = fn(prompt, completion, **row)
    except Exception as e:
        raise ValueError(f"{where} raised {type(e).__name__}: {e}: it is called as "
                         "fn(prompt, completion, **row) with row's keys " + ", ".join(row)) from None
    problem = reward_problem(value)
    if problem is not None:
        raise ValueError(f"{where} returned {problem}: return a finite float (bool and int are fine)")
