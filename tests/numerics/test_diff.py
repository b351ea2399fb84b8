import math

import pytest
import torch

from onepath.numerics.diff import DIFF_METRICS, VALID_TOKENS, is_exact, rollout_diff


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (17, 1), (5, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_identical_inputs_give_exact_zeros(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    logprobs = (-torch.rand(shape, generator=gen) * 12).to(dtype)
    logprobs[0, 0] = float("-inf")  # a token the sampler could not have drawn: still equal to itself
    mask = torch.rand(shape, generator=gen) < 0.7
    mask[0, 0] = True
    metrics = rollout_diff(logprobs, logprobs.clone(), mask)
    assert all(metrics[k] == 0.0 for k in DIFF_METRICS), metrics
    assert metrics[VALID_TOKENS] == int(mask.sum())
    assert is_exact(metrics)


def test_one_ulp_is_not_exact():
    rollout = torch.full((2, 3), -1.5)
    train = rollout.clone()
    train[1, 2] = torch.nextafter(train[1, 2], torch.tensor(0.0))
    metrics = rollout_diff(rollout, train, torch.ones(2, 3, dtype=torch.bool))
    assert metrics["rollout_corr/tokens_differing_frac"] == 1 / 6
    assert 0 < metrics["rollout_corr/logprob_abs_diff_max"] < 1e-6
    assert not is_exact(metrics)


def test_known_values():
    rollout = torch.tensor([[math.log(0.5), math.log(0.25)], [math.log(0.1), 0.0]])
    train = torch.tensor([[math.log(0.5), math.log(0.5)], [math.log(0.2), 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    metrics = rollout_diff(rollout, train, mask)
    diffs = torch.tensor([0.0, 0.25, 0.1], dtype=torch.float64)  # |p_train - p_rollout|
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(0.25, rel=1e-6)
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(0.35 / 3, rel=1e-6)
    assert metrics["training/rollout_probs_diff_std"] == pytest.approx(float(diffs.std(correction=0)), rel=1e-6)
    # r = 1, 2, 2: r - 1 - log r
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(2 * (1 - math.log(2)) / 3, rel=1e-6)
    assert metrics["rollout_corr/logprob_abs_diff_max"] == pytest.approx(math.log(2), rel=1e-6)
    assert metrics["rollout_corr/tokens_differing_frac"] == pytest.approx(2 / 3)
    assert metrics[VALID_TOKENS] == 3


def test_k3_clamps_the_log_ratio_like_verl():
    metrics = rollout_diff(torch.tensor([[-100.0]]), torch.tensor([[-1.0]]), torch.tensor([[True]]))
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(math.exp(20) - 21)
    assert metrics["rollout_corr/logprob_abs_diff_max"] == pytest.approx(99.0)


def test_masked_tokens_change_nothing():
    gen = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 9, generator=gen) * 5
    train = rollout + torch.randn(4, 9, generator=gen) * 1e-3
    mask = torch.rand(4, 9, generator=gen) < 0.5
    before = rollout_diff(rollout, train, mask)
    wild = train.clone()
    wild[~mask] = torch.where(torch.rand(int((~mask).sum()), generator=gen) < 0.5, 0.0, -1e4)
    assert rollout_diff(rollout, wild, mask) == before
    exact = rollout_diff(rollout, torch.where(mask, rollout, rollout - 50), mask)
    assert is_exact(exact)
    # Negative control: the same wild values on valid tokens do move the metrics.
    assert rollout_diff(rollout, wild, torch.ones_like(mask)) != before


def test_no_valid_token():
    metrics = rollout_diff(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert metrics == {**dict.fromkeys(DIFF_METRICS, 0.0), VALID_TOKENS: 0}


def test_errors():
    with pytest.raises(ValueError, match=r"must have one shape"):
        rollout_diff(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="k3_kl"):
        is_exact({"training/rollout_probs_diff_max": 0.0})
