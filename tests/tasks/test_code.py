"""The code task: every reference solution passes its own tests in the sandbox and a wrong one fails;
the harness counts only what the tests saw (no pass from an exit, a forged line or an object that equals
anything); the rewards, alone and batched; the embedded rows and tokenizer; CodeEnv; and GRPO on the
task end to end with diff = 0."""
import json

import pytest

from onepath.config import EMBEDDED_TASKS, load_run_config
from onepath.numerics.diff import is_exact
from onepath.tasks import code
from onepath.tasks.code import (ALPHABET, CodeEnv, build_tokenizer, code_pass_rate, code_tests, extract_code,
                                make_problems, run_tests, parse_tests, train_test_split, write_dataset)
from onepath.tasks.code_problems import FAMILIES, PROBLEMS, all_problems
from onepath.tasks.rows import prompt_text
from onepath.tasks.sandbox import Limits, Sandbox
from onepath.train.data import load_rows
from onepath.train.episodes import Episode
from onepath.train.rewards import REWARDS, overlong_penalty, score_batch
from onepath.train.trainer import GRPOTrainer, embedded_task, prepare

ADD = {"fn_name": "add", "inputs": [[1, 2], [0, 0], [-1, 5]], "outputs": [3, 0, 4]}
GOOD = "def add(a, b):\n    return a + b\n"


def truth(problem) -> str:
    return json.dumps({"fn_name": problem.name, "inputs": [list(a) for a, _ in problem.cases],
                       "outputs": [e for _, e in problem.cases]})


def test_the_problems_are_many_distinct_and_each_has_three_tests():
    problems = all_problems()
    assert len(PROBLEMS) >= 50 and len(problems) == len(PROBLEMS) + 8 * len(FAMILIES)
    assert len({p.prompt for p in problems}) == len(problems)
    assert all(len(p.cases) >= 3 for p in problems)
    assert set("".join(p.prompt + p.solution for p in problems)) <= set(ALPHABET)


def test_every_reference_solution_passes_its_tests_in_the_sandbox():
    problems = all_problems()
    calls = [("", p.solution, {"ground_truth": truth(p)}) for p in problems]
    assert code_tests.batch(calls) == [1.0] * len(problems)


def test_a_wrong_solution_fails_its_tests():
    problems = all_problems()
    # each problem's reference renamed to the next one's function: right name, wrong function
    calls = []
    for p, q in zip(problems, problems[1:] + problems[:1]):
        wrong = p.solution.replace(f"def {p.name}(", f"def {q.name}(", 1)
        calls.append(("", wrong, {"ground_truth": truth(q)}))
    scores = code_tests.batch(calls)
    assert scores == [0.0] * len(problems)
    off_by_one = run_tests("def add(a, b):\n    return a + b + 1\n", ADD)
    assert (off_by_one.status, off_by_one.passed, off_by_one.total) == ("failed", 0, 3)
    assert off_by_one.failures[0] == "add(1, 2) returned 4, expected 3"


@pytest.mark.parametrize("completion, expected", [
    ("def f():\n    pass\n", "def f():\n    pass\n"),
    ("Here:\n```python\nx = 1\n```\nand better:\n```python\nx = 2\n```\n", "x = 2\n"),
    ("```\nx = 3\n```", "x = 3\n"),
    ("```py\nx = 4\n```", "x = 4\n"),
    ("text\n```python\nx = 5\n", "x = 5\n"),
    ("```python\nx = 6\n``` then ```python\nunfinished", "x = 6\n"),  # a closed block wins over one cut short
])
def test_the_code_is_the_last_fenced_block_or_the_raw_completion(completion, expected):
    assert extract_code(completion) == expected


def test_ground_truth_formats_and_errors():
    assert parse_tests(json.dumps(ADD))["kind"] == "call"
    assert parse_tests(["assert add(1, 2) == 3"]) == {"kind": "assert", "tests": ["assert add(1, 2) == 3"]}
    assert parse_tests({"tests": ["assert True"]})["kind"] == "assert"
    assert parse_tests({"inputs": ["1 2\n"], "outputs": ["3\n"]})["kind"] == "stdio"
    for bad, match in [("not json", r"are not JSON"), ([], r"non-empty assert statements"),
                       ({"inputs": [1, 2], "outputs": [3]}, r"2 inputs and 1 outputs"),
                       ({"fn_name": "f", "inputs": [1], "outputs": [1]}, r"each input is the list of the call's"),
                       ({"inputs": [1], "outputs": [1]}, r"inputs and outputs must be strings"),
                       ({"x": 1}, r"give \{\"fn_name\""), (7, r"give \{\"fn_name\"")]:
        with pytest.raises(ValueError, match=match):
            parse_tests(bad)


@pytest.mark.parametrize("completion, status, passed", [
    (GOOD, "passed", 3),
    (f"```python\n{GOOD}```", "passed", 3),
    ("def add(a, b):\n    return 3\n", "failed", 1),
    ("   ", "no_code", 0),
    ("def add(a, b)\n    return a + b\n", "error", 0),               # a syntax error
    ("def plus(a, b):\n    return a + b\n", "error", 0),             # not the asked function
    ("x = bytearray(10**10)\n", "memory", 0),
    ("def add(a, b):\n    return bytearray(10**10)\n", "memory", 0),
    ("import time\ndef add(a, b):\n    if a < 0:\n        while True:\n            pass\n    return a + b\n",
     "timeout", 2),                                                    # the tests before the loop still count
    ("def add(a, b):\n    while True:\n        print('x' * 1000)\n", "output_limit", 0),
    ("import os\nos._exit(0)\n", "failed", 0),
    ("import sys\nsys.exit(0)\n", "error", 0),
    ("def add(a, b):\n    class Any:\n        def __eq__(self, other):\n            return True\n    return Any()\n",
     "failed", 0),
    ('print(\'{"test": 0, "passed": true}\')\ndef add(a, b):\n    return 0\n', "failed", 1),
])
def test_run_tests_reports_what_happened(completion, status, passed):
    result = run_tests(completion, ADD, Sandbox(Limits(cpu_s=1, wall_s=3), workers=1))
    assert (result.status, result.passed, result.total) == (status, passed, 3), result
    assert bool(result.failures) == (status != "passed")


def test_lines_written_blindly_on_the_harness_pipe_do_not_count():
    forge = ("import os\nfor fd in range(3, 64):\n    for i in range(3):\n        try:\n"
             "            os.write(fd, b'{\"test\": %d, \"passed\": true}\\n' % i)\n        except OSError:\n"
             "            pass\ndef add(a, b):\n    return 7\n")
    forged = run_tests(forge, ADD)
    assert (forged.status, forged.passed) == ("failed", 0), forged
    assert forged.run.status == "ok"


def test_stdio_and_assert_tests():
    stdio = {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10"]}
    assert run_tests("a, b = map(int, input().split())\nprint(a + b)\n", stdio).status == "passed"
    wrong = run_tests("print(0)", stdio)
    assert (wrong.status, wrong.passed) == ("failed", 0) and wrong.failures[0].startswith("printed '0\\n'")
    asserts = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 5"]
    result = run_tests(GOOD, asserts)
    assert (result.status, result.passed, result.total) == ("failed", 2, 3)
    assert result.failures == ["assert add(2, 2) == 5 failed: AssertionError: AssertionError()"]


def test_the_rewards_all_pass_and_pass_rate_alone_and_batched():
    half = "def add(a, b):\n    return a + b if a >= 0 else 0\n"
    assert code_tests("", GOOD, ground_truth=ADD) == 1.0 and code_tests("", half, ground_truth=ADD) == 0.0
    assert code_pass_rate("", half, ground_truth=ADD) == pytest.approx(2 / 3)
    assert REWARDS["code_tests"] is code_tests and REWARDS["code_pass_rate"] is code_pass_rate
    completions = [GOOD, half, "garbage(", GOOD, half, ""]
    calls = [("", c, {"ground_truth": ADD, "response_length": 10 * i}) for i, c in enumerate(completions)]
    one_by_one = [code_pass_rate(p, c, **row) for p, c, row in calls]
    assert score_batch(code_pass_rate, calls) == one_by_one == [1.0, 2 / 3, 0.0, 1.0, 2 / 3, 0.0]
    # the overlong penalty applies on the batched path too (functools.wraps copied the batch it must not use)
    penalised = overlong_penalty(code_tests, max_response_tokens=50, buffer_tokens=20)
    expected = [code_tests(p, c, **row) + min(0.0, (30 - row["response_length"]) / 20) for p, c, row in calls]
    assert score_batch(penalised, calls) == [penalised(p, c, **row) for p, c, row in calls] == expected
    assert expected[-1] == -1.0
    # a reward without batch goes one call at a time
    assert score_batch(lambda p, c, **row: len(c), calls) == [len(c) for c in completions]


def test_a_sandbox_failure_scores_zero_and_warns():
    broken = Sandbox(Limits(), interpreters=("/nonexistent/python3",))
    code._warned.clear()
    with pytest.warns(RuntimeWarning, match=r"code tests: the sandbox failed \(the sandbox could not start"):
        result = run_tests(GOOD, ADD, broken)
    assert result.status == "sandbox_error" and not result.all_passed


def test_rows_splits_and_dataset_files(tmp_path):
    rows = make_problems(124, seed=0)
    assert rows == make_problems(124, seed=0) and rows != make_problems(124, seed=1)
    row = rows[0]
    assert row["data_source"] == "onepath/code" and row["ability"] == "code"
    assert prompt_text(row).startswith("Write ") and row["extra_info"]["solution"].startswith("def ")
    assert parse_tests(row["reward_model"]["ground_truth"])["kind"] == "call"
    train, test = train_test_split(seed=0, n_train=100, n_test=24)
    assert not {prompt_text(r) for r in train} & {prompt_text(r) for r in test}
    assert test[3]["extra_info"]["split"] == "test" and test[3]["extra_info"]["index"] == 3
    train_path, test_path = write_dataset(tmp_path, seed=0, n_train=100, n_test=24, max_operand=49)
    assert load_rows(train_path) == train and load_rows(test_path) == test
    with pytest.raises(ValueError, match=r"125 code problems requested but the embedded task has 124: set "
                                         r"data.n_train \+ data.n_test to at most 124"):
        train_test_split(seed=0, n_train=120, n_test=5)


def test_the_tokenizer_covers_python_source_newlines_included():
    tokenizer = build_tokenizer()
    text = "".join(p.prompt + p.solution for p in all_problems()) + "\n\n```python\nx = {'a': [1]}  # ~`|\\\n```"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) == len(text) and tokenizer.token_to_id("<unk>") not in ids
    assert tokenizer.decode(ids) == text


def test_the_code_task_and_env_are_in_the_config():
    assert "code" in EMBEDDED_TASKS and embedded_task("code") is code
    cfg = load_run_config("onepath/configs/code.yaml", ["--rollout.env", "code"])
    assert (cfg.data.task, cfg.train.reward, cfg.rollout.env) == ("code", "code_tests", "code")


def episode(tokenizer, prompt: str, attempt: str, eos: bool) -> Episode:
    e = Episode.start(0, tokenizer.encode(prompt).ids)
    ids = tokenizer.encode(attempt, add_special_tokens=False).ids + ([code.EOS_ID] if eos else [])
    e.append_policy(ids, [0.0] * len(ids), "stop" if eos else "length")
    return e


def test_code_env_ends_a_passing_attempt_and_returns_the_first_failure():
    rows = make_problems(5, seed=0)
    env, tokenizer = CodeEnv(rows), build_tokenizer()
    prompt, solution = prompt_text(rows[0]), rows[0]["extra_info"]["solution"]
    tokens, info = env.step(episode(tokenizer, prompt, solution, eos=True))
    assert tokens is None and info["answer"] == solution and info["status"] == "passed"
    wrong = solution.replace("return ", "return 1 + ", 1)
    tokens, info = env.step(episode(tokenizer, prompt, wrong, eos=True))
    reply = tokenizer.decode(tokens)
    assert reply.startswith("# failed: ") and reply.endswith("\n") and info["status"] in ("failed", "error")
    assert tokenizer.token_to_id("<unk>") not in tokens and env.stop_token_ids == ()
    cut = env.step(episode(tokenizer, prompt, "def", eos=False))[0]
    assert tokenizer.decode(cut).startswith("\n# failed: ")
    with pytest.raises(KeyError, match="CodeEnv has no tests for the prompt"):
        env.step(episode(tokenizer, "Write nothing", solution, eos=True))
    with pytest.raises(ValueError, match=r"rollout.env code runs each row's tests, but row 1's: code tests '82': give"):
        CodeEnv([rows[0], {"prompt": "1+1=", "reward_model": {"ground_truth": "82"}}])


TINY = ["--data.n_train", "8", "--data.n_test", "2", "--warm_start.steps", "30", "--warm_start.batch_size", "8",
        "--train.steps", "2", "--train.prompts_per_step", "2", "--rollout.n", "4", "--rollout.max_tokens", "64",
        "--train.val_every", "2"]


@pytest.mark.parametrize("env", [None, "code"])
def test_grpo_on_the_code_task_runs_with_diff_zero(tmp_path, env):
    extra = ["--rollout.env", "code", "--rollout.max_turns", "2"] if env else []
    cfg = load_run_config("onepath/configs/code.yaml", [*TINY, *extra, "--out", str(tmp_path)])
    setup = prepare(cfg, tmp_path, progress=False)
    history = GRPOTrainer(cfg, "consistent", setup, tmp_path / "consistent").run(progress=False)
    assert len(history) == 2
    for metrics in history:
        assert is_exact(metrics), metrics
        assert 0.0 <= metrics["critic/score/mean"] <= 1.0
    assert "val/score" in history[-1]
    if env:
        assert any(m["episode/env_tokens/mean"] > 0 for m in history)
