"""sparse_attention: each query over its own gathered candidates with a sink per head, against transformers' eager
attention with sinks; a query's bits alone equal its bits in a batch and do not move when its candidate list is
padded with invalid entries (the stock softmax's do: negative control)."""
import types

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

from onepath.ops import sparse_attention as SA


def inputs(gen, t=37, heads=4, d=64, length=45):
    q = torch.randn(t, heads, d, generator=gen)
    keys = torch.randn(t, length, d, generator=gen)
    valid = torch.rand(t, length, generator=gen) < 0.8
    valid[3] = False  # a query with no valid key: the sink alone, output 0
    return q, keys, valid, torch.randn(heads, generator=gen)


def test_matches_transformers_eager_attention_with_sinks(consistent, gen):
    """One query row per call of transformers' eager attention: its keys [1, 1, L, D] (one KV head read as K and V)
    and an additive mask of -inf on the invalid ones."""
    q, keys, valid, sinks = inputs(gen)
    module = types.SimpleNamespace(num_key_value_groups=q.shape[1], sinks=sinks, training=False)
    want = []
    for i in range(q.shape[0]):
        mask = torch.zeros(1, 1, 1, keys.shape[1]).masked_fill(~valid[i], float("-inf"))
        k = keys[i][None, None]
        want.append(eager_attention_forward(module, q[i][None, :, None], k, k, mask, 0.125)[0][0, 0])
    torch.testing.assert_close(SA.sparse_attention(consistent, q, keys, valid, sinks, 0.125), torch.stack(want),
                               rtol=1e-5, atol=1e-6)


def test_query_alone_equals_query_in_a_batch_and_padding_adds_nothing(consistent, baseline, gen):
    q, keys, valid, sinks = inputs(gen)
    full = SA.sparse_attention(consistent, q, keys, valid, sinks, 0.125)
    alone = [SA.sparse_attention(consistent, q[i:i + 1], keys[i:i + 1], valid[i:i + 1], sinks, 0.125)
             for i in range(q.shape[0])]
    assert torch.equal(torch.cat(alone), full)
    assert torch.equal(full[3], torch.zeros_like(full[3]))
    pad = lambda t, v, n: (torch.cat([t, torch.randn(t.shape[0], n, t.shape[2], generator=gen)], 1),
                           torch.cat([v, torch.zeros(v.shape[0], n, dtype=torch.bool)], 1))
    stock = SA.sparse_attention(baseline, q, keys, valid, sinks, 0.125)
    moved = []
    for n in (1, 3, 40, 57):
        padded = pad(keys, valid, n)
        assert torch.equal(SA.sparse_attention(consistent, q, *padded, sinks, 0.125), full), n
        moved.append(not torch.equal(SA.sparse_attention(baseline, q, *padded, sinks, 0.125), stock))
    # the stock softmax and matmul sum a longer row in another order, at some lengths (which ones: the CPU's
    # vector kernels decide; on an AVX2 machine padding by 40 alone did not)
    assert any(moved), moved


def test_gradient_is_the_reference_one(consistent, gen):
    q, keys, valid, sinks = inputs(gen, t=6, length=9)
    leaves = [t.clone().requires_grad_() for t in (q, keys, sinks)]
    again = [t.clone().requires_grad_() for t in (q, keys, sinks)]
    SA.sparse_attention(consistent, leaves[0], leaves[1], valid, leaves[2], 0.3).square().sum().backward()
    SA.reference(again[0], again[1], valid, again[2], 0.3).square().sum().backward()
    for a, b in zip(leaves, again):
        torch.testing.assert_close(a.grad, b.grad)


def test_mismatched_shapes_are_named(consistent):
    with pytest.raises(ValueError, match="sparse_attention: q"):
        SA.sparse_attention(consistent, torch.zeros(3, 2, 8), torch.zeros(3, 5, 4), torch.ones(3, 5, dtype=torch.bool),
                            torch.zeros(2), 1.0)


def test_baseline_decode_has_a_path_of_its_own_split_by_the_batch(consistent, baseline, gen):
    """The stock decode (flash-decoding: splits chosen from the batch, each split's probabilities rounded to the
    model's dtype) stays close to the reference, but a query's BF16 bits move with the batch and differ from the
    stock prefill's; the consistent path ignores `decode`."""
    q, keys, valid, sinks = (t.bfloat16() if t.is_floating_point() else t for t in inputs(gen, length=60))
    decode = lambda rows: SA.sparse_attention(baseline, q[rows], keys[rows], valid[rows], sinks, 0.125, decode=True)
    full, alone = decode(slice(None)), torch.cat([decode(slice(i, i + 1)) for i in range(q.shape[0])])
    ref = SA.reference(q, keys, valid, sinks, 0.125)
    torch.testing.assert_close(full, ref, rtol=0.02, atol=0.02)
    assert not torch.equal(full, alone)
    assert not torch.equal(full, SA.sparse_attention(baseline, q, keys, valid, sinks, 0.125))
    assert torch.equal(SA.sparse_attention(consistent, q, keys, valid, sinks, 0.125, decode=True),
                       SA.sparse_attention(consistent, q, keys, valid, sinks, 0.125))
