import re
import json
import math

import pytest
import yaml
from matplotlib.image import imread

from onepath.train.report import LINTHRESH, draw_report, find_runs, moving_average, report_figure, report_summary
from onepath.train.summary import DIFF_KEYS, wall_time

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
    assert width > height > 0 and channels in (3, 4)  # two rows of three panels
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


def write_recipe_run(run, mode, kl, quant="fp8+fp8_kv", trainer_quant=None, train=(), entropy=True, val_every=0):
    """A run of the headline experiment: config.yaml and spec.json as the trainer writes them (older ones
    lack trainer_quant), per step timings, entropy and (every val_every steps) val/score."""
    run.mkdir(parents=True)
    records = []
    for step, diff in enumerate(kl, 1):
        m = {"step": step, **{k: diff for k in DIFF_KEYS}, "critic/score/mean": 0.1 * step,
             "perf/rollout_tokens_per_s": 2000.0, "timing_s/gen": 1.0, "timing_s/old_logprob": 0.25,
             "timing_s/update": 2.0, "timing_s/sync": 0.5, "timing_s/reward": 0.125, "timing_s/step": 4.0}
        if entropy:
            m["actor/entropy"] = 1.0 / step
        if val_every and step % val_every == 0:
            m.update({"val/score": 0.01 * step, "timing_s/val": 3.0})
        records.append(m)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in records))
    cfg = {"train": {"rollout_is": None, "rollout_rs": None, **dict(train)}, "mode": mode, "quant": quant}
    if trainer_quant is not None:
        cfg["trainer_quant"] = trainer_quant
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    specs = {"spec": {"mode": mode, "ops": {"linear": {"dtype": "float32"}}}}
    if trainer_quant is not None:  # the trainer's spec differs: "none" names its dtype
        specs["trainer_spec"] = {"mode": mode, "ops": {"linear": {"dtype": "bfloat16"}}}
    (run / "spec.json").write_text(json.dumps(specs))
    return run


@pytest.fixture
def recipe(tmp_path):
    """The four runs of the headline experiment, written in no particular order."""
    root = tmp_path / "recipe"
    small = [1e-6, 3e-4, 2e-3, 1e-2, 5e-2, 0.3]
    write_recipe_run(root / "b_mis", "baseline", small, trainer_quant="none", train={"rollout_rs": "token"},
                     entropy=False)
    write_recipe_run(root / "a_cons", "consistent", [0.0] * 6, val_every=2)
    write_recipe_run(root / "b_tis", "baseline", small, trainer_quant="none", train={"rollout_is": "token"},
                     val_every=3)
    write_recipe_run(root / "b", "baseline", small, trainer_quant="none", val_every=3)
    return root


RECIPE_LABELS = ["consistent (fp8+fp8_kv)", "baseline (fp8+fp8_kv rollout, bf16 trainer)",
                 "baseline+TIS (fp8+fp8_kv rollout, bf16 trainer)", "baseline+MIS (fp8+fp8_kv rollout, bf16 trainer)"]


def panels(fig) -> dict:
    """Panel name -> {run label: (x, y)} of the lines the legend names (thin per-step lines excluded)."""
    return {ax.get_label(): {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
                             for line in ax.get_lines() if not line.get_label().startswith("_")}
            for ax in fig.axes}


def test_recipe_figure_holds_each_run_in_order(recipe, tmp_path):
    fig = report_figure([recipe])
    drawn = panels(fig)
    assert set(drawn) == {"kl", "probs_diff", "reward", "entropy", "throughput", "val"}
    assert list(drawn["kl"]) == RECIPE_LABELS and list(drawn["reward"]) == RECIPE_LABELS
    consistent, baseline, tis, mis = RECIPE_LABELS
    assert drawn["kl"][consistent] == (list(range(1, 7)), [0.0] * 6)
    assert drawn["kl"][baseline][1] == [1e-6, 3e-4, 2e-3, 1e-2, 5e-2, 0.3]
    assert drawn["probs_diff"][mis][1] == [1e-6, 3e-4, 2e-3, 1e-2, 5e-2, 0.3]
    rewards = [0.1 * s for s in range(1, 7)]
    assert drawn["reward"][tis][1] == pytest.approx(moving_average(rewards, 5))
    thin = [line for line in fig.axes[2].get_lines() if line.get_label() == f"_{tis} per step"]
    assert list(thin[0].get_ydata()) == pytest.approx(rewards)
    assert drawn["entropy"][consistent] == (list(range(1, 7)), [1.0 / s for s in range(1, 7)])
    assert drawn["entropy"][mis] == ([], [])  # no actor/entropy logged: drawn empty, still in the legend
    assert drawn["throughput"][baseline][1] == [2.0] * 6  # tokens / ms
    assert drawn["val"][consistent] == ([2, 4, 6], [0.02, 0.04, 0.06])
    assert drawn["val"][tis] == ([3, 6], [0.03, 0.06]) and drawn["val"][mis] == ([], [])
    assert [t.get_text() for t in fig.legends[0].get_texts()] == RECIPE_LABELS
    # honest symlog: the exact zeros sit at 0, the smallest nonzero KL (1e-6) 14 decades above 1e-20
    kl = fig.axes[0]
    assert kl.get_yscale() == "symlog" and kl.yaxis.get_transform().linthresh == LINTHRESH
    zero, edge, small = kl.yaxis.get_transform().transform([0.0, LINTHRESH, 1e-6])
    assert zero == 0.0 and small > 13 * edge  # the linear region is one unit tall, a decade one more
    assert draw_report([recipe], tmp_path / "fig.png").read_bytes()[:8] == PNG_MAGIC


def test_recipe_labels_and_order_from_explicit_runs(recipe):
    runs = [recipe / "b_mis", recipe / "b", recipe / "a_cons", recipe / "b_tis"]
    assert list(report_summary(runs)) == RECIPE_LABELS
    assert find_runs([recipe]) == [recipe / "a_cons", recipe / "b", recipe / "b_tis", recipe / "b_mis"]


def test_labels_leave_formats_out_when_every_run_shares_them(tmp_path):
    # an older config.yaml without trainer_quant: the trainer runs the rollout's quant
    write_recipe_run(tmp_path / "c", "consistent", [0.0])
    write_recipe_run(tmp_path / "b", "baseline", [1e-7], train={"rollout_is": "sequence", "rollout_rs": "token"})
    write_recipe_run(tmp_path / "other", "baseline", [1e-7], trainer_quant="fp8")
    assert list(report_summary([tmp_path / "c", tmp_path / "b"])) == ["consistent", "baseline+TIS+MIS"]
    assert list(report_summary([tmp_path / "other", tmp_path / "c"])) == [
        "consistent (fp8+fp8_kv)", "baseline (fp8+fp8_kv rollout, fp8 trainer)"]


def test_runs_without_entropy_or_val_still_draw(tmp_path):
    write_recipe_run(tmp_path / "c", "consistent", [0.0] * 3, entropy=False)
    fig = report_figure([tmp_path])
    drawn = panels(fig)
    assert drawn["entropy"] == {"consistent": ([], [])} and drawn["val"] == {"consistent": ([], [])}
    assert drawn["kl"]["consistent"][1] == [0.0] * 3
    notes = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert notes == ["no run logged actor/entropy", "no run logged val/score"]


def test_wall_time_sums_the_steps_and_splits_them(recipe):
    summary = report_summary([recipe])
    wall = summary["baseline (fp8+fp8_kv rollout, bf16 trainer)"]["wall"]
    # 6 steps of 4 s (gen 1 + old_logprob 0.25 + update 2 + sync 0.5 + reward 0.125 + other 0.125), 2 vals of 3 s
    assert wall["total_s"] == 6 * 4.0 + 2 * 3.0
    assert wall["split_s"] == {"gen": 6.0, "old_logprob": 1.5, "update": 12.0, "sync": 3.0, "reward": 0.75,
                               "val": 6.0, "other": 0.75}
    assert math.isclose(sum(wall["split_s"].values()), wall["total_s"])
    no_val = summary["baseline+MIS (fp8+fp8_kv rollout, bf16 trainer)"]["wall"]
    assert no_val["total_s"] == 24.0 and "val" not in no_val["split_s"]
    assert wall_time([{"step": 1, "critic/score/mean": 0.0}]) is None  # a run that logged no timings


def test_bad_config_yaml_names_the_file(tmp_path):
    run = write_recipe_run(tmp_path / "run", "baseline", [0.0])
    (run / "config.yaml").write_text("train: [unclosed")
    with pytest.raises(ValueError, match=re.escape(f"{run / 'config.yaml'}: not YAML") + ".*delete it"):
        report_summary([run])
    (run / "config.yaml").write_text("- a list\n")
    with pytest.raises(ValueError, match="not a mapping of config sections"):
        report_summary([run])


def test_cli_report_prints_each_run_and_its_wall_time(recipe, tmp_path, capsys):
    from onepath.cli import main

    assert main(["report", str(recipe / "b"), str(recipe / "a_cons"), "--out", str(tmp_path / "fig.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("consistent (fp8+fp8_kv): 6 steps, diff = 0 on 6, max |dp| 0,")
    assert lines[0].endswith("val 0.060")
    assert lines[1] == ("  wall 33.0 s = gen 6.0 + old_logprob 1.5 + update 12.0 + sync 3.0 + reward 0.8 + val 9.0 "
                        "+ other 0.8")
    assert lines[2].startswith("baseline (fp8+fp8_kv rollout, bf16 trainer): 6 steps, diff = 0 on 0")
    assert lines[-1] == f"wrote {tmp_path / 'fig.png'}"
