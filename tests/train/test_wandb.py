"""logger.wandb: every step's metrics.jsonl record goes to W&B too (a fake `wandb` module stands in);
without wandb installed the run stops before any work, naming `pip install wandb`."""
import sys
import types

import pytest

from onepath.config import load_run_config
from onepath.train.metrics import read_metrics
from onepath.train.trainer import GRPOTrainer, prepare


class FakeRun:
    def __init__(self, **kwargs):
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, data, step=None):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished = True


def fake_wandb() -> types.ModuleType:
    module = types.ModuleType("wandb")
    module.runs = []
    module.init = lambda **kwargs: module.runs.append(FakeRun(**kwargs)) or module.runs[-1]
    return module


def config(tmp_path, *extra):
    return load_run_config(None, ["--warm_start.steps", "0", "--train.steps", "2", "--train.prompts_per_step", "2",
                                  "--rollout.n", "4", "--data.n_train", "32", "--data.n_test", "4",
                                  "--train.val_every", "2", "--out", str(tmp_path / "demo"), *extra])


def test_each_step_logs_the_metrics_record_to_wandb(tmp_path, monkeypatch):
    wandb = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    cfg = config(tmp_path, "--logger.wandb", "true", "--logger.project", "arith")
    setup = prepare(cfg, tmp_path, progress=False)
    for mode in ("consistent", "baseline"):
        GRPOTrainer(cfg, mode, setup, tmp_path / "demo" / mode).run(progress=False)
    first, second = wandb.runs
    assert first.kwargs["project"] == "arith" and first.kwargs["name"] == "demo-consistent"
    assert second.kwargs["name"] == "demo-baseline" and first.kwargs["group"] == second.kwargs["group"] == "demo"
    assert first.kwargs["config"]["train"]["steps"] == 2 and first.kwargs["id"] != second.kwargs["id"]
    records = read_metrics(tmp_path / "demo" / "consistent")
    assert first.logged == [(r["step"], {k: v for k, v in r.items() if k != "step"}) for r in records]
    assert "val/score" in first.logged[1][1] and first.finished and second.finished


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    wandb = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    cfg = config(tmp_path, "--logger.wandb", "true", "--train.save_every", "1")
    setup = prepare(cfg, tmp_path, progress=False)
    GRPOTrainer(cfg, "consistent", setup, tmp_path / "run").run(progress=False)
    cfg = config(tmp_path, "--logger.wandb", "true", "--train.save_every", "1", "--train.steps", "3")
    GRPOTrainer(cfg, "consistent", setup, tmp_path / "run", resume=True).run(progress=False)
    first, resumed = wandb.runs
    assert resumed.kwargs["id"] == first.kwargs["id"] and resumed.kwargs["resume"] == "allow"
    assert [step for step, _ in resumed.logged] == [3]


def test_wandb_missing_stops_the_run_before_the_warm_start(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    cfg = config(tmp_path, "--logger.wandb", "true", "--warm_start.steps", "5")
    with pytest.raises(RuntimeError, match="pip install wandb"):
        prepare(cfg, tmp_path, progress=False)
    assert not (tmp_path / "warm_start").exists()


def test_wandb_off_imports_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = config(tmp_path, "--train.steps", "1")
    GRPOTrainer(cfg, "consistent", prepare(cfg, tmp_path, progress=False), tmp_path / "run").run(progress=False)
