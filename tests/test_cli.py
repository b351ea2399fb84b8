import json

from onepath.cli import main

TINY = ["--warm_start.steps", "10", "--train.steps", "2", "--train.prompts_per_step", "4", "--rollout.n", "2",
        "--data.n_train", "40", "--data.n_test", "4", "--quiet"]


def test_train_both_modes_writes_the_run_directory(tmp_path, capsys):
    assert main(["train", "--mode", "both", "--out", str(tmp_path), *TINY]) == 0
    printed = capsys.readouterr().out
    assert "every diff metric exactly 0 on every step" in printed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["consistent"]["steps_with_diff_exactly_0"] == 2
    for mode in ("consistent", "baseline"):
        run = tmp_path / mode
        assert (run / "config.yaml").exists() and (run / "tb").is_dir()
        spec = json.loads((run / "spec.json").read_text())
        assert spec["spec"]["mode"] == mode and len(spec["hash"]) == 16
        assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "again.png")]) == 0
    assert "consistent: 2 steps, diff = 0 on 2" in capsys.readouterr().out
    assert main(["generate", str(tmp_path / "consistent" / "step_2"), "12+3=", "--rollout.max_tokens", "4",
                 "--rollout.max_model_len", "64"]) == 0
    assert "'12+3=' ->" in capsys.readouterr().out


def test_bad_override_is_a_clear_error(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path), "--train.lrr", "1e-3"]) == 2
    err = capsys.readouterr().err
    assert "train.lrr" in err and "valid keys" in err


def test_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nowhere"), "1+1="]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_a_shared_warm_start_gives_the_runs_of_the_embedded_model(tmp_path, capsys):
    """train.steps 0 prepares alone (the data and out/warm_start); a run from that checkpoint (model.path, no
    warm start of its own) trains exactly as the embedded model's run with its own warm start: the same seeds
    and data order, so several runs (bench/evidence.sh's four) can share one warm start."""
    from onepath.models.checkpoint import load_state_dict
    from onepath.train.metrics import read_metrics
    import torch
    shared = tmp_path / "shared"
    assert main(["train", "--out", str(shared), *TINY, "--train.steps", "0"]) == 0
    assert "no RL step" in capsys.readouterr().out
    assert (shared / "warm_start" / "model.safetensors").is_file() and not (shared / "metrics.jsonl").exists()
    assert main(["train", "--out", str(tmp_path / "own"), *TINY]) == 0
    assert main(["train", "--out", str(tmp_path / "from"), *TINY, "--model.path", str(shared / "warm_start"),
                 "--warm_start.steps", "0"]) == 0
    own, loaded = read_metrics(tmp_path / "own"), read_metrics(tmp_path / "from")
    keys = ("critic/score/mean", "training/rollout_probs_diff_max", "actor/pg_loss", "actor/grad_norm")
    assert [[m[k] for k in keys] for m in own] == [[m[k] for k in keys] for m in loaded]
    a, b = load_state_dict(tmp_path / "own" / "step_2"), load_state_dict(tmp_path / "from" / "step_2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
