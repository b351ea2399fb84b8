"""The supervised warm start belongs to the embedded model: warm_start.steps null (the default, and
demo.yaml's) means 450 steps there and none with model.path; an explicit value is obeyed. Whatever
runs is announced in a line."""
from pathlib import Path

import pytest
import torch

from onepath.config import RunConfig, WarmStartSection, load_run_config
from onepath.models.checkpoint import save_checkpoint
from onepath.train.trainer import prepare

DEMO = Path(__file__).resolve().parents[2] / "onepath" / "configs" / "demo.yaml"
TINY = ["--data.n_train", "32", "--data.n_test", "0", "--warm_start.batch_size", "4"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A checkpoint directory: the embedded model's initial weights, as a user's model.path."""
    out = tmp_path_factory.mktemp("made")
    setup = prepare(load_run_config(None, [*TINY, "--warm_start.steps", "0", "--out", str(out)]), out, progress=False)
    path = out / "ckpt"
    save_checkpoint(path, setup.init_state, setup.model_config, setup.tokenizer, setup.tokenizer_config)
    return path


@pytest.mark.parametrize("config", [None, DEMO])
def test_steps_resolve_to_450_on_the_embedded_model_and_0_with_model_path(config):
    embedded = load_run_config(config)
    assert embedded.warm_start.steps == WarmStartSection.EMBEDDED_STEPS == 450
    # the warm start's fingerprint reads this section: the demo's cached warm start and numbers stay
    assert embedded.to_dict()["warm_start"] == {"steps": 450, "batch_size": 64, "lr": 3e-3, "seed": 0,
                                                 "own_rows": 0}
    assert load_run_config(config, ["--model.path", "ckpt"]).warm_start.steps == 0
    assert load_run_config(config, ["--model.path", "ckpt", "--warm_start.steps", "7"]).warm_start.steps == 7
    assert load_run_config(config, ["--warm_start.steps", "0"]).warm_start.steps == 0
    assert RunConfig.from_dict(embedded.to_dict()) == embedded


def test_a_checkpoint_is_not_fine_tuned_unless_asked(ckpt, tmp_path, capsys):
    cfg = load_run_config(DEMO, [*TINY, "--model.path", str(ckpt), "--out", str(tmp_path)])
    setup = prepare(cfg, tmp_path, progress=False)
    assert "no warm start: model.path given; set --warm_start.steps N to ask for one" in capsys.readouterr().out
    assert not (tmp_path / "warm_start").exists()
    made = prepare(load_run_config(None, [*TINY, "--warm_start.steps", "0", "--out", str(tmp_path / "e")]),
                   tmp_path / "e", progress=False).init_state
    assert made.keys() == setup.init_state.keys()
    assert all(torch.equal(made[k], setup.init_state[k]) for k in made)  # the checkpoint's weights, untouched


def test_an_explicit_warm_start_on_a_checkpoint_is_obeyed_and_announced(ckpt, tmp_path, capsys):
    cfg = load_run_config(DEMO, [*TINY, "--model.path", str(ckpt), "--warm_start.steps", "3", "--out", str(tmp_path)])
    prepare(cfg, tmp_path, progress=False)
    assert f"warm start: 3 steps on the dataset's answers (model.path {ckpt})" in capsys.readouterr().out
    assert (tmp_path / "warm_start" / "fingerprint.txt").exists()


def test_the_embedded_warm_start_is_announced_and_its_reuse_too(tmp_path, capsys):
    cfg = load_run_config(DEMO, [*TINY, "--warm_start.steps", "3", "--out", str(tmp_path)])
    prepare(cfg, tmp_path, progress=False)
    assert "warm start: 3 steps on the dataset's answers (the embedded model)\n" in capsys.readouterr().out
    prepare(cfg, tmp_path, progress=False)
    assert "(the embedded model), reused from" in capsys.readouterr().out
    prepare(load_run_config(DEMO, [*TINY, "--warm_start.steps", "0", "--out", str(tmp_path)]), tmp_path, progress=False)
    assert "no warm start: warm_start.steps is 0" in capsys.readouterr().out


def test_own_rows_keeps_the_last_rows_for_the_warm_start_and_the_rl_never_draws_them(tmp_path, monkeypatch):
    import onepath.train.trainer as trainer
    seen = {}
    real = trainer.warm_start

    def spy(model, examples, *args, **kwargs):
        seen["examples"] = examples
        return real(model, examples, *args, **kwargs)

    monkeypatch.setattr(trainer, "warm_start", spy)
    shared = prepare(load_run_config(None, [*TINY, "--warm_start.steps", "0", "--out", str(tmp_path / "a")]),
                     tmp_path / "a", progress=False).train_rows
    cfg = load_run_config(None, [*TINY, "--warm_start.steps", "2", "--warm_start.own_rows", "12",
                                 "--out", str(tmp_path / "b")])
    setup = prepare(cfg, tmp_path / "b", progress=False)
    assert setup.train_rows == shared[:20]  # the RL's rows: the first 32 - 12
    warm = [setup.prompts.ids(row) for row in shared[20:]]
    assert [p for p, _ in seen["examples"]] == warm  # the warm start's: the last 12, and only they
    assert not {tuple(p) for p in warm} & {tuple(setup.prompts.ids(row)) for row in setup.train_rows}
    # the split holds when a run starts from a saved warm start (steps 0)
    again = prepare(load_run_config(None, [*TINY, "--warm_start.steps", "0", "--warm_start.own_rows", "12",
                                           "--out", str(tmp_path / "c")]), tmp_path / "c", progress=False)
    assert again.train_rows == shared[:20]
    with pytest.raises(ValueError, match=r"warm_start.own_rows = 32 leaves none of the 32 training rows"):
        prepare(load_run_config(None, [*TINY, "--warm_start.own_rows", "32", "--out", str(tmp_path / "d")]),
                tmp_path / "d", progress=False)
    with pytest.raises(ValueError, match="own_rows"):
        load_run_config(None, ["--warm_start.own_rows", "-1"])
