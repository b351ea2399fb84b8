"""compress: DeepSeek-V4's gated window pooling against transformers' compressor arithmetic; an entry's bits depend on
its own window's rows only."""
import pytest
import torch

from onepath.ops import compressor as C


def windows(gen, e=23, s=8, c=32):
    kv, gate = torch.randn(e, s, c, generator=gen), torch.randn(e, s, c, generator=gen)
    valid = torch.ones(e, s, dtype=torch.bool)
    valid[0, :s // 2] = False  # CSA's first window: no previous one
    return kv, gate, torch.randn(s, c, generator=gen), valid


def test_matches_transformers_pooling(consistent, gen):
    """transformers: kv * softmax(gate + position_bias over the slots), summed over the slots; an absent slot is a
    zero kv with a -inf gate."""
    kv, gate, bias, valid = windows(gen)
    g = torch.where(valid[..., None], gate + bias, float("-inf"))
    want = (torch.where(valid[..., None], kv, 0.0) * g.softmax(dim=1, dtype=torch.float32)).sum(dim=1)
    torch.testing.assert_close(C.compress(consistent, kv, gate, bias, valid), want, rtol=1e-5, atol=1e-6)


def test_entry_alone_equals_entry_among_others(consistent, gen):
    kv, gate, bias, valid = windows(gen)
    full = C.compress(consistent, kv, gate, bias, valid)
    alone = torch.cat([C.compress(consistent, kv[i:i + 1], gate[i:i + 1], bias, valid[i:i + 1])
                       for i in range(kv.shape[0])])
    assert torch.equal(alone, full)


def test_gradient_is_the_reference_one(consistent, gen):
    kv, gate, bias, valid = windows(gen, e=4, s=4, c=6)
    leaves = [t.clone().requires_grad_() for t in (kv, gate, bias)]
    again = [t.clone().requires_grad_() for t in (kv, gate, bias)]
    C.compress(consistent, *leaves, valid).square().sum().backward()
    C.reference(*again, valid).square().sum().backward()
    for a, b in zip(leaves, again):
        torch.testing.assert_close(a.grad, b.grad)


def test_mismatched_shapes_are_named(consistent):
    with pytest.raises(ValueError, match="compress: kv"):
        C.compress(consistent, torch.zeros(2, 4, 3), torch.zeros(2, 4, 3), torch.zeros(2, 3),
                   torch.ones(2, 4, dtype=torch.bool))
