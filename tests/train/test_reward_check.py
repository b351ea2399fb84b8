"""The reward is checked at start, before the warm start: importable, the named function exists and is
callable, and it returns a finite number on the first training row; each failure is one line."""
import pytest

from onepath.cli import main
from onepath.config import load_run_config
from onepath.train.rewards import check_reward, reward_problem
from onepath.train.trainer import prepare

TINY = ["--warm_start.steps", "3", "--warm_start.batch_size", "4", "--data.n_train", "16", "--data.n_test", "0"]

BROKEN = [
    ("def other(prompt, completion, **row):\n    return 1.0\n", r"has no function 'score': define def score\("),
    ("score = 3\n", r"'score' is a int, not a function"),
    ("def score(prompt, completion:\n", r"failed to import: SyntaxError"),
    ("import no_such_module_here\n", r"failed to import: ModuleNotFoundError: No module named 'no_such_module_here'"),
    ("def score(prompt, completion, **row):\n    return 'yes'\n", r"returned 'yes' \(a str\), not a number: return a "
                                                                 r"finite float \(bool and int are fine\)"),
    ("def score(prompt, completion, **row):\n    return float('nan')\n", r"returned nan: return a finite float"),
    ("def score(prompt, completion, **row):\n    return None\n", r"returned None \(a NoneType\), not a number"),
    ("def score(prompt, completion):\n    return 1.0\n", r"raised TypeError: .*unexpected keyword argument .*"
                                                         r"called as fn\(prompt, completion, \*\*row\)"),
]


@pytest.mark.parametrize("source, message", BROKEN)
def test_a_broken_reward_fails_in_a_line_before_the_warm_start(tmp_path, source, message):
    (tmp_path / "bad.py").write_text(source)
    cfg = load_run_config(None, [*TINY, "--train.reward", f"{tmp_path / 'bad.py'}:score", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=message) as error:
        prepare(cfg, tmp_path, progress=False)
    assert "bad.py" in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "warm_start").exists()


def test_the_cli_prints_it_as_one_line_and_exits_2(tmp_path, capsys):
    (tmp_path / "bad.py").write_text("def other(prompt, completion, **row):\n    return 1.0\n")
    assert main(["train", "--quiet", "--out", str(tmp_path), *TINY, "--train.reward", f"{tmp_path}/bad.py:score"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("onepath train: error: reward file") and err.count("\n") == 1


@pytest.mark.parametrize("value", [1.0, 0, 1, True, False, -2.5])
def test_numbers_bool_and_int_are_rewards(value):
    assert reward_problem(value) is None
    check_reward(lambda prompt, completion, **row: value, "r", "1+1=", "2", {"ground_truth": "2"})


def test_a_good_reward_passes_and_the_run_warm_starts(tmp_path):
    (tmp_path / "good.py").write_text("def score(prompt, completion, ground_truth, **row):\n"
                                      "    return completion == str(ground_truth)\n")
    cfg = load_run_config(None, [*TINY, "--train.reward", f"{tmp_path / 'good.py'}:score", "--out", str(tmp_path)])
    prepare(cfg, tmp_path, progress=False)
    assert (tmp_path / "warm_start" / "fingerprint.txt").exists()
