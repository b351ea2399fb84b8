"""TIS and MIS (verl's rollout_is / rollout_rs) on hand-computed cases; in consistent mode both are
exact no-ops (same loss and weights, bit for bit); in baseline mode they act (negative control)."""
import math

import pytest
import torch

from onepath.config import load_run_config
from onepath.train.grpo import (policy_loss, rollout_correction, rollout_is_weights, rollout_log_ratio,
                                rollout_rs_mask)
from onepath.train.trainer import GRPOTrainer, prepare

LN = math.log
# one batch, ratios r = pi_old / pi_rollout per token; row 0 has a padding token at the end
RATIOS = [[4.0, 0.6, 1.0, 9.0], [0.3, 1.5, 1.2, 1.0]]
MASK = torch.tensor([[True, True, True, False], [True, True, True, True]])
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-3.0, -0.25, -1.5, -0.75]])


def old_for(ratios=RATIOS, rollout=ROLLOUT):
    return rollout + torch.tensor(ratios).log()


def test_log_ratio_per_token_and_per_sequence():
    token = rollout_log_ratio(old_for(), ROLLOUT, MASK, "token")
    torch.testing.assert_close(token, torch.tensor([[LN(4), LN(0.6), 0.0, 0.0], [LN(0.3), LN(1.5), LN(1.2), 0.0]]))
    seq = rollout_log_ratio(old_for(), ROLLOUT, MASK, "sequence")
    row0, row1 = LN(4 * 0.6), LN(0.3 * 1.5 * 1.2)  # the padding token's ratio 9 is not in row 0's product
    torch.testing.assert_close(seq, torch.tensor([[row0, row0, row0, 0.0], [row1] * 4]))


def test_log_ratio_clamped_to_20_and_exactly_0_where_equal():
    old = torch.tensor([[0.0, -30.0, -math.inf, -1.0]])
    rollout = torch.tensor([[-30.0, 0.0, -math.inf, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    assert rollout_log_ratio(old, rollout, mask, "token").tolist() == [[20.0, -20.0, 0.0, 0.0]]
    seq = rollout_log_ratio(torch.tensor([[0.0, 0.0]]), torch.tensor([[-15.0, -15.0]]), mask[:, :2], "sequence")
    assert seq.tolist() == [[20.0, 20.0]]  # the sum (30) is clamped, not each token
    with pytest.raises(ValueError, match="'geometric'.*token, sequence"):
        rollout_log_ratio(old, rollout, mask, "geometric")


def test_tis_weights_truncate_at_the_threshold():
    token = rollout_is_weights(old_for(), ROLLOUT, MASK, "token", 2.0)
    torch.testing.assert_close(token[MASK], torch.tensor([2.0, 0.6, 1.0, 0.3, 1.5, 1.2, 1.0]))
    seq = rollout_is_weights(old_for(), ROLLOUT, MASK, "sequence", 2.0)
    # 4 * 0.6 * 1 = 2.4 -> 2 and 0.3 * 1.5 * 1.2 * 1 = 0.54, on each token; 1 off the mask
    torch.testing.assert_close(seq, torch.tensor([[2.0, 2.0, 2.0, 1.0], [0.54] * 4]))
    assert not rollout_is_weights(old_for().requires_grad_(), ROLLOUT, MASK, "token", 2.0).requires_grad


def test_mis_masks_ratios_outside_the_band():
    token = rollout_rs_mask(old_for(), ROLLOUT, MASK, "token", 2.0)  # band [0.5, 2]
    assert token.tolist() == [[False, True, True, False], [False, True, True, True]]
    seq = rollout_rs_mask(old_for(), ROLLOUT, MASK, "sequence", 2.0)  # 2.4 out, 0.54 in
    assert seq.tolist() == [[False] * 4, [True] * 4]
    loose = rollout_rs_mask(old_for(), ROLLOUT, MASK, "token", 5.0)  # band [0.2, 5]: only padding out
    assert torch.equal(loose, MASK)


def test_masked_tokens_leave_the_denominator_and_weights_scale_each_token():
    old = old_for()
    advantages = torch.tensor([1.0, -2.0])
    weights, keep, metrics = rollout_correction(old, ROLLOUT, MASK, "token", 2.0, "token", 2.0)
    # logprobs = old: ratio 1, each kept token's loss is -A * w; MIS drops ratios 4 and 0.3 (and padding)
    loss, _ = policy_loss(old.clone(), old, advantages, keep, 0.2, weights)
    expected = (-1.0 * (0.6 + 1.0) + 2.0 * (1.5 + 1.2 + 1.0)) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx((2 + 0.6 + 1 + 0.3 + 1.5 + 1.2 + 1) / 7, rel=1e-6)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 7)
    weights, keep, metrics = rollout_correction(old, ROLLOUT, MASK)  # off: nothing changes, nothing logged
    assert weights is None and torch.equal(keep, MASK) and metrics == {}


def test_on_policy_ratio_one_makes_both_exact_no_ops():
    gen = torch.Generator().manual_seed(0)
    rollout = -torch.rand(6, 11, generator=gen) * 5
    mask = torch.rand(6, 11, generator=gen) > 0.2
    advantages = torch.randn(6, generator=gen)
    logits = torch.randn(6, 11, generator=gen)

    def loss_and_grad(**corrections):
        x = logits.clone().requires_grad_()
        logprobs = rollout + (x - x.detach())  # values = rollout's, as the consistent trainer's are
        weights, keep, metrics = rollout_correction(logprobs.detach(), rollout, mask, **corrections)
        loss, _ = policy_loss(logprobs, logprobs.detach(), advantages, keep, 0.2, weights)
        loss.backward()
        return loss, x.grad, metrics

    plain_loss, plain_grad, _ = loss_and_grad()
    for level in ("token", "sequence"):
        loss, grad, metrics = loss_and_grad(rollout_is=level, rollout_rs=level, rollout_rs_threshold=1.0)
        assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad), level
        assert metrics == {"rollout_corr/rollout_is_mean": 1.0, "rollout_corr/rollout_is_max": 1.0,
                           "rollout_corr/rollout_rs_masked_fraction": 0.0}


def train(tmp_path, reward, mode, name, *extra):
    cfg = load_run_config(None, ["--warm_start.steps", "0", "--train.steps", "3", "--train.prompts_per_step", "4",
                                 "--rollout.n", "4", "--data.n_train", "64", "--data.n_test", "8",
                                 "--train.val_every", "0", "--train.reward", reward, "--out", str(tmp_path), *extra])
    trainer = GRPOTrainer(cfg, mode, prepare(cfg, tmp_path, progress=False), tmp_path / name)
    history = trainer.run(progress=False)
    return {k: v.clone() for k, v in trainer.policy.state_dict().items()}, history


CORRECTIONS = ["--train.rollout_is", "token", "--train.rollout_rs", "token", "--train.rollout_rs_threshold", "1.0"]
SEQUENCE = ["--train.rollout_is", "sequence", "--train.rollout_rs", "sequence", "--train.rollout_rs_threshold", "1.0"]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("corrections", [CORRECTIONS, SEQUENCE], ids=["token", "sequence"])
def test_consistent_training_is_bitwise_the_same_with_tis_and_mis(tmp_path, reward, corrections):
    # threshold 1.0: MIS keeps only tokens whose ratio is exactly 1, the strictest setting there is
    plain, plain_history = train(tmp_path, reward, "consistent", "plain")
    corrected, history = train(tmp_path, reward, "consistent", "corrected", *corrections)
    assert same_weights(plain, corrected)
    for got, want in zip(history, plain_history):
        assert got["rollout_corr/rollout_is_mean"] == got["rollout_corr/rollout_is_max"] == 1.0
        assert got["rollout_corr/rollout_rs_masked_fraction"] == 0.0
        assert got["actor/pg_loss"] == want["actor/pg_loss"] and got["actor/grad_norm"] == want["actor/grad_norm"]


def test_negative_control_baseline_corrections_act(tmp_path, reward):
    plain, _ = train(tmp_path, reward, "baseline", "plain")
    corrected, history = train(tmp_path, reward, "baseline", "corrected", *CORRECTIONS)
    assert any(m["rollout_corr/rollout_rs_masked_fraction"] > 0 for m in history)
    assert any(m["rollout_corr/rollout_is_max"] != 1.0 for m in history)
    assert not same_weights(plain, corrected), "baseline with TIS/MIS trained the same weights: the test is blind"


@pytest.mark.parametrize("overrides, match", [
    (["--train.rollout_is", "seq"], r"train.rollout_is = 'seq' is not a level: use one of token, sequence, or null"),
    (["--train.rollout_rs", "token", "--train.old_logprob", "skip"],
     r"train.rollout_rs = 'token' needs train.old_logprob = 'verify', not 'skip'"),
    (["--train.rollout_is_threshold", "0.5"], r"train.rollout_is_threshold = 0.5 must be a finite number >= 1"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_run_config(None, overrides)
