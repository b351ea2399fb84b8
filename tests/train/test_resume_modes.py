"""Resuming one mode of a `--mode both` run: it finds that mode's checkpoints in DIR/MODE, and the other
mode's results (its files, its entry in summary.json) stay; a run of another mode in DIR is refused."""
import json

from onepath.cli import main
from onepath.train import checkpoint
from onepath.train.metrics import read_metrics

TINY = ["--quiet", "--warm_start.steps", "0", "--train.prompts_per_step", "4", "--rollout.n", "2",
        "--data.n_train", "40", "--data.n_test", "4"]


def train(out, *extra) -> int:
    return main(["train", "--out", str(out), *TINY, *extra])


def test_resuming_one_mode_of_a_both_run_continues_it_and_keeps_the_other(tmp_path, capsys):
    assert train(tmp_path, "--mode", "both", "--train.steps", "2") == 0
    baseline = (tmp_path / "baseline" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert train(tmp_path, "--mode", "consistent", "--train.steps", "3", "--resume") == 0
    printed = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'consistent' / 'step_2'}" in printed and "starting at step 1" not in printed
    assert not checkpoint.complete_steps(tmp_path) and not (tmp_path / "metrics.jsonl").exists()  # not beside them
    assert [r["step"] for r in read_metrics(tmp_path / "consistent")] == [1, 2, 3]
    assert (tmp_path / "baseline" / "metrics.jsonl").read_text() == baseline
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["consistent"]["steps"], summary["baseline"]["steps"]) == (3, 2)
    assert main(["report", str(tmp_path)]) == 0  # report.png, drawn from both modes' directories
    assert "baseline: 2 steps" in capsys.readouterr().out

    # a fresh start of that mode must not replace the checkpoints it has there
    assert train(tmp_path, "--mode", "baseline", "--train.steps", "3") == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'baseline'} holds checkpoints of an earlier run" in err and "--resume" in err


def test_one_mode_resumed_while_the_other_logged_no_step_yet(tmp_path, capsys):
    assert train(tmp_path, "--mode", "both", "--train.steps", "1") == 0
    for step in (tmp_path / "baseline").glob("step_*"):  # as if killed in the baseline's first step
        step.rename(step.with_name(f".{step.name}.tmp-dead"))
    (tmp_path / "baseline" / "metrics.jsonl").write_text("")
    assert train(tmp_path, "--mode", "consistent", "--train.steps", "2", "--resume") == 0
    assert list(json.loads((tmp_path / "summary.json").read_text())) == ["consistent", "wall_seconds"]
    assert "report: " in capsys.readouterr().out and (tmp_path / "report.png").is_file()


def test_a_run_of_another_mode_in_the_directory_is_refused(tmp_path, capsys):
    assert train(tmp_path, "--mode", "consistent", "--train.steps", "1") == 0
    metrics, summary = (tmp_path / "metrics.jsonl").read_text(), (tmp_path / "summary.json").read_text()
    capsys.readouterr()
    for mode in ("baseline", "both"):
        assert train(tmp_path, "--mode", mode, "--train.steps", "2", "--resume") == 2
        err = capsys.readouterr().err
        assert (f"{tmp_path} holds a --mode consistent run: resume it with --mode consistent, or give the --mode "
                f"{mode} run another --out") in err
    assert (tmp_path / "metrics.jsonl").read_text() == metrics and (tmp_path / "summary.json").read_text() == summary
    assert not (tmp_path / "baseline").exists() and not (tmp_path / "consistent").exists()


def test_resume_with_no_checkpoint_starts_at_step_1_and_says_so(tmp_path, capsys):
    # nothing was saved, so nothing is lost: a run killed before its first checkpoint restarts with --resume
    assert train(tmp_path / "new", "--train.steps", "1", "--resume") == 0
    assert (f"--resume: no complete step_N checkpoint in {tmp_path / 'new'}: nothing to resume, starting at step 1"
            in capsys.readouterr().out)
