"""causal_conv1d: one tap order in every phase. A token's output and the state after it are the same bits in a
whole prefill, a chunked prefill, decode and the trainer's forward, and beside other sequences; values and
gradients against a float64 loop written here."""
import pytest
import torch
import torch.nn.functional as F

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.conv1d import causal_conv1d
from onepath.ops.spans import SeqSpans

C, K = 13, 4
SPEC = ExecutionSpec(mode="consistent")


def weights(gen, bias=True):
    return torch.randn(C, K, generator=gen) * 0.5, (torch.randn(C, generator=gen) if bias else None)


def passes(spec, x, w, b, cuts, dtype=torch.float32):
    state = torch.zeros(2, K - 1, C, dtype=dtype)
    outs = [causal_conv1d(spec, x[a:e], w, b, SeqSpans((0, e - a), (a,), (1,)), state) for a, e in zip(cuts, cuts[1:])]
    return torch.cat(outs), state


def loop(x, w, b):
    x, w = x.double(), w.double()
    padded = torch.cat([torch.zeros(K - 1, C, dtype=torch.float64), x])
    out = torch.stack([(padded[t:t + K].T * w).sum(-1) for t in range(x.shape[0])])
    return F.silu(out + (0 if b is None else b.double()))


@pytest.mark.parametrize("t, cuts", [(1, [0, 1]), (2, [0, 1, 2]), (3, [0, 2, 3]), (17, [0, 3, 4, 11, 17])])
@pytest.mark.parametrize("bias", [True, False])
def test_every_phase_gives_the_same_bits(gen, t, cuts, bias):
    x, (w, b) = torch.randn(t, C, generator=gen), weights(gen, bias)
    trainer = causal_conv1d(SPEC, x, w, b, SeqSpans((0, t), (0,)))
    whole, whole_state = passes(SPEC, x, w, b, [0, t])
    chunked, chunked_state = passes(SPEC, x, w, b, cuts)
    decoded, decoded_state = passes(SPEC, x, w, b, list(range(t + 1)))
    assert torch.equal(whole, trainer) and torch.equal(chunked, trainer) and torch.equal(decoded, trainer)
    assert torch.equal(chunked_state, whole_state) and torch.equal(decoded_state, whole_state)
    last = range(max(0, t - (K - 1)), t)  # the last K - 1 inputs, position q in ring row q % (K - 1)
    assert torch.equal(whole_state[1, [q % (K - 1) for q in last]], x[list(last)])
    torch.testing.assert_close(trainer.double(), loop(x, w, b), rtol=1e-6, atol=1e-6)


def test_bfloat16_keeps_a_sequence_bits_beside_other_sequences(gen):
    x, (w, b) = torch.randn(20, C, generator=gen).bfloat16(), weights(gen)
    w, b = w.bfloat16(), b.bfloat16()
    alone = [causal_conv1d(SPEC, x[a:e], w, b, SeqSpans((0, e - a), (0,))) for a, e in ((0, 9), (9, 20))]
    together = causal_conv1d(SPEC, x, w, b, SeqSpans((0, 9, 20), (0, 0)))
    assert torch.equal(together, torch.cat(alone)) and together.dtype == torch.bfloat16
    want = torch.cat([loop(x[:9].float(), w.float(), b.float()), loop(x[9:].float(), w.float(), b.float())])
    torch.testing.assert_close(together.double(), want, rtol=1.6e-2, atol=1e-5)


def test_gradients_match_a_float64_loop(gen):
    x = torch.randn(11, C, generator=gen).requires_grad_()
    w, b = (t.requires_grad_() for t in weights(gen))
    g_out = torch.randn(11, C, generator=gen)
    got = torch.autograd.grad((causal_conv1d(SPEC, x, w, b, SeqSpans((0, 5, 11), (0, 0))) * g_out).sum(), (x, w, b))
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y = torch.cat([loop(leaves[0][:5], *leaves[1:]), loop(leaves[0][5:], *leaves[1:])])
    want = torch.autograd.grad((y * g_out.double()).sum(), leaves)
    for a, e in zip(got, want):
        torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-5)


def test_the_stock_path_is_close(gen):
    x, (w, b) = torch.randn(17, C, generator=gen), weights(gen)
    stock, _ = passes(SPEC.with_mode("baseline"), x, w, b, [0, 17])
    torch.testing.assert_close(stock.double(), loop(x, w, b), rtol=1e-5, atol=1e-5)
