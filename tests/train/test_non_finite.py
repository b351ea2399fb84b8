"""A NaN or inf in a step (reward, log-prob, loss, gradient) stops the run with an error naming the
step and the value's source, before the weights change: the last checkpoint stays intact, and the
summary never blames the consistency contract."""
import math
import re

import pytest
import torch

from onepath.cli import main
from onepath.config import load_run_config
from onepath.models.checkpoint import load_state_dict
from onepath.train import trainer as trainer_module
from onepath.train.grpo import NonFiniteError
from onepath.train.trainer import GRPOTrainer, prepare

P, N = 4, 2  # prompts per step, samples per prompt
TINY = ["--warm_start.steps", "0", "--train.steps", "3", "--train.prompts_per_step", str(P), "--rollout.n", str(N),
        "--data.n_train", "32", "--data.n_test", "4", "--train.val_every", "0"]
# the reward check at start calls the reward once, each step P * N times: from the second step on it is `bad`
LATE = ("import math\ncalls = 0\n\ndef late(prompt, completion, **row):\n    global calls\n    calls += 1\n"
        f"    return {{bad}} if calls > 1 + {P * N} else float(len(completion))\n")


def reward_file(tmp_path, bad: str) -> str:
    path = tmp_path / "late.py"
    path.write_text(LATE.format(bad=bad))
    return f"{path}:late"


def trainer_for(tmp_path, *extra) -> GRPOTrainer:
    cfg = load_run_config(None, [*TINY, "--out", str(tmp_path), *extra])
    return GRPOTrainer(cfg, "consistent", prepare(cfg, tmp_path, progress=False), tmp_path / "run")


def weights(trainer: GRPOTrainer) -> dict:
    return {k: v.clone() for k, v in trainer.policy.hf_state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bad, shown", [("math.nan", "nan"), ("math.inf", "inf"), ("'yes'", "'yes' (a str)")])
def test_a_bad_reward_stops_the_step_before_the_weights_change(tmp_path, bad, shown):
    trainer = trainer_for(tmp_path, "--train.reward", reward_file(tmp_path, bad), "--train.save_every", "1")
    with pytest.raises(NonFiniteError, match=rf"^step 2: reward of sample 0 \(prompt row \d+\) is {re.escape(shown)}.*"
                                             "the reward function .*late.py:late. must return a finite float"):
        trainer.run(progress=False)
    assert isinstance(NonFiniteError("x"), ValueError)
    saved = load_state_dict(tmp_path / "run" / "step_1")
    assert same(weights(trainer), saved)  # nothing of step 2 was applied: step_1 is the run's state


def test_the_cli_ends_with_the_cause_not_a_contract_verdict(tmp_path, capsys):
    args = ["train", "--quiet", "--out", str(tmp_path), *TINY, "--train.reward", reward_file(tmp_path, "math.nan")]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("onepath train: error: step 2: reward of sample 0")
    assert "DIFF" not in captured.out + captured.err and not (tmp_path / "summary.json").exists()


def test_nan_log_probs_stop_the_step(tmp_path):
    trainer = trainer_for(tmp_path)
    with torch.no_grad():
        next(trainer.policy.parameters()).fill_(math.nan)  # the trainer's copy only: the engine samples fine
    with pytest.raises(NonFiniteError, match=r"^step 1: the trainer's log-prob of sample 0 \(token 0\) is nan"):
        trainer.run(progress=False)
    assert not trainer.actor.optimizer.state  # no AdamW step was taken


def test_a_nan_loss_stops_the_step(tmp_path, monkeypatch):
    def nan_loss(*args, **kwargs):
        loss, stats = policy_loss(*args, **kwargs)
        return loss * math.nan, {**stats, "actor/pg_loss": math.nan}

    policy_loss = trainer_module.policy_loss
    monkeypatch.setattr(trainer_module, "policy_loss", nan_loss)
    trainer = trainer_for(tmp_path)
    before = weights(trainer)
    with pytest.raises(NonFiniteError, match=r"^step 1: the policy loss is nan: the rewards and log-probs are finite"):
        trainer.run(progress=False)
    assert same(weights(trainer), before) and not trainer.actor.optimizer.state


def test_a_nan_gradient_stops_the_step(tmp_path):
    trainer = trainer_for(tmp_path)
    before = weights(trainer)
    next(trainer.policy.parameters()).register_hook(lambda grad: grad * math.nan)
    with pytest.raises(NonFiniteError, match=r"^step 1: the gradient norm is nan: .*weights were left unchanged"):
        trainer.run(progress=False)
    assert same(weights(trainer), before) and not trainer.actor.optimizer.state


def test_finite_steps_pass_the_checks(tmp_path):
    """Negative control: the checks stop nothing that is finite; a bool or int reward counts as a number."""
    path = tmp_path / "flag.py"
    path.write_text("def flag(prompt, completion, **row):\n    return completion.strip() == '1' or 0\n")
    history = trainer_for(tmp_path, "--train.reward", f"{path}:flag").run(progress=False)
    assert len(history) == 3 and all(math.isfinite(m["actor/grad_norm"]) for m in history)
