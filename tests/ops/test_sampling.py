"""Ops.sample_with_logprobs on the torch backends: the engine's sampler in one call.

It must be exactly what the engine computed with three calls (probs -> sample -> token_logprobs),
and a row's token and log-prob must not depend on its batch. The Triton path's bits are checked by
tests/ops/test_logprobs_interpret.py (interpreter) and tests/ops/test_logprobs_gpu.py.
"""
import itertools

import pytest
import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from onepath.ops.sampling import exponential_noise, sample, sample_key


def _batch(gen, rows, vocab=500):
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temperature = 0.5 + torch.rand(rows, generator=gen)
    top_k = torch.where(torch.rand(rows, generator=gen) < 0.5, torch.randint(1, 60, (rows,), generator=gen), 0)
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.5, 1.0, 0.5 + 0.5 * torch.rand(rows, generator=gen))
    keys = [sample_key(4, r, 11) for r in range(rows)]
    return logits, temperature, top_k, top_p, keys


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_sample_with_logprobs_is_probs_sample_token_logprobs(mode, gen):
    ops = Ops(ExecutionSpec(mode=mode))
    logits, temperature, top_k, top_p, keys = _batch(gen, 37)
    for keep in (None, ops.sampling_mask(logits, temperature, top_k, top_p)):
        tokens, lp = ops.sample_with_logprobs(logits, temperature, keys, keep)
        want_tokens = ops.sample(ops.probs(logits, temperature, keep), keys)
        assert torch.equal(tokens, want_tokens)
        assert torch.equal(lp, ops.token_logprobs(logits, want_tokens, temperature, keep)[0])
        assert tokens.dtype == torch.int64 and lp.dtype == torch.float32 and torch.isfinite(lp).all()


def test_sample_with_logprobs_rows_alone_equal_rows_in_batch(consistent, gen):
    ops = Ops(consistent)
    probe = _batch(gen, 1)
    p_logits, p_temp, p_k, p_p, p_keys = probe
    p_k[0], p_p[0] = 40, 0.9
    alone = ops.sample_with_logprobs(p_logits, p_temp, p_keys, ops.sampling_mask(p_logits, p_temp, p_k, p_p))
    stream_moved = False
    for m in (1, 3, 64, 257):
        logits, temperature, top_k, top_p, keys = _batch(gen, m)
        at = int(torch.randint(0, m, (1,), generator=gen))
        logits[at], temperature[at], top_k[at], top_p[at], keys[at] = p_logits[0], p_temp[0], p_k[0], p_p[0], p_keys[0]
        keep = ops.sampling_mask(logits, temperature, top_k, top_p)
        tokens, lp = ops.sample_with_logprobs(logits, temperature, keys, keep)
        assert torch.equal(tokens[at:at + 1], alone[0]) and torch.equal(lp[at:at + 1], alone[1]), f"M {m}, row {at}"
        # control: one batch-wide stream (the stock engine's torch.multinomial) hands the probe another draw
        draw = lambda p: torch.multinomial(p, 1, generator=torch.Generator().manual_seed(0))[:, 0]
        p = ops.probs(logits, temperature, keep)
        stream_moved |= m > 1 and not torch.equal(draw(p)[at:at + 1], draw(p[at:at + 1]))
    assert stream_moved


def _probs(gen, rows, vocab):
    p = torch.rand(rows, vocab, generator=gen) ** 4
    p[torch.rand(rows, vocab, generator=gen) < 0.5] = 0.0
    p[:, 0] += 1e-3
    return p / p.sum(-1, keepdim=True)


def test_sample_same_key_same_token(gen):
    p = _probs(gen, 6, 500)
    keys = [sample_key(7, r, 11) for r in range(6)]
    assert torch.equal(sample(p, keys), sample(p, keys))


def test_sample_row_independent_of_batch_with_negative_control(gen):
    vocab = 300
    probe = _probs(gen, 1, vocab)
    key = sample_key(3, 42, 9)
    alone = sample(probe, [key])
    multinomial = lambda p: torch.multinomial(p, 1, generator=torch.Generator().manual_seed(3))[:, 0]
    stream_moved = False
    for m in (2, 5, 16, 31):
        p = _probs(gen, m, vocab)
        at = int(torch.randint(0, m, (1,), generator=gen))
        p[at] = probe[0]
        keys = [sample_key(3, r, 9) for r in range(m)]
        keys[at] = key
        assert torch.equal(sample(p, keys)[at:at + 1], alone), f"m {m} row {at}"
        # control: one batch-wide stream, the stock engine's way, hands the probe another draw
        stream_moved |= not torch.equal(multinomial(p)[at:at + 1], multinomial(probe))
    assert stream_moved


def test_sample_frequencies_match_probs():
    p = torch.tensor([0.5, 0.0, 0.25, 0.15, 0.0, 0.07, 0.03])
    draws = 4000
    tokens = sample(p.expand(draws, -1), [sample_key(0, r, 5) for r in range(draws)])
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0
    support = p > 0
    expected = draws * p.double()[support]
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    # 4 degrees of freedom: P(chi2 > 25) ~ 5e-5 for an exact sampler
    assert chi2 < 25.0, f"chi2 {chi2:.1f}, counts {counts.tolist()}"


def test_zero_probability_tokens_never_drawn(gen):
    rows, vocab = 2000, 64
    p = torch.zeros(rows, vocab)
    p[:, 5], p[:, 60], p[:, 61] = 1e-30, 0.7, 0.3
    p[::7] = 0.0
    p[::7, 33] = 1.0                                    # a single allowed token is always drawn
    tokens = sample(p, [sample_key(1, r, 0) for r in range(rows)])
    assert torch.isin(tokens, torch.tensor([5, 60, 61, 33])).all()
    assert (tokens[::7] == 33).all()
    assert (p.gather(-1, tokens[:, None]) > 0).all()


def test_sample_key_depends_on_seed_request_and_position():
    grid = list(itertools.product(range(6), range(6), range(6)))
    keys = [sample_key(*triple) for triple in grid]
    assert len(set(keys)) == len(grid)
    assert all(0 <= key < 2 ** 63 for key in keys)   # fits a signed 64-bit tensor
    # the noise each key feeds the race differs too
    noise = {tuple(row) for row in exponential_noise(torch.tensor(keys), 4).tolist()}
    assert len(noise) == len(grid)


def test_keys_differing_in_high_bits_give_different_noise():
    key = sample_key(1, 2, 3)
    noise = exponential_noise(torch.tensor([key, key ^ (1 << 40)]), 8)
    assert not torch.equal(noise[0], noise[1])


def _tied(gen, rows=7, vocab=301):
    """BF16 logits with the row maximum planted at several positions (ties in one block and across it)."""
    logits = (torch.randn(rows, vocab, generator=gen) * 2).bfloat16()
    for r in range(rows):
        at = torch.randperm(vocab, generator=gen)[:1 + r % 3]
        logits[r, at] = (logits[r].float().max() + 1).bfloat16()
    return logits


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_greedy_rows_take_the_largest_kept_logit_ties_to_the_larger_index(mode, gen):
    ops = Ops(ExecutionSpec(mode=mode))
    logits = _tied(gen)
    rows, vocab = logits.shape
    keep = torch.ones(rows, vocab, dtype=torch.bool)
    keep[1, logits[1].float().argmax()] = False               # a maximum outside the top-k/top-p set
    keep[1, -1] = True
    greedy = torch.tensor([True] * 5 + [False] * 2)
    temperature = torch.ones(rows)
    temperature[5:] = torch.tensor([0.6, 1.4])                # greedy rows carry temperature 1 (SamplingParams)
    keys = [sample_key(8, r, 2) for r in range(rows)]
    tokens, lp = ops.sample_with_logprobs(logits, temperature, keys, keep, greedy)
    x = logits.float().masked_fill(~keep, float("-inf"))
    for r in range(5):
        maxima = (x[r] == x[r].max()).nonzero()[:, 0]
        assert int(tokens[r]) == int(maxima.max()), f"row {r}: {int(tokens[r])} vs maxima {maxima.tolist()}"
    # control: torch.argmax takes the first of equal maxima, so the planted ties pick other tokens there
    assert not torch.equal(torch.argmax(x[:5], dim=-1), tokens[:5])
    # the reported log-prob is the untempered distribution's (restricted to keep), as the trainer scores it
    assert torch.equal(lp, ops.token_logprobs(logits, tokens, temperature, keep)[0])
    plain = ops.sample_with_logprobs(logits, temperature, keys, keep)
    assert torch.equal(tokens[5:], plain[0][5:]) and torch.equal(lp[5:], plain[1][5:])


def test_greedy_row_alone_equals_row_in_batch(consistent, gen):
    ops = Ops(consistent)
    probe = _tied(gen, 1)
    alone = ops.sample_with_logprobs(probe, torch.ones(1), [sample_key(1, 0, 0)], None, torch.tensor([True]))
    for m in (2, 5, 33):
        logits, at = _tied(gen, m), int(torch.randint(0, m, (1,), generator=gen))
        logits[at] = probe[0]
        greedy = torch.rand(m, generator=gen) < 0.5
        greedy[at] = True
        tokens, lp = ops.sample_with_logprobs(logits, torch.ones(m), [sample_key(1, r, 0) for r in range(m)],
                                              None, greedy)
        assert torch.equal(tokens[at:at + 1], alone[0]) and torch.equal(lp[at:at + 1], alone[1]), f"M {m}"


def test_greedy_sampling_params():
    from onepath.engine.sampling_params import SamplingParams, greedy_rows, sampling_tensors
    params = [SamplingParams(temperature=0.0, top_k=5), SamplingParams(temperature=0.7)]
    assert params[0].greedy and not params[1].greedy
    temperature, _, _ = sampling_tensors(params, "cpu")
    assert temperature.tolist() == [1.0, pytest.approx(0.7)]
    assert greedy_rows(params, "cpu").tolist() == [True, False] and greedy_rows(params[1:], "cpu") is None
    with pytest.raises(ValueError, match=r"temperature -0.5 must be a finite number >= 0: 0 decodes greedily"):
        SamplingParams(temperature=-0.5)
