import time

import pytest

from onepath.train.metrics import MetricsLogger, Timer, format_header, format_row, format_value, read_metrics


def test_jsonl_round_trip(tmp_path):
    steps = [{"critic/score/mean": 0.25, "training/rollout_probs_diff_max": 0.0, "response_length/mean": 4},
             {"critic/score/mean": 0.5, "training/rollout_probs_diff_max": 3.1e-08, "actor/grad_norm": float("nan")}]
    with MetricsLogger(tmp_path / "run", tensorboard=False, console=False) as logger:
        for step, metrics in enumerate(steps, 1):
            logger.log(step, metrics)
            # flushed per line: a reader sees the step before the logger closes
            assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == step
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0] == {"step": 1, **steps[0]}
    assert records[1]["training/rollout_probs_diff_max"] == 3.1e-08
    assert records == read_metrics(tmp_path / "run")


def test_appends_on_resume_and_reports_bad_lines(tmp_path):
    for step in (1, 2):
        with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
            logger.log(step, {"x": float(step)})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "x"')
    with pytest.raises(ValueError, match=r"metrics.jsonl:3"):
        read_metrics(tmp_path)


def test_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(1, {"rollout_corr/k3_kl": 0.0})
        logger.log(2, {"rollout_corr/k3_kl": 1.5})
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rollout_corr/k3_kl")] == [(1, 0.0), (2, 1.5)]


def test_resumed_logger_replaces_rerun_steps_in_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    with MetricsLogger(tmp_path, console=False) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"critic/score/mean": float(step)})
    # killed after step 3, resumed from the step-1 checkpoint: steps 2 and 3 run again. Event files are
    # read in name order, and names carry the writer's start second: the resumed writer starts later.
    time.sleep(1.1)
    with MetricsLogger(tmp_path, console=False, purge_step=2) as logger:
        for step in (2, 3):
            logger.log(step, {"critic/score/mean": 10.0 * step})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("critic/score/mean")] == [(1, 1.0), (2, 20.0), (3, 30.0)]


def test_console_rows(tmp_path, capsys):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(25):
            logger.log(step, {"training/rollout_probs_diff_max": 0.0, "rollout_corr/k3_kl": 3.1e-08,
                              "perf/rollout_tokens_per_s": 12345.6, "extra/not_shown": 1.0})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 25 + 2  # a header every 20 rows
    assert lines[0] == lines[21] == format_header()
    assert len({len(line) for line in lines}) == 1  # fixed width
    cells = lines[1].split()
    assert cells[format_header().split().index("max|dp|")] == "0"
    assert cells[format_header().split().index("k3_kl")] == "3.10e-08"
    assert cells[format_header().split().index("tok/s")] == "12346"
    assert cells[format_header().split().index("pg_loss")] == "-"
    assert "not_shown" not in lines[0]


def test_console_every_n_steps_while_files_get_every_step(tmp_path, capsys):
    with MetricsLogger(tmp_path, tensorboard=False, console_every=5) as logger:
        for step in range(1, 13):
            logger.log(step, {"critic/score/mean": step / 10})
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows == ["1", "5", "10"]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 13))


@pytest.mark.parametrize("value, text", [
    (0.0, "0"), (-0.0, "0"), (0, "0"), (3.1e-08, "3.10e-08"), (-2.5e-12, "-2.50e-12"), (0.1234567, "0.1235"),
    (7, "7"), (12.0, "12"), (4.2e9, "4.20e+09"), (float("nan"), "nan"), (None, "-"),
])
def test_format_value(value, text):
    assert format_value(value) == text


def test_format_row_missing_metrics():
    assert format_row({"step": 3}).split() == ["3"] + ["-"] * 7


def test_timer():
    timer = Timer()
    with timer("gen"):
        time.sleep(0.01)
    with timer("gen"):
        time.sleep(0.01)
    with pytest.raises(RuntimeError):
        with timer("update"):
            raise RuntimeError
    metrics = timer.metrics()
    assert set(metrics) == {"timing_s/gen", "timing_s/update"}
    assert metrics["timing_s/gen"] >= 0.02
    assert timer.metrics() == {}


def test_timer_syncs_at_both_ends_of_a_block():
    events = []
    timer = Timer(sync=lambda: events.append("sync"))
    with timer("update"):
        events.append("work")
    assert events == ["sync", "work", "sync"] and set(timer.metrics()) == {"timing_s/update"}
