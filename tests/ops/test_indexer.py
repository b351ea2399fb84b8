"""index_scores: the lightning indexer's scores, against transformers' scorer; one arithmetic for contiguous keys
(a prefill holding the whole context) and keys read from a paged cache (decode), and a query's scores alone equal
to its scores in a batch, with the stock paths as negative controls."""
import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

from onepath.ops import cache_rows, indexer


def inputs(gen, t=37, heads=4, d=128, entries=29):
    q = torch.randn(t, heads, d, generator=gen)
    keys = torch.randn(entries, d, generator=gen)
    weights = torch.randn(t, heads, generator=gen)
    valid = torch.arange(entries)[None, :] < torch.randint(0, entries + 1, (t, 1), generator=gen)
    return q, keys, weights, valid


def test_scores_match_transformers_scorer(consistent, gen):
    heads, d, hidden = 4, 16, 24
    config = DeepseekV4Config(index_n_heads=heads, index_head_dim=d, hidden_size=hidden)
    scorer = DeepseekV4IndexerScorer(config)
    x = torch.randn(1, 11, hidden, generator=gen)
    q, keys = torch.randn(1, 11, heads, d, generator=gen), torch.randn(1, 7, d, generator=gen)
    with torch.no_grad():
        want = scorer(q, keys, x)[0]
        weights = scorer.weights_proj(x)[0]
    got = indexer.index_scores(consistent, q[0], keys[0], weights, torch.ones(11, 7, dtype=torch.bool),
                               d ** -0.5, heads ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def paged(keys, gen, block=16):
    """keys [E, d] scattered into a paged cache of shuffled blocks; the slots of entries 0..E-1."""
    blocks = -(-keys.shape[0] // block)
    table = torch.randperm(blocks + 3, generator=gen)[:blocks]
    cache = torch.zeros(blocks + 3, block, 1, keys.shape[1])
    j = torch.arange(keys.shape[0])
    slots = table[j // block] * block + j % block
    cache.view(-1, 1, keys.shape[1])[slots] = keys[:, None]
    return cache, slots


def test_contiguous_and_paged_keys_give_the_same_bits(consistent, baseline, gen):
    q, keys, weights, valid = inputs(gen)
    cache, slots = paged(keys, gen)
    gathered = cache_rows.gather(cache, slots.expand(q.shape[0], -1), torch.float32)[:, :, 0]
    assert torch.equal(gathered, keys.expand(q.shape[0], -1, -1))
    contiguous = indexer.index_scores(consistent, q, keys, weights, valid, 0.09, 0.5)
    assert torch.equal(indexer.index_scores(consistent, q, gathered, weights, valid, 0.09, 0.5), contiguous)
    assert torch.isinf(contiguous[~valid]).all() and torch.isfinite(contiguous[valid]).all()
    # the stock prefill (a GEMM) and paged decode (products summed by torch) paths round differently
    stock = [indexer.index_scores(baseline, q, k, weights, valid, 0.09, 0.5) for k in (keys, gathered)]
    assert not torch.equal(*stock)
    torch.testing.assert_close(stock[0], contiguous, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [1, 4])
def test_query_alone_equals_query_in_a_batch(consistent, baseline, gen, heads):
    q, keys, weights, valid = inputs(gen, heads=heads)
    one = lambda spec, i: indexer.index_scores(spec, q[i:i + 1], keys, weights[i:i + 1], valid[i:i + 1], 0.09, 0.5)
    batch = indexer.index_scores(consistent, q, keys, weights, valid, 0.09, 0.5)
    assert torch.equal(torch.cat([one(consistent, i) for i in range(q.shape[0])]), batch)
    if heads == 1:  # one query head: the stock GEMM runs M = 1 alone, another kernel than in the batch
        stock = indexer.index_scores(baseline, q, keys, weights, valid, 0.09, 0.5)
        assert not torch.equal(torch.cat([one(baseline, i) for i in range(q.shape[0])]), stock)


def test_gradient_is_the_reference_one(consistent, gen):
    q, keys, weights, valid = inputs(gen, t=5, entries=6)
    valid[:] = True
    leaves = [t.clone().requires_grad_() for t in (q, keys, weights)]
    indexer.index_scores(consistent, *leaves[:2], leaves[2], valid, 0.09, 0.5).sum().backward()
    again = [t.clone().requires_grad_() for t in (q, keys, weights)]
    indexer.reference(*again[:2], again[2], valid, 0.09, 0.5).sum().backward()
    for a, b in zip(leaves, again):
        torch.testing.assert_close(a.grad, b.grad)


def test_mismatched_shapes_are_named(consistent):
    with pytest.raises(ValueError, match="index_scores: q"):
        indexer.index_scores(consistent, torch.zeros(3, 2, 8), torch.zeros(4, 7), torch.zeros(3, 2),
                             torch.ones(3, 4, dtype=torch.bool), 1.0, 1.0)
