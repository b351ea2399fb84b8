"""The embedded word problems: every worked solution is correct arithmetic ending in "#### <answer>", the
values stay in range, prompts are distinct and the splits disjoint, all deterministic in the seed and in
the tokenizer's alphabet; the warm start trains on the solutions; one RL step runs with the overlong penalty."""
import re

import pytest

from onepath.config import EMBEDDED_TASKS, load_run_config
from onepath.tasks import arithmetic, word_problems
from onepath.tasks.rows import prompt_text
from onepath.tasks.word_problems import (ALPHABET, BOS_ID, EOS_ID, MAX_VALUE, PAD_ID, build_tokenizer, capacity,
                                         make_problems, train_test_split, write_dataset)
from onepath.train import trainer
from onepath.train.data import load_rows
from onepath.train.rewards import math_answer
from onepath.train.trainer import GRPOTrainer, embedded_task, prepare, supervised_completion

EQUATION = re.compile(r"(\d+)([-+*/])(\d+)=(\d+)")
# each sentence a template writes, read back here on its own: (pattern, its equations and new value at value v,
# whether its last number is an amount the problem states, in [1, max_operand])
SENTENCES = [
    (r"\w+ has (\d+) \w+\.", lambda v, n: ([], n), True),
    (r"\w+ (?:buys|finds|gets) (\d+) more\.", lambda v, m: ([f"{v}+{m}={v + m}"], v + m), True),
    (r"\w+ (?:gives (\d+) away|loses (\d+)|sells (\d+))\.", lambda v, m: ([f"{v}-{m}={v - m}"], v - m), True),
    (r"\w+ doubles them\.", lambda v: ([f"{v}*2={v * 2}"], v * 2), False),
    (r"\w+ triples them\.", lambda v: ([f"{v}*3={v * 3}"], v * 3), False),
    (r"\w+ buys ([2-5]) boxes of (\d+)\.", lambda v, a, b: ([f"{a}*{b}={a * b}", f"{v}+{a * b}={v + a * b}"], v + a * b),
     True),
    (r"\w+ (?:splits them into ([2-5]) equal piles and keeps one|packs them into bags of ([2-9]))\.",
     lambda v, p: ([f"{v}/{p}={v // p}"], v // p), False),
    (r"How many (?:\w+ does \w+ have now|bags does \w+ fill)\?", lambda v: ([], v), False),
]


def read_back(text: str, max_operand: int) -> tuple[list[str], int]:
    """The equations a problem's sentences call for, and its answer, with every value checked in range."""
    assert text.endswith(" Answer after ####.")
    equations, value = [], None
    for sentence in re.split(r"(?<=[.?]) ", text.removesuffix(" Answer after ####.")):
        [(match, apply, amount)] = [(m, f, a) for p, f, a in SENTENCES if (m := re.fullmatch(p, sentence))]
        numbers = [int(x) for x in match.groups() if x is not None]
        assert not amount or 1 <= numbers[-1] <= max_operand, sentence
        more, value = apply(value, *numbers)
        equations += more
        assert 1 <= value <= MAX_VALUE, sentence
    return equations, value


def check_solution(row: dict, max_operand: int):
    """The solution's steps are true equations, exactly those the problem states, and end in '#### <truth>'."""
    steps, answer = row["extra_info"]["solution"].split(" #### ")
    equations = [e.removesuffix(".") for e in steps.split(" ")]
    for equation in equations:
        a, op, b, c = (int(x) if x.isdigit() else x for x in EQUATION.fullmatch(equation).groups())
        assert c == {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op] and (op != "/" or a % b == 0), equation
        assert 0 <= c <= MAX_VALUE
    assert (equations, int(answer)) == read_back(prompt_text(row), max_operand)
    assert answer == row["reward_model"]["ground_truth"]


def test_solutions_are_correct_chained_arithmetic_in_range():
    for max_operand in (2, 5, 20, 49):
        for row in make_problems(300, seed=max_operand, max_operand=max_operand):
            check_solution(row, max_operand)
            assert row["data_source"] == "word_problems" and row["ability"] == "math"
            assert row["reward_model"]["style"] == "rule"
    # negative controls: a wrong result, a true equation the problem does not state
    row = make_problems(1, seed=0)[0]
    steps, answer = row["extra_info"]["solution"].split(" #### ")
    for bad in (steps.replace("=", "=1", 1), steps + " 1+1=2."):
        with pytest.raises(AssertionError):
            check_solution({**row, "extra_info": {"solution": f"{bad} #### {answer}"}}, 20)


def test_math_answer_scores_the_solution_1_and_a_wrong_answer_0():
    for row in make_problems(50, seed=0):
        truth, solution = row["reward_model"]["ground_truth"], row["extra_info"]["solution"]
        assert math_answer(prompt_text(row), solution, truth) == 1.0
        wrong = solution.rsplit("#### ", 1)[0] + f"#### {int(truth) + 1}"
        assert math_answer(prompt_text(row), wrong, truth) == 0.0


def test_problems_are_distinct_varied_and_deterministic_in_the_seed():
    a = make_problems(500, seed=3)
    assert a == make_problems(500, seed=3) and a != make_problems(500, seed=4)
    prompts = [prompt_text(r) for r in a]
    assert len(set(prompts)) == len(prompts)
    sentences = {len(re.findall(r"[.?] ", prompt_text(r))) - 1 for r in a}  # after "X has N ...", the question too
    assert sentences == {3, 4, 5}
    ops = {op for r in a for op in EQUATION.findall(r["extra_info"]["solution"])}
    assert {op for _, op, _, _ in ops} == {"+", "-", "*", "/"}
    assert any("bags" in p for p in prompts)


def test_splits_are_disjoint_and_indexed(tmp_path):
    train, test = train_test_split(seed=0, n_train=2000, n_test=300)
    assert len(train) == 2000 and len(test) == 300
    assert not {prompt_text(r) for r in train} & {prompt_text(r) for r in test}
    assert test[1]["extra_info"] == {"split": "test", "index": 1, "solution": test[1]["extra_info"]["solution"]}
    assert train[7]["extra_info"]["split"] == "train" and train[7]["extra_info"]["index"] == 7
    train_path, test_path = write_dataset(tmp_path, seed=0, n_train=2000, n_test=300)
    assert load_rows(train_path) == train and load_rows(test_path) == test


def test_tokenizer_covers_every_character_and_keeps_the_special_ids():
    tokenizer = build_tokenizer()
    rows = make_problems(1000, seed=1)
    text = "".join(prompt_text(r) + r["extra_info"]["solution"] for r in rows)
    assert set(text) <= set(ALPHABET)
    sample = prompt_text(rows[0]) + " " + rows[0]["extra_info"]["solution"]
    ids = tokenizer.encode(sample, add_special_tokens=False).ids
    assert len(ids) == len(sample) and tokenizer.token_to_id("<unk>") not in ids
    assert tokenizer.decode(ids) == sample
    assert tokenizer.encode("7").ids[0] == BOS_ID
    assert (PAD_ID, BOS_ID, EOS_ID) == (arithmetic.PAD_ID, arithmetic.BOS_ID, arithmetic.EOS_ID)
    # the arithmetic task's tokenizer, and so the demo, is unchanged
    assert arithmetic.build_tokenizer().get_vocab() == {t: i for i, t in enumerate(
        arithmetic.SPECIAL_TOKENS + list(arithmetic.ALPHABET))}


def test_more_problems_than_the_templates_make_is_refused():
    most = capacity(2)
    assert len(make_problems(2000, seed=0, max_operand=2)) == 2000 < most
    with pytest.raises(ValueError, match=rf"{most + 1} word problems requested but max_operand 2 gives only "
                                         rf"{most} distinct ones: raise max_operand"):
        make_problems(most + 1, seed=0, max_operand=2)
    for bad in (1, 1000):
        with pytest.raises(ValueError, match=rf"max_operand {bad} must be in \[2, 999\] for word problems"):
            make_problems(1, seed=0, max_operand=bad)


def test_the_count_is_exact_on_a_space_small_enough_to_exhaust(monkeypatch):
    monkeypatch.setattr(word_problems, "PEOPLE", (("Mia", "She"),))
    monkeypatch.setattr(word_problems, "OBJECTS", ("pens",))
    monkeypatch.setattr(word_problems, "STEPS", (2,))
    most = capacity(3)
    rows = make_problems(most, seed=0, max_operand=3)
    assert len({prompt_text(r) for r in rows}) == most > 20
    with pytest.raises(ValueError, match=f"only {most} distinct"):
        make_problems(most + 1, seed=0, max_operand=3)


def test_every_embedded_task_has_its_module():
    assert [embedded_task(name).__name__ for name in EMBEDDED_TASKS] == ["onepath.tasks.arithmetic",
                                                                          "onepath.tasks.word_problems",
                                                                          "onepath.tasks.code"]
    with pytest.raises(ValueError, match=r"data.task = 'sudoku' is not an embedded task: use one of arithmetic, "
                                         r"word_problems, code"):
        load_run_config(None, ["--data.task", "sudoku", "--data.train_path", "rows.jsonl"])


TINY = ["--data.task", "word_problems", "--data.n_train", "32", "--data.n_test", "4", "--data.max_operand", "9",
        "--model.max_position_embeddings", "320", "--rollout.max_model_len", "320", "--rollout.max_tokens", "64",
        "--warm_start.batch_size", "4", "--train.prompts_per_step", "2", "--rollout.n", "2",
        "--train.reward", "math_answer"]


def test_the_warm_start_trains_on_the_worked_solutions(tmp_path, monkeypatch, capsys):
    seen = []

    def record(model, examples, steps, *args):
        seen.extend(examples)
        return [1.0]

    monkeypatch.setattr(trainer, "warm_start", record)
    cfg = load_run_config(None, [*TINY, "--warm_start.steps", "2", "--out", str(tmp_path)])
    setup = prepare(cfg, tmp_path, progress=False)
    assert "warm start: 2 steps on the dataset's worked solutions (the embedded model)" in capsys.readouterr().out
    decode = setup.tokenizer.decode
    assert [decode(c[:-1]) for _, c in seen] == [r["extra_info"]["solution"] for r in setup.train_rows]
    assert all(c[-1] == EOS_ID for _, c in seen)
    # a row without a solution (the arithmetic task's, a user's) teaches its ground truth, as before
    assert supervised_completion({"reward_model": {"ground_truth": 7}, "extra_info": {"split": "train"}}) == "7"
    assert supervised_completion({"reward_model": {"ground_truth": 7}, "extra_info": None}) == "7"


def test_one_rl_step_end_to_end_with_the_overlong_penalty(tmp_path):
    # the penalty starts after 4 of the 64 tokens: an untrained model's long answers score below 0
    cfg = load_run_config(None, [*TINY, "--warm_start.steps", "0", "--train.steps", "1", "--train.val_every", "1",
                                 "--train.overlong_buffer", "60", "--out", str(tmp_path)])
    setup = prepare(cfg, tmp_path, progress=False)
    [metrics] = GRPOTrainer(cfg, "consistent", setup, tmp_path / "consistent").run(progress=False)
    assert metrics["training/rollout_probs_diff_max"] == 0.0
    assert metrics["response_length/mean"] > 4
    assert -1.0 <= metrics["critic/score/mean"] < 0.0  # the penalty reached the reward
    assert "val/score" in metrics
    assert (tmp_path / "consistent" / "step_1").is_dir()
