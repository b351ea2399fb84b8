"""GRPO on multi-turn calculator episodes (rollout.env): in consistent mode every step's diff over
the policy tokens is exactly 0, with later turns served from the prefix cache; the baseline backend
reports a diff (negative control)."""
import pytest

from onepath.config import load_run_config
from onepath.numerics.diff import is_exact
from onepath.train.trainer import GRPOTrainer, prepare


def multiturn_run(mode, tmp_path, reward):
    cfg = load_run_config(None, ["--warm_start.steps", "5", "--train.steps", "2", "--train.prompts_per_step", "4",
                                 "--rollout.n", "4", "--data.n_train", "64", "--data.n_test", "8",
                                 "--rollout.env", "calculator", "--rollout.max_turns", "3",
                                 "--rollout.block_size", "4", "--rollout.top_p", "0.9", "--train.reward", reward,
                                 "--mode", mode, "--out", str(tmp_path)])
    setup = prepare(cfg, tmp_path, progress=False)
    return GRPOTrainer(cfg, mode, setup, tmp_path / mode).run(progress=False)


def test_multiturn_grpo_keeps_diff_exactly_zero(tmp_path, reward):
    history = multiturn_run("consistent", tmp_path, reward)
    assert len(history) == 2
    for m in history:
        assert is_exact(m), m
        assert m["rollout_corr/valid_tokens"] > 0
        assert m["response_length/mean"] == m["episode/policy_tokens/mean"]
    assert sum(m["episode/turns/mean"] for m in history) / len(history) > 1
    assert any(m["episode/env_tokens/mean"] > 0 for m in history)
    assert any(m["perf/prefix_cache_hit_tokens"] > 0 for m in history)


def test_multiturn_negative_control_baseline_reports_a_diff(tmp_path, reward):
    history = multiturn_run("baseline", tmp_path, reward)
    assert any(m["training/rollout_probs_diff_max"] > 0 for m in history)


@pytest.mark.parametrize("overrides, match", [
    (["--rollout.env", "shell"], r"rollout.env = 'shell' is not an environment: use one of calculator"),
    (["--rollout.max_turns", "0"], r"rollout.max_turns = 0 must be >= 1"),
])
def test_multiturn_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_run_config(None, overrides)
