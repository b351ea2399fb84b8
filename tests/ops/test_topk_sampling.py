import itertools

import pytest
import torch

from onepath.ops import topk as TK
from onepath.ops.sampling import exponential_noise, sample, sample_key

TINY = torch.finfo(torch.float32).tiny
SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), TINY, -TINY, TINY / 2, -TINY / 2, 1e-45, -1e-45,
           torch.finfo(torch.float32).max, torch.finfo(torch.float32).min, 1.0, -1.0, 3.0, 3.0, -2.5, -2.5]


def _row(gen, n=300):
    """SPECIAL values (signed zeros, infinities, denormals, ties) mixed into random and tied values."""
    x = torch.cat([torch.tensor(SPECIAL), torch.randn(n // 2, generator=gen),
                   torch.randint(-3, 4, (n - n // 2 - len(SPECIAL),), generator=gen).float()])
    return x[torch.randperm(n, generator=gen)]


def _order(row):
    """Indices by descending value, ties to the larger index (the contract's rule)."""
    return sorted(range(len(row)), key=lambda i: (row[i], i), reverse=True)


def test_order_key_is_monotone_in_value(gen):
    x = _row(gen)
    key = TK.order_key(x)
    greater = x[:, None] > x[None, :]
    assert greater.any()
    assert (key[:, None] > key[None, :])[greater].all()


def test_order_key_breaks_ties_by_larger_index(gen):
    x = _row(gen)
    x = torch.where(x == 0, 0.0, x)   # one sign of zero: the signed-zero tie is the test below
    key = TK.order_key(x)
    assert len(set(key.tolist())) == x.numel()
    assert TK.key_position(key).tolist() == list(range(x.numel()))
    assert TK.key_position(key.sort(descending=True).values).tolist() == _order(x.tolist())


def test_order_key_signed_zeros_tie_by_index():
    x = torch.tensor([0.0, -0.0])
    assert TK.key_position(TK.order_key(x).sort(descending=True).values).tolist() == [1, 0]


def test_topk_ties_larger_position_wins_in_descending_order(consistent, baseline, gen):
    rows, n, k = 16, 257, 40
    x = torch.randint(0, 5, (rows, n), generator=gen).float()   # ~50 copies of each value
    special = _row(gen, n)
    x[3] = torch.where(special == 0, 0.0, special)              # specials, one sign of zero
    expected = torch.tensor([_order(r)[:k] for r in x.tolist()])
    values, indices = TK.topk(consistent, x, k)
    assert torch.equal(indices, expected)
    assert torch.equal(values, x.gather(-1, expected))
    assert (values[:, :-1] >= values[:, 1:]).all()
    # torch.topk's choice among ties is its own
    assert not torch.equal(TK.topk(baseline, x, k)[1], expected)


def test_topk_rows_alone_equal_rows_in_batch(consistent, gen):
    # torch.topk on CPU is row-serial, so the stock path keeps a row's choice here too: no control.
    n, k = 1000, 17
    probe = torch.randint(0, 8, (1, n), generator=gen).float()
    alone = TK.topk(consistent, probe, k)
    for m in (2, 16, 33):
        x = torch.randn(m, n, generator=gen)
        at = int(torch.randint(0, m, (1,), generator=gen))
        x[at] = probe[0]
        values, indices = TK.topk(consistent, x, k)
        assert torch.equal(indices[at:at + 1], alone[1]) and torch.equal(values[at:at + 1], alone[0])


def test_topk_rejects_k_out_of_range(consistent):
    with pytest.raises(ValueError, match=r"k = 6 must be in \[1, 5\]"):
        TK.topk(consistent, torch.zeros(2, 5), 6)


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
