"""Checkpoints and resume: a run killed at any moment and resumed ends bit for bit where an
uninterrupted run with the same seed ends, with the same metrics on every step."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from onepath.cli import main
from onepath.config import load_run_config
from onepath.numerics.diff import is_exact
from onepath.models.checkpoint import load_state_dict
from onepath.numerics.spec import ExecutionSpec, OpSpec
from onepath.train import checkpoint
from onepath.train.metrics import read_metrics
from onepath.train.trainer import GRPOTrainer, prepare

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10
TINY = ["--warm_start.steps", "20", "--train.prompts_per_step", "4", "--rollout.n", "4", "--data.n_train", "64",
        "--data.n_test", "8", "--rollout.top_p", "0.9", "--train.save_every", "1"]
# a run that SIGKILLs itself while writing step_2's trainer state, its weights already in the temporary dir
KILLED_MID_WRITE = """
import os, signal, sys, torch
save = torch.save
def killed_in_step_2(obj, f, *args, **kwargs):
    if "step_2" in str(f):
        os.kill(os.getpid(), signal.SIGKILL)
    return save(obj, f, *args, **kwargs)
torch.save = killed_in_step_2
from onepath.cli import main
sys.exit(main(sys.argv[1:]))
"""


def command(out: Path, reward: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "onepath.cli", "train", "--threads", "1", "--quiet", "--out", str(out),
            "--train.steps", str(STEPS), "--train.reward", reward, *TINY, *extra]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def train(out: Path, reward: str, *extra: str):
    done = subprocess.run(command(out, reward, *extra), cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def kill_after_a_checkpoint(out: Path, reward: str, after: int, delay: float, *extra: str) -> int:
    """Start a run, SIGKILL it `delay` s after a checkpoint past step `after` appears; the latest complete step.
    A step takes about 50 ms here, so a delay in [0, 50 ms) lands anywhere in the next step: rollout,
    update, sync, or the checkpoint write."""
    proc = subprocess.Popen(command(out, reward, *extra), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not checkpoint.complete_steps(out) or checkpoint.complete_steps(out)[-1] <= after:
        assert proc.poll() is None, f"the run ended before a checkpoint past step {after}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "no checkpoint within 60 s"
        time.sleep(0.005)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, f"the run ended by itself before the kill (delay {delay:.3f} s)"
    return checkpoint.complete_steps(out)[-1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, reward) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    train(out, reward)
    return out


def assert_same_run(out: Path, reference: Path):
    final, expected = load_state_dict(out / f"step_{STEPS}"), load_state_dict(reference / f"step_{STEPS}")
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    records, reference_records = read_metrics(out), read_metrics(reference)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once: the lost tail was cut
    for got, want in zip(records, reference_records):
        assert is_exact(got), got
        same = {k for k in want if not k.startswith(("timing_s/", "perf/"))}
        assert {k: got[k] for k in same} == {k: want[k] for k in same}, got["step"]


def test_sigkill_at_a_random_moment_then_resume_ends_with_the_same_bits(tmp_path, reward, uninterrupted):
    rng = random.Random()
    after, delays = [rng.randint(0, 2), rng.randint(0, 1)], [rng.uniform(0, 0.05), rng.uniform(0, 0.05)]
    print(f"kills after step {after} + {delays} s")  # shown on failure, to replay the moments
    out = tmp_path / "killed"
    first = kill_after_a_checkpoint(out, reward, after[0], delays[0])
    second = kill_after_a_checkpoint(out, reward, first + after[1], delays[1], "--resume")
    assert first < second < STEPS, (first, second, after, delays)
    train(out, reward, "--resume")
    assert_same_run(out, uninterrupted)
    assert checkpoint.complete_steps(out) == [STEPS - 1, STEPS]  # keep_last 2


def test_killed_mid_write_the_partial_checkpoint_is_never_used(tmp_path, reward, uninterrupted):
    out = tmp_path / "mid_write"
    done = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, *command(out, reward)[3:]], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    partial = [p.name for p in out.iterdir() if p.name.startswith(".step_2.tmp-")]
    assert len(partial) == 1 and (out / partial[0] / "model.safetensors").exists()
    assert not (out / "step_2").exists() and checkpoint.complete_steps(out) == [1]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]  # step 2 was logged, its checkpoint lost
    train(out, reward, "--resume")
    assert not any(p.name.startswith(".") for p in out.iterdir())
    assert_same_run(out, uninterrupted)


def test_rewind_cuts_the_lost_steps_and_a_partial_last_line(tmp_path):
    lines = [json.dumps({"step": s, "critic/score/mean": s / 10}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "critic/sc')
    assert [r["step"] for r in checkpoint.rewind_metrics(tmp_path, 2)] == [1, 2]
    assert (tmp_path / "metrics.jsonl").read_text() == "\n".join(lines[:2]) + "\n"
    (tmp_path / "metrics.jsonl").write_text(lines[0] + "\n{oops\n" + lines[1] + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        checkpoint.rewind_metrics(tmp_path, 2)


def tiny_cfg(out: Path, steps: int, reward: str, *extra: str):
    return load_run_config(None, ["--warm_start.steps", "0", "--train.steps", str(steps), "--train.save_every", "1",
                                  "--train.prompts_per_step", "4", "--rollout.n", "4", "--data.n_train", "64",
                                  "--data.n_test", "8", "--train.reward", reward, "--out", str(out), *extra])


def policy_weights(trainer: GRPOTrainer) -> dict:
    return {k: v.clone() for k, v in trainer.policy.state_dict().items()}


def skip(part: str):
    """GRPOTrainer.restore that leaves one part of the trainer state fresh (negative control)."""
    def restore(self, state, tensors):
        if part != "optimizer":
            self.actor.load_optimizer_state(tensors["optimizer"])
        else:
            self.actor.schedule.load_state_dict(tensors["optimizer"]["schedule"])
        if part != "sampler":
            self.sampler.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(tensors["rng"])
    return restore


@pytest.mark.parametrize("missing", [None, "optimizer", "sampler"])
def test_first_step_after_restore_has_diff_zero_and_continues_the_run(tmp_path, reward, monkeypatch, missing):
    setup = prepare(tiny_cfg(tmp_path, 3, reward), tmp_path, progress=False)
    whole = GRPOTrainer(tiny_cfg(tmp_path, 3, reward), "consistent", setup, tmp_path / "whole")
    whole.run(progress=False)
    GRPOTrainer(tiny_cfg(tmp_path, 2, reward), "consistent", setup, tmp_path / "split").run(progress=False)
    if missing:
        monkeypatch.setattr(GRPOTrainer, "restore", skip(missing))
    resumed = GRPOTrainer(tiny_cfg(tmp_path, 3, reward), "consistent", setup, tmp_path / "split", resume=True)
    saved = load_state_dict(tmp_path / "split" / "step_2")
    engine = dict(resumed.engine.model.named_parameters())
    for name, p in resumed.policy.named_parameters():  # both sides hold the checkpoint's weights
        assert torch.equal(p, engine[name]) and torch.equal(p, saved[name])
    history = resumed.run(progress=False)
    assert len(history) == 3 and is_exact(history[-1]), history[-1]
    expected, got = policy_weights(whole), policy_weights(resumed)
    same = all(torch.equal(got[k], expected[k]) for k in expected)
    assert same == (missing is None), f"restored without its {missing}, yet the run matched: the test is blind"


def test_mismatched_checkpoint_is_a_clear_error(tmp_path, reward, monkeypatch):
    setup = prepare(tiny_cfg(tmp_path, 2, reward), tmp_path, progress=False)
    run_dir = tmp_path / "run"
    GRPOTrainer(tiny_cfg(tmp_path, 2, reward), "consistent", setup, run_dir).run(progress=False)
    with pytest.raises(ValueError, match=r"step_2 was written with other settings \(train.lr 0.0005 -> 0.001\)"):
        GRPOTrainer(tiny_cfg(tmp_path, 3, reward, "--train.lr", "1e-3"), "consistent", setup, run_dir, resume=True)
    with pytest.raises(ValueError, match=r"step_2 is past train.steps = 1: raise --train.steps to at least 2"):
        GRPOTrainer(tiny_cfg(tmp_path, 1, reward), "consistent", setup, run_dir, resume=True)
    with pytest.raises(ValueError, match=r"step_2 is a checkpoint of a --mode consistent run, not of --mode baseline: "
                                         r"resume it with --mode consistent"):
        GRPOTrainer(tiny_cfg(tmp_path, 3, reward), "baseline", setup, run_dir, resume=True)
    may_change = tiny_cfg(tmp_path, 3, reward, "--rollout.max_num_seqs", "3", "--train.keep_last", "1")
    GRPOTrainer(may_change, "consistent", setup, run_dir, resume=True)  # capacity knobs, what to keep, how far
    other = prepare(tiny_cfg(tmp_path, 3, reward, "--model.intermediate_size", "96"), tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"step_2 holds a different model .*intermediate_size 192 -> 96"):
        GRPOTrainer(tiny_cfg(tmp_path, 3, reward, "--model.intermediate_size", "96"), "consistent", other, run_dir,
                    resume=True)
    monkeypatch.setattr(ExecutionSpec, "default",  # what a change to the numeric contract in code looks like
                        lambda mode, device, quant=None: ExecutionSpec(mode, device, {"linear": OpSpec(row_chunk=8)}))
    with pytest.raises(ValueError, match=r"step_2 was written under ExecutionSpec \w+ \(consistent, cpu\), this run's "
                                         r"is \w+ .*the numeric contract changed"):
        GRPOTrainer(tiny_cfg(tmp_path, 3, reward), "consistent", setup, run_dir, resume=True)


def test_cli_resume_both_modes_and_run_directory_rules(tmp_path, capsys):
    args = ["train", "--quiet", "--mode", "both", "--out", str(tmp_path), "--warm_start.steps", "0",
            "--train.prompts_per_step", "4", "--rollout.n", "2", "--data.n_train", "40", "--data.n_test", "4"]
    assert main([*args, "--train.steps", "2"]) == 0
    assert [p.name for p in sorted((tmp_path / "consistent").glob("step_*"))] == ["step_2"]  # save_every 0: the end
    capsys.readouterr()
    assert main([*args, "--train.steps", "2"]) == 2  # a fresh start must not mix with an earlier run's checkpoints
    err = capsys.readouterr().err
    assert str(tmp_path / "consistent") in err and "--resume" in err
    for step in (tmp_path / "baseline").glob("step_*"):  # as if killed before the baseline run's first checkpoint
        os.rename(step, step.with_name(f".{step.name}.tmp-dead"))
    assert main([*args, "--train.steps", "3", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and f"no complete step_N checkpoint in {tmp_path / 'baseline'}" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["consistent"]["steps"] == summary["baseline"]["steps"] == 3
    for mode in ("consistent", "baseline"):
        assert [r["step"] for r in read_metrics(tmp_path / mode)] == [1, 2, 3]
        assert checkpoint.complete_steps(tmp_path / mode) == ([2, 3] if mode == "consistent" else [3])
