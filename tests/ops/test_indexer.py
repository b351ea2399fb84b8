"""index_scores: the lightning indexer's scores, against transformers' scorer; one arithmetic for contiguous keys
(a prefill holding the whole context) and keys read from a paged cache (decode), and a query's scores alone equal
to its scores in a batch, with the stock paths as negative controls."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

from onepath.numerics.quant import quantize_fp8
from onepath.numerics.spec import FP8_INDEX
from onepath.ops import ExecutionSpec, cache_rows, indexer


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


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest tensor any op makes inside the block."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.bytes = max(self.bytes, o.numel() * o.element_size())
        return out


def test_stock_paged_scores_hold_a_bounded_piece_of_their_products(baseline, gen, monkeypatch):
    """The stock paged path's [T, H, L, d] FP32 products, all at once 197.75 GiB at the engine's 8192-token profiling
    step of DeepSeek-V4-Flash (the rollout bench's baseline out of memory), come a piece of the queries at a time,
    at most STOCK_PRODUCT_BYTES, and the pieces move no bit; all at once (one piece) as the negative control."""
    q, keys, weights, valid = inputs(gen, t=50, heads=4, d=32, entries=40)
    gathered = keys.expand(q.shape[0], -1, -1)
    products, scores = 4 * 50 * 4 * 40 * 32, 4 * 50 * 4 * 40                      # [T, H, L, d], [T, H, L] FP32
    with LargestTensor() as whole:
        want = indexer.index_scores(baseline, q, gathered, weights, valid, 0.09, 0.5)
    assert whole.bytes == products
    monkeypatch.setattr(indexer, "STOCK_PRODUCT_BYTES", products // 16)
    with LargestTensor() as pieces:
        got = indexer.index_scores(baseline, q, gathered, weights, valid, 0.09, 0.5)
    assert torch.equal(got, want)
    assert pieces.bytes <= max(products // 16, scores)


@pytest.mark.parametrize("heads", [1, 4])
def test_query_alone_equals_query_in_a_batch(consistent, baseline, gen, heads):
    q, keys, weights, valid = inputs(gen, heads=heads)
    one = lambda spec, i: indexer.index_scores(spec, q[i:i + 1], keys, weights[i:i + 1], valid[i:i + 1], 0.09, 0.5)
    batch = indexer.index_scores(consistent, q, keys, weights, valid, 0.09, 0.5)
    assert torch.equal(torch.cat([one(consistent, i) for i in range(q.shape[0])]), batch)
    if heads == 1:  # one query head: the stock GEMM runs M = 1 alone, another kernel than in the batch
        stock = indexer.index_scores(baseline, q, keys, weights, valid, 0.09, 0.5)
        assert not torch.equal(torch.cat([one(baseline, i) for i in range(q.shape[0])]), stock)


@pytest.mark.parametrize("quant", [None, "fp8_indexer"])
def test_gradient_is_the_reference_one(gen, quant):
    """In FP8 too (straight-through): keys given in the model's dtype are quantised inside, their gradient the
    reference's; keys given as cached codes take theirs through key_values."""
    spec = ExecutionSpec.default(quant=quant)
    q, keys, weights, valid = inputs(gen, t=5, entries=6)
    valid[:] = True
    leaves = [t.clone().requires_grad_() for t in (q, keys, weights)]
    indexer.index_scores(spec, *leaves[:2], leaves[2], valid, 0.09, 0.5).sum().backward()
    again = [t.clone().requires_grad_() for t in (q, keys, weights)]
    indexer.reference(*again[:2], again[2], valid, 0.09, 0.5).sum().backward()
    for a, b in zip(leaves, again):
        torch.testing.assert_close(a.grad, b.grad)
    if quant:
        values = keys.clone().requires_grad_()
        indexer.index_scores(spec, q, quantize_fp8(keys, FP8_INDEX), weights, valid, 0.09, 0.5, key_values=values) \
            .sum().backward()
        torch.testing.assert_close(values.grad, again[1].grad)


def test_mismatched_shapes_are_named(consistent):
    with pytest.raises(ValueError, match="index_scores: q"):
        indexer.index_scores(consistent, torch.zeros(3, 2, 8), torch.zeros(4, 7), torch.zeros(3, 2),
                             torch.ones(3, 4, dtype=torch.bool), 1.0, 1.0)


# ---- FP8 scoring (the fp8_indexer preset): e4m3 query heads and keys, one power-of-two scale per row ----

FP8 = ExecutionSpec.default(quant="fp8_indexer")
FP8_BASELINE = ExecutionSpec.default("baseline", quant="fp8_indexer")


def fp8_cache(keys, gen, block=16):
    """keys [E, d] written through cache_rows into a paged FP8 cache of shuffled blocks (the indexer's rule); the
    slots of entries 0..E-1."""
    blocks = -(-keys.shape[0] // block)
    cache = cache_rows.paged(blocks + 3, block, keys.shape[1], torch.float32, FP8_INDEX)
    slots = paged(keys, gen, block)[1]
    cache_rows.write(FP8, cache, slots, keys[:, None])
    return cache, slots


def fp8_error_bound(q, keys, weights, softmax_scale, weights_scale):
    """The FP8 scorer's stated distance from the FP32 scorer, [T, L]: an element x of a row with scale s moves by at
    most 2^-4 |x| + 2^-10 s (e4m3's half ulp, or half its smallest subnormal step: the scale is a power of two at or
    above amax / 448, so nothing saturates), a dot q . k by at most sum_i e_q |k| + |q| e_k + e_q e_k, relu passes
    it on, and the head weights scale it."""
    def err(x):
        return 2 ** -4 * x.abs() + 2 ** -10 * quantize_fp8(x, FP8_INDEX).scales
    eq, ek = err(q), err(keys)
    dots = eq @ keys.abs().T + q.abs() @ ek.T + eq @ ek.T                                   # [T, H, L]
    return (dots * (weights.abs() * softmax_scale * weights_scale)[..., None]).sum(1)


def test_fp8_scores_read_the_same_bits_contiguous_gathered_alone_and_in_a_batch(gen):
    q, keys, weights, valid = inputs(gen, heads=1)
    cache, slots = fp8_cache(keys, gen)
    gathered = cache_rows.gather_stored(cache, slots.expand(q.shape[0], -1))
    contiguous = quantize_fp8(keys, FP8_INDEX)
    assert torch.equal(gathered.codes.view(torch.uint8), contiguous.codes.expand(q.shape[0], -1, -1).view(torch.uint8))
    assert torch.equal(gathered.scales, contiguous.scales.expand(q.shape[0], -1, -1))
    batch = indexer.index_scores(FP8, q, contiguous, weights, valid, 0.09, 0.5)
    assert torch.equal(indexer.index_scores(FP8, q, gathered, weights, valid, 0.09, 0.5), batch)
    assert torch.equal(indexer.index_scores(FP8, q, keys, weights, valid, 0.09, 0.5), batch)  # quantised here
    assert torch.isinf(batch[~valid]).all() and torch.isfinite(batch[valid]).all()
    one = lambda spec, i, k: indexer.index_scores(spec, q[i:i + 1], k, weights[i:i + 1], valid[i:i + 1], 0.09, 0.5)
    assert torch.equal(torch.cat([one(FP8, i, contiguous) for i in range(q.shape[0])]), batch)
    # the stock way (dequantise, then a GEMM over the launch or a paged decode's sum) moves bits on both counts
    stock = [indexer.index_scores(FP8_BASELINE, q, k, weights, valid, 0.09, 0.5) for k in (contiguous, gathered)]
    assert not torch.equal(*stock)
    assert not torch.equal(torch.cat([one(FP8_BASELINE, i, contiguous) for i in range(q.shape[0])]), stock[0])
    torch.testing.assert_close(stock[0], batch, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, d", [(4, 128), (3, 200), (16, 8)])
def test_fp8_scores_are_the_fp8_formula_and_within_the_stated_error_of_the_fp32_scorer(gen, heads, d):
    q, keys, weights, valid = inputs(gen, t=13, heads=heads, d=d, entries=41)
    q = q * torch.exp2(torch.randint(-12, 12, (13, heads, 1), generator=gen).float())  # rows of any magnitude
    got = indexer.index_scores(FP8, q, keys, weights, valid, d ** -0.5, heads ** -0.5)
    # the formula in FP64 on the dequantised codes: the query's scale inside its head weight, the key's after the sum
    q8, k8 = quantize_fp8(q, FP8_INDEX), quantize_fp8(keys, FP8_INDEX)
    terms = torch.relu(q8.dequantize().double() @ k8.dequantize().double().T) \
        * (weights.double() * d ** -0.5 * heads ** -0.5)[..., None]
    want, size = terms.sum(1), terms.abs().sum(1)
    assert ((got.double() - want).abs() <= 1e-6 * size)[valid].all()   # FP32 roundings of the dot, products, sum
    fp32 = indexer.reference(q, keys, weights, valid, d ** -0.5, heads ** -0.5)
    gap = (got - fp32).abs()[valid]
    assert (gap <= fp8_error_bound(q, keys, weights, d ** -0.5, heads ** -0.5)[valid] * (1 + 1e-5) + 1e-6 * size[valid]
            ).all()
    assert gap.max() > 0  # the FP8 round trip is real


def test_fp8_keys_need_the_indexers_rule(consistent, gen):
    q, keys, weights, valid = inputs(gen, t=3, entries=4)
    with pytest.raises(ValueError, match="FP8 keys under a spec without indexer.kv"):
        indexer.index_scores(consistent, q, quantize_fp8(keys, FP8_INDEX), weights, valid, 1.0, 1.0)
