import re
import json

import pytest
from matplotlib.image import imread

from onepath.train.report import draw_report, find_runs, moving_average, report_summary
from onepath.train.summary import DIFF_KEYS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run, mode, diffs, rewards, spec=True):
    """A run dir as `onepath train` leaves it: per step every diff metric = that step's diff."""
    run.mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:
        for step, (diff, reward) in enumerate(zip(diffs, rewards), 1):
            f.write(json.dumps({"step": step, **{k: diff for k in DIFF_KEYS}, "critic/score/mean": reward,
                                "perf/rollout_tokens_per_s": 1000.0 * step}) + "\n")
    if spec:
        (run / "spec.json").write_text(json.dumps({"hash": "0" * 16, "spec": {"mode": mode, "device": "cpu"}}))
    return run


@pytest.fixture
def demo(tmp_path):
    # directory names differ from the modes: labels must come from spec.json
    write_run(tmp_path / "demo" / "run_a", "consistent", [0.0] * 7, [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    write_run(tmp_path / "demo" / "run_b", "baseline", [0.0, 1e-7, 3e-8, 0.0, 2.5e-7, 1e-18, 0.0],
              [0.0, 0.0, 0.1, 0.1, 0.2, 0.2, 0.3])
    return tmp_path / "demo"


def test_summary_numbers(demo):
    summary = report_summary([demo / "run_a", demo / "run_b"])
    assert list(summary) == ["consistent", "baseline"]
    c, b = summary["consistent"], summary["baseline"]
    assert (c["steps"], c["steps_with_diff_exactly_0"], c["max_probs_diff"]) == (7, 7, 0.0)
    assert (b["steps"], b["steps_with_diff_exactly_0"], b["max_probs_diff"]) == (7, 3, 2.5e-7)
    assert b["max_k3_kl"] == 2.5e-7
    assert c["reward_first5"] == pytest.approx(0.2) and c["reward_last5"] == pytest.approx(0.4)
    assert b["reward_first5"] == pytest.approx(0.08) and b["reward_last5"] == pytest.approx(0.18)
    assert b["run_dir"] == str(demo / "run_b")


def test_draws_a_png(demo, tmp_path):
    path = draw_report([demo / "run_a", demo / "run_b"], tmp_path / "out")
    assert path == tmp_path / "out" / "report.png"
    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width, channels = imread(path).shape
    assert width > 2 * height > 0 and channels in (3, 4)  # three panels side by side
    assert draw_report([demo], tmp_path / "named.png") == tmp_path / "named.png"
    assert (tmp_path / "named.png").read_bytes()[:8] == PNG_MAGIC


def test_parent_dir_finds_runs_consistent_first(demo):
    assert find_runs([demo]) == [demo / "run_a", demo / "run_b"]
    assert report_summary([demo]) == report_summary([demo / "run_b", demo / "run_a"])
    assert find_runs([demo / "run_b" / "metrics.jsonl"]) == [demo / "run_b"]


def test_labels_without_spec_or_with_one_mode_twice(tmp_path):
    write_run(tmp_path / "seed1", "consistent", [0.0], [0.5])
    write_run(tmp_path / "seed2", "consistent", [0.0], [0.5])
    write_run(tmp_path / "old", None, [0.0], [0.5], spec=False)
    assert list(report_summary([tmp_path])) == ["consistent (seed1)", "consistent (seed2)", "old"]


def test_missing_metrics_names_the_path(tmp_path, demo):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "nowhere"):
        with pytest.raises(FileNotFoundError, match=re.escape(f"{path}: no metrics.jsonl") + ".*onepath train"):
            draw_report([demo, path], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_incomplete_metrics_are_named(tmp_path):
    run = write_run(tmp_path / "run", "baseline", [0.0], [0.5])
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/score/mean": 0.5}) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl step 1 lacks perf/rollout_tokens_per_s"):
        report_summary([run])
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"has no steps yet"):
        report_summary([run])


def test_moving_average():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0] * 3, 5) == [2.0] * 3
    assert moving_average([], 5) == []
