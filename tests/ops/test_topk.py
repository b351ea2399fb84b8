import pytest
import torch

from onepath.ops import topk as TK

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


def _index_topk_expected(row, valid, k):
    """The k best valid positions by (value, position), then sorted by descending position, -1 to fill."""
    best = [i for i in _order(row) if valid[i]][:k]
    return sorted(best, reverse=True) + [-1] * (k - len(best))


def test_index_topk_planted_ties_go_to_the_larger_position_emitted_by_descending_position(consistent, baseline, gen):
    """The sparse-attention selection: ties planted across the top-k boundary (ReLU scores tie at exactly 0, of
    either sign), entries a query may not see yet, rows with fewer valid entries than k."""
    rows, n, k = 12, 203, 37
    x = torch.randint(-2, 3, (rows, n), generator=gen).float()
    x = torch.where(x <= 0, torch.where(torch.rand(rows, n, generator=gen) < 0.5, 0.0, -0.0), x)
    x[5] = torch.where(_row(gen, n) == 0, 0.0, _row(gen, n))
    valid = torch.arange(n)[None, :] < torch.randint(1, n + 1, (rows, 1), generator=gen)
    valid[0, 30:] = False     # fewer valid entries than k
    expected = torch.tensor([_index_topk_expected(r, v, k) for r, v in zip(x.tolist(), valid.tolist())])
    picked = TK.index_topk(consistent, x, valid, k)
    assert torch.equal(picked, expected)
    assert (picked[0, 30:] == -1).all() and (picked[0, :30] >= 0).all()
    # the stock path: torch.topk's order by value, and its own choice among the ties (another set)
    stock = TK.index_topk(baseline, x, valid, k)
    assert not torch.equal(stock, expected)
    assert not torch.equal(stock.sort(dim=-1, descending=True).values, expected)


def test_index_topk_row_alone_equals_row_in_batch(consistent, gen):
    """A request's selection uses its own entries' positions only: the same row alone or among other requests'
    rows (of other lengths and validity) gives the same indices."""
    n, k = 97, 16
    probe = torch.randint(0, 3, (1, n), generator=gen).float()
    probe_valid = torch.arange(n)[None, :] < 80
    alone = TK.index_topk(consistent, probe, probe_valid, k)
    for m in (2, 17, 40):
        x = torch.randint(0, 3, (m, n), generator=gen).float()
        valid = torch.rand(m, n, generator=gen) < 0.7
        at = int(torch.randint(0, m, (1,), generator=gen))
        x[at], valid[at] = probe[0], probe_valid[0]
        assert torch.equal(TK.index_topk(consistent, x, valid, k)[at:at + 1], alone)


def test_index_topk_pads_when_k_exceeds_the_entries(consistent):
    x = torch.tensor([[1.0, 0.0, 1.0]])
    assert TK.index_topk(consistent, x, torch.ones(1, 3, dtype=torch.bool), 5).tolist() == [[2, 1, 0, -1, -1]]
    assert TK.index_topk(consistent, x[:, :0], torch.ones(1, 0, dtype=torch.bool), 2).tolist() == [[-1, -1]]
    with pytest.raises(ValueError, match="index_topk k = 0"):
        TK.index_topk(consistent, x, torch.ones(1, 3, dtype=torch.bool), 0)
