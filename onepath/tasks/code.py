"""Code tasks: the model writes a Python function, the sandbox runs it against the row's tests.

Rows in verl's format: reward_model.ground_truth holds the tests as JSON, one of
  {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}   call-based (DeepCoder / APPS / LeetCode rows)
  {"inputs": ["1 2\\n"], "outputs": ["3\\n"]}                standard input and output (APPS / TACO)
  ["assert add(1, 2) == 3", ...] or {"tests": [...]}      assert statements (MBPP's test_list)
(a JSON string of one of them too, as verl's parquet files store it). The code is the completion's
last ```python (or untagged) block, else the whole completion.

Rewards (train/rewards.py registers them): code_tests scores 1.0 when every test passes and 0.0
otherwise, as DeepCoder and verl's prime_code do (a partial score pays for special-casing the easy
tests); code_pass_rate scores the fraction passed, as verl's sandbox_fusion does with continuous=True.
A sandbox failure scores 0 and warns once; it never raises into the training step.

The embedded task (data.task code): the problems of code_problems.py as rows, a character-level
tokenizer over printable ASCII and newline, extra_info.solution the reference for the warm start.
CodeEnv lets a multi-turn episode run its code: a failed attempt gets the first failing test back and
tries again (train/episodes.py).
"""
from __future__ import annotations

import json
import random
import re
import secrets
import string
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from onepath.tasks import arithmetic
from onepath.tasks.arithmetic import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID, tokenizer_config  # noqa: F401
from onepath.tasks.code_problems import all_problems
from onepath.tasks.sandbox import Limits, RunResult, Sandbox

ALPHABET = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")  # printable ASCII and "\n"
HARNESS = Path(__file__).with_name("code_harness.py")
FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n", re.IGNORECASE)
MAX_FEEDBACK = 120  # characters of a failed test that CodeEnv shows the policy

_sandbox: Sandbox | None = None
_sandbox_lock = threading.Lock()


def build_tokenizer():
    return arithmetic.build_tokenizer(ALPHABET)


def default_sandbox() -> Sandbox:
    """The process's shared sandbox (its worker pool bounds every reward and env run together)."""
    global _sandbox
    with _sandbox_lock:
        if _sandbox is None:
            _sandbox = Sandbox(Limits())
    return _sandbox


def extract_code(completion: str) -> str:
    """The last closed ```python (or untagged) block; without one, what follows a fence left open (a
    completion cut at max_tokens); without fences, the completion itself."""
    blocks = FENCE.findall(completion)
    if blocks:
        return blocks[-1]
    opened = list(OPEN_FENCE.finditer(completion))
    if opened:
        return completion[opened[-1].end():]
    return completion


def parse_tests(ground_truth) -> dict:
    """The harness's tests.json from a row's ground truth (see the module docstring); ValueError names
    what is wrong with it."""
    spec = ground_truth
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            raise ValueError(f"code tests {ground_truth!r:.80} are not JSON: give {{\"fn_name\", \"inputs\", "
                             "\"outputs\"}, {\"inputs\", \"outputs\"} or a list of assert statements") from None
    if isinstance(spec, dict) and "tests" in spec:
        spec = spec["tests"]
    if isinstance(spec, (list, tuple)):
        if not spec or not all(isinstance(t, str) for t in spec):
            raise ValueError(f"code tests {spec!r:.80}: a test list must be non-empty assert statements (strings)")
        return {"kind": "assert", "tests": list(spec)}
    if not isinstance(spec, dict) or "inputs" not in spec or "outputs" not in spec:
        raise ValueError(f"code tests {ground_truth!r:.80}: give {{\"fn_name\", \"inputs\", \"outputs\"}}, "
                         "{\"inputs\", \"outputs\"} or a list of assert statements")
    inputs, outputs = list(spec["inputs"]), list(spec["outputs"])
    if not inputs or len(inputs) != len(outputs):
        raise ValueError(f"code tests have {len(inputs)} inputs and {len(outputs)} outputs: give one output per "
                         "input, at least one")
    if spec.get("fn_name"):
        if not all(isinstance(args, (list, tuple)) for args in inputs):
            raise ValueError(f"code tests for {spec['fn_name']}: each input is the list of the call's arguments")
        return {"kind": "call", "fn_name": str(spec["fn_name"]), "inputs": inputs, "outputs": outputs}
    if not all(isinstance(x, str) for x in inputs + outputs):
        raise ValueError("code tests without fn_name run on stdin: inputs and outputs must be strings")
    return {"kind": "stdio", "inputs": inputs, "outputs": outputs}


@dataclass(slots=True)
class CodeResult:
    """status: passed | failed | no_code | error (the code does not load) | memory | timeout | output_limit |
    killed | crashed | sandbox_error (the run's own status when the tests did not finish)."""
    status: str
    passed: int
    total: int
    failures: list[str] = field(default_factory=list)  # the failed tests' messages, in test order
    run: RunResult | None = None

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def run_tests(completion: str, ground_truth, sandbox: Sandbox | None = None) -> CodeResult:
    """Run the completion's code against ground_truth's tests in the sandbox, every test in one run."""
    spec = parse_tests(ground_truth)
    total = len(spec["tests"] if spec["kind"] == "assert" else spec["inputs"])
    code = extract_code(completion)
    if not code.strip():
        return CodeResult("no_code", 0, total, ["no code in the completion"])
    # the harness reads the nonce before the solution runs and signs each record with it: lines the program
    # writes blindly on the pipe do not count (docs/sandbox.md: what a program that reads the harness can do)
    nonce = secrets.token_hex(16)
    run = (sandbox or default_sandbox()).run(
        HARNESS.read_text(), stdin=nonce + "\n", files={"solution.py": code, "tests.json": json.dumps(spec)},
        channel=True)
    results, load_error = {}, None
    for line in run.channel.splitlines():
        try:
            record = json.loads(line)
            if record.get("nonce") != nonce:
                continue
            if "load_error" in record:
                load_error = str(record["load_error"])
            elif isinstance(record.get("test"), int) and 0 <= record["test"] < total:
                results.setdefault(record["test"], (record.get("passed") is True, str(record.get("error"))))
        except (ValueError, AttributeError):
            continue  # the program wrote on its pipe: nothing it writes there counts as a pass
    passed = sum(ok for ok, _ in results.values())
    failures = [results[i][1] if i in results else "did not run" for i in range(total)
                if not (i in results and results[i][0])]
    if run.status == "sandbox_error":
        warn_once(f"code tests: the sandbox failed ({run.detail}); the sample scores 0")
    if load_error is not None:
        status = "memory" if load_error.startswith("MemoryError") else "error"
        return CodeResult(status, 0, total, [load_error], run)
    if passed == total:
        return CodeResult("passed", passed, total, [], run)
    if run.status not in ("ok", "error"):
        return CodeResult(run.status, passed, total, failures, run)
    memory = any(f.startswith("MemoryError") or " raised MemoryError" in f for f in failures)
    return CodeResult("memory" if memory else "failed", passed, total, failures, run)


_warned = set()


def warn_once(message: str) -> None:
    key = message.split("(")[0]
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def code_tests(prompt: str, completion: str, ground_truth, **row) -> float:
    """1.0 if the completion's code passes every test in the sandbox, else 0.0."""
    return float(run_tests(completion, ground_truth).all_passed)


def code_pass_rate(prompt: str, completion: str, ground_truth, **row) -> float:
    """The fraction of the tests the completion's code passes in the sandbox."""
    result = run_tests(completion, ground_truth)
    return result.passed / result.total


def _batched(reward):
    def batch(calls: list[tuple[str, str, dict]]) -> list[float]:
        """Many calls at once, on the shared sandbox's workers (a GRPO step's completions); a group's
        samples that wrote the same code for the same tests run once."""
        keys = [(extract_code(completion), json.dumps(row.get("ground_truth"), sort_keys=True))
                for _, completion, row in calls]
        first = {key: i for i, key in reversed(list(enumerate(keys)))}
        scores = dict(zip(first, default_sandbox().map(
            lambda i: reward(calls[i][0], calls[i][1], **calls[i][2]), first.values())))
        return [scores[key] for key in keys]
    reward.batch = batch
    return reward


_batched(code_tests)
_batched(code_pass_rate)


# --- the embedded task -----------------------------------------------------------------------------

def make_problems(n: int, seed: int, split: str = "train") -> list[dict]:
    """n of the embedded problems, in an order fixed by seed, as verl rows."""
    problems = all_problems()
    if not 1 <= n <= len(problems):
        raise ValueError(f"{n} code problems requested but the embedded task has {len(problems)}: "
                         f"set data.n_train + data.n_test to at most {len(problems)}")
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    rows = []
    for i in order[:n]:
        p = problems[i]
        tests = {"fn_name": p.name, "inputs": [list(args) for args, _ in p.cases],
                 "outputs": [expected for _, expected in p.cases]}
        rows.append({
            "data_source": "onepath/code",
            "prompt": [{"role": "user", "content": p.prompt}],
            "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": json.dumps(tests)},
            "extra_info": {"split": split, "index": len(rows), "solution": p.solution},
        })
    return rows


def train_test_split(seed: int, n_train: int, n_test: int, **problem_kwargs):
    return arithmetic.train_test_split(seed, n_train, n_test, make=make_problems, **problem_kwargs)


def write_dataset(dir, seed: int, n_train: int, n_test: int, max_operand: int | None = None):
    """Write train.parquet and test.parquet under dir; return their paths. max_operand (the arithmetic
    tasks' data.max_operand) does not apply to code and is ignored."""
    return arithmetic.write_dataset(dir, seed, n_train, n_test, make=make_problems)


# --- the environment -------------------------------------------------------------------------------

class CodeEnv:
    """Environment for onepath.train.episodes.run_episodes: each policy turn is an attempt (it ends with
    EOS); the env runs its code against the row's tests. All passed: the episode is done. Else the first
    failure comes back as a comment line ("# failed: ...") and the policy tries again. reward_info's
    answer is the last attempt, which the reward scores. The tests are found by the episode's prompt
    (rows: the rows the episodes start from), so the env's reply depends on the episode alone."""

    def __init__(self, rows: list[dict], tokenizer=None, eos_token_ids: tuple[int, ...] = (EOS_ID,),
                 sandbox: Sandbox | None = None):
        from onepath.tasks.rows import prompt_text
        self.tokenizer = tokenizer or build_tokenizer()
        self.eos_token_ids = tuple(eos_token_ids)
        self.stop_token_ids = ()  # an attempt ends with EOS
        self.sandbox = sandbox
        self.tests = {}
        for i, row in enumerate(rows):
            try:
                self.tests[prompt_text(row)] = parse_tests(row["reward_model"]["ground_truth"])
            except ValueError as e:
                raise ValueError(f"rollout.env code runs each row's tests, but row {i}'s: {e}") from None
        self.alphabet = set(self.tokenizer.get_vocab())

    def step(self, episode) -> tuple[list[int] | None, dict]:
        prompt = self.tokenizer.decode(episode.prompt_ids, skip_special_tokens=True)
        segment = episode.last_segment
        ended = bool(segment) and segment[-1] in self.eos_token_ids
        attempt = self.tokenizer.decode(segment[:-1] if ended else segment, skip_special_tokens=True)
        if prompt not in self.tests:
            raise KeyError(f"CodeEnv has no tests for the prompt {prompt!r:.80}: give it the rows the episodes "
                           "start from")
        result = run_tests(attempt, self.tests[prompt], self.sandbox)
        info = {"answer": attempt, "status": result.status, "passed": result.passed, "total": result.total}
        if result.all_passed:
            return None, info
        feedback = (result.failures or [result.status])[0].replace("\n", " ")[:MAX_FEEDBACK]
        feedback = "".join(c if c in self.alphabet else "?" for c in feedback)
        reply = ("" if ended else "\n") + f"# failed: {feedback}\n"
        return self.tokenizer.encode(reply, add_special_tokens=False).ids, info
