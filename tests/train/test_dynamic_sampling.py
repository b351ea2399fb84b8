"""DAPO dynamic sampling (train.filter_groups): groups whose rewards are all equal are dropped and more
prompts rolled out until the step holds prompts_per_step groups (at most train.max_gen_batches rollouts);
the kept samples still have diff = 0. Control: without it the same run trains on such groups."""
import pytest
import torch

from onepath.config import load_run_config
from onepath.numerics.diff import is_exact
from onepath.train.trainer import GRPOTrainer, prepare

ARGS = ["--warm_start.steps", "60", "--train.steps", "2", "--train.prompts_per_step", "4", "--rollout.n", "4",
        "--data.n_train", "64", "--data.n_test", "4", "--train.val_every", "0"]


def trainer(tmp_path, *extra):
    cfg = load_run_config(None, [*ARGS, *extra, "--out", str(tmp_path)])
    return GRPOTrainer(cfg, "consistent", prepare(cfg, tmp_path, progress=False), tmp_path / "consistent")


def constant_groups(rewards: torch.Tensor, n: int = 4) -> int:
    grouped = rewards.view(-1, n)
    return int((grouped == grouped[:, :1]).all(1).sum())


@pytest.mark.slow
def test_filtered_steps_keep_only_groups_with_a_reward_spread_and_diff_zero(tmp_path):
    t = trainer(tmp_path, "--train.filter_groups", "true", "--train.max_gen_batches", "6")
    for step in (1, 2):
        responses, rewards, metrics = t.sample_batch(step)
        assert constant_groups(rewards) == 0 and len(responses.prompt_ids) == len(rewards) == 16
        assert metrics["train/num_groups"] == 4 and 1 <= metrics["train/num_gen_batches"] <= 6
        assert metrics["train/kept_groups_frac"] <= 1.0
    history = t.run(progress=False)
    assert all(is_exact(m) and m["rollout_corr/valid_tokens"] > 0 for m in history), history
    assert any(m["train/num_gen_batches"] > 1 for m in history)


def test_control_without_filtering_the_same_rollout_has_constant_groups(tmp_path):
    t = trainer(tmp_path)
    _, rewards, metrics = t.sample_batch(1)
    assert constant_groups(rewards) > 0 and "train/num_gen_batches" not in metrics
    assert metrics["critic/uniform_groups_frac"] == constant_groups(rewards) / 4


def test_the_cap_on_rollouts_trains_on_what_was_kept_or_else_on_the_last_rollout(tmp_path):
    t = trainer(tmp_path, "--train.filter_groups", "true", "--train.max_gen_batches", "1")
    seen = set()
    for step in range(1, 9):
        responses, rewards, metrics = t.sample_batch(step)
        assert metrics["train/num_gen_batches"] == 1 and len(responses.prompt_ids) == 4 * metrics["train/num_groups"]
        if metrics["train/kept_groups_frac"] > 0:   # short of 4 groups: the kept ones alone
            assert metrics["train/num_groups"] == 4 * metrics["train/kept_groups_frac"] and constant_groups(rewards) == 0
            seen.add("kept" if metrics["train/num_groups"] < 4 else "full")
        else:                                       # none kept: the rollout as it came
            assert metrics["train/num_groups"] == 4 and constant_groups(rewards) == 4
            seen.add("none")
    assert {"kept", "none"} <= seen, seen


def test_filter_groups_refuses_the_ep_trainer():
    with pytest.raises(ValueError, match="train.filter_groups with parallel.trainer = 'ep'"):
        load_run_config(None, ["--train.filter_groups", "true", "--parallel.trainer", "ep",
                               "--model.model_type", "qwen3_moe", "--model.num_experts", "4",
                               "--model.moe_intermediate_size", "32"])
