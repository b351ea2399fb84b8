"""ssd: the Mamba-2 scan's one arithmetic. A token's output and the state after it are the same bits in a whole
prefill, a chunked prefill cut where the scan's chunks are not, decode (one token a pass), the trainer's forward
(no state kept) and beside other sequences; the controls, the stock paths of baseline mode (a chunked scan from
each call's first token, the one-step recurrence in decode), differ on the same cases. Values and gradients are
checked against a float64 plain-loop recurrence written here, not the code under test."""
import pytest
import torch
import torch.nn.functional as F

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.spans import SeqSpans
from onepath.ops.ssd import SSDState, ssd, state_after

Q = 8
H, P, G, N = 4, 6, 2, 8
SPEC = ExecutionSpec(mode="consistent").with_op("ssd", chunk=Q)
LENGTHS = (1, Q - 1, Q, Q + 1, 3 * Q + 5)
CUTS = {1: [0, 1], Q - 1: [0, 2, 3, Q - 1], Q: [0, 5, Q], Q + 1: [0, Q - 1, Q + 1],
        3 * Q + 5: [0, 3, 5, 13, 14, 2 * Q, 3 * Q + 5]}


def params(gen):
    return torch.log(1 + 7 * torch.rand(H, generator=gen)), torch.randn(H, generator=gen), \
        torch.randn(H, generator=gen) * 0.5 - 0.5  # A_log, D, dt_bias


def tokens(gen, t):
    return (torch.randn(t, H, P, generator=gen), torch.randn(t, H, generator=gen), torch.randn(t, G, N, generator=gen),
            torch.randn(t, G, N, generator=gen))  # x, dt, B, C


def piece(inputs, a, b):
    return [t[a:b] for t in inputs]


def passes(spec, inputs, p, cuts, slots=2, slot=1, state_dtype=torch.float32):
    """One sequence computed in passes [cuts[i], cuts[i + 1]) with its state in `slot`: (outputs, state)."""
    state = SSDState.empty(slots, H, P, G, N, spec.op("ssd").chunk, torch.float32, state_dtype)
    outs = [ssd(spec, *piece(inputs, a, b), *p, SeqSpans((0, b - a), (a,), (slot,)), state, state_dtype=state_dtype)
            for a, b in zip(cuts, cuts[1:])]
    return torch.cat(outs), state


def decode_cuts(t):
    return list(range(t + 1))


def loop(inputs, p, state_dtype=None, chunk=Q, dt_limit=(0.0, float("inf"))):
    """float64 recurrence, token by token; with state_dtype, the state rounded to it after every chunk-th token.
    The shapes are the inputs' (x [T, H, P], B and C [T, G, N]): the kernels' tests use it too."""
    x, dt, B, C = (t.double().cpu() for t in inputs)
    A_log, D, dt_bias = (t.double().cpu() for t in p)
    h, g = x.shape[1], B.shape[1]
    A, s, ys = -torch.exp(A_log), torch.zeros(h, x.shape[2], B.shape[2], dtype=torch.float64), []
    for t in range(x.shape[0]):
        d = F.softplus(dt[t] + dt_bias).clamp(*dt_limit)
        b, c = B[t].repeat_interleave(h // g, 0), C[t].repeat_interleave(h // g, 0)
        s = torch.exp(d * A)[:, None, None] * s + (d[:, None] * x[t])[..., None] * b[:, None, :]
        ys.append((s * c[:, None, :]).sum(-1) + D[:, None] * x[t])
        if state_dtype is not None and (t + 1) % chunk == 0:
            s = s.to(state_dtype).double()
    return torch.stack(ys), s


@pytest.mark.parametrize("t", LENGTHS)
def test_prefill_chunked_prefill_decode_and_trainer_give_the_same_bits(gen, t):
    p, inputs = params(gen), tokens(gen, t)
    trainer = ssd(SPEC, *inputs, *p, SeqSpans((0, t), (0,)))
    whole, whole_state = passes(SPEC, inputs, p, [0, t])
    chunked, chunked_state = passes(SPEC, inputs, p, CUTS[t])
    decoded, decoded_state = passes(SPEC, inputs, p, decode_cuts(t))
    assert torch.equal(whole, trainer) and torch.equal(chunked, trainer) and torch.equal(decoded, trainer)
    open_tokens = t % Q
    for state in (chunked_state, decoded_state):
        assert torch.equal(state.ssm[1], whole_state.ssm[1])
        for name in ("x", "dt", "B"):
            assert torch.equal(getattr(state, name)[1, :open_tokens], getattr(whole_state, name)[1, :open_tokens])
        assert torch.equal(state_after(state, 1, t, p[0]), state_after(whole_state, 1, t, p[0]))
    torch.testing.assert_close(trainer.double(), loop(inputs, p)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state_after(whole_state, 1, t, p[0]).double(), loop(inputs, p)[1], rtol=1e-5, atol=1e-5)


def test_the_stock_paths_differ_on_the_same_cases(gen):
    """Negative controls: baseline's one-step recurrence in decode and its chunked scan from each call's first token
    move bits (the consistent path's tests above would see that), while staying close."""
    base = SPEC.with_mode("baseline")
    p = params(gen)
    decode_moved = chunk_moved = 0
    for t in LENGTHS[1:]:
        inputs = tokens(gen, t)
        whole, _ = passes(base, inputs, p, [0, t])
        decoded, _ = passes(base, inputs, p, [0, 1] + decode_cuts(t)[2:])
        chunked, _ = passes(base, inputs, p, CUTS[t])
        torch.testing.assert_close(decoded, whole, rtol=1e-4, atol=1e-4)
        decode_moved += not torch.equal(decoded, whole)
        chunk_moved += not torch.equal(chunked, whole)
    assert decode_moved == len(LENGTHS) - 1 and chunk_moved >= 2


def test_a_sequence_has_its_bits_beside_any_others(gen):
    """Three sequences in one pass, each in another phase (a fresh prompt, a chunk mid-chunk, one decode token),
    give each the bits it has alone."""
    p = params(gen)
    lengths, starts = (11, 6, 1), (0, 13, 21)
    seqs = [tokens(gen, s + n) for s, n in zip(starts, lengths)]
    alone, states = [], []
    for s, n, inputs in zip(starts, lengths, seqs):
        out, state = passes(SPEC, inputs, p, [0, s, s + n] if s else [0, n], slots=3, slot=0)
        alone.append(out[s:]), states.append(state)
    shared = SSDState.empty(3, H, P, G, N, Q, torch.float32, torch.float32)
    for i, (s, inputs) in enumerate(zip(starts, seqs)):  # each sequence's earlier tokens, alone
        if s:
            ssd(SPEC, *piece(inputs, 0, s), *p, SeqSpans((0, s), (0,), (i,)), shared)
    batch = [torch.cat([piece(inputs, s, s + n)[k] for s, n, inputs in zip(starts, lengths, seqs)]) for k in range(4)]
    cu = (0, 11, 17, 18)
    out = ssd(SPEC, *batch, *p, SeqSpans(cu, starts, (0, 1, 2)), shared)
    for i in range(3):
        assert torch.equal(out[cu[i]:cu[i + 1]], alone[i])
        assert torch.equal(shared.ssm[i], states[i].ssm[0])


def test_a_bfloat16_state_is_rounded_at_every_chunk_boundary_in_every_phase(gen):
    """mamba_ssm_cache_dtype bfloat16: the state is rounded at each chunk boundary, in prefill as in decode (the
    same bits), as the float64 loop that rounds there; the loop that never rounds is further away."""
    t = 3 * Q + 3
    p, inputs = params(gen), tokens(gen, t)
    whole, state = passes(SPEC, inputs, p, [0, t], state_dtype=torch.bfloat16)
    decoded, decoded_state = passes(SPEC, inputs, p, decode_cuts(t), state_dtype=torch.bfloat16)
    assert state.ssm.dtype == torch.bfloat16
    assert torch.equal(whole, decoded) and torch.equal(state.ssm, decoded_state.ssm)
    rounded, exact = loop(inputs, p, torch.bfloat16)[0], loop(inputs, p)[0]
    near, far = (whole.double() - rounded).abs().max(), (whole.double() - exact).abs().max()
    assert near < 1e-5 < far


def test_gradients_match_a_float64_recurrence(gen):
    """The trainer's backward (the reference math under autograd) against the plain float64 loop's."""
    t = 2 * Q + 3
    p = [q.clone().requires_grad_() for q in params(gen)]
    inputs = [q.clone().requires_grad_() for q in tokens(gen, t)]
    g_out = torch.randn(t, H, P, generator=gen)
    y = ssd(SPEC, *inputs, *p, SeqSpans((0, t), (0,)))
    got = torch.autograd.grad((y * g_out).sum(), [*inputs, *p])
    leaves = [q.detach().double().requires_grad_() for q in [*inputs, *p]]
    want = torch.autograd.grad((loop(leaves[:4], leaves[4:])[0] * g_out.double()).sum(), leaves)
    for name, a, b in zip(("x", "dt", "B", "C", "A_log", "D", "dt_bias"), got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=lambda m: f"d/d{name}: {m}")


def test_the_trainer_forward_keeps_the_kernel_bits_under_autograd(gen):
    t = Q + 5
    p, inputs = params(gen), tokens(gen, t)
    plain = ssd(SPEC, *inputs, *p, SeqSpans((0, t), (0,)))
    with_grad = ssd(SPEC, *(q.clone().requires_grad_() for q in inputs), *p, SeqSpans((0, t), (0,)))
    assert with_grad.requires_grad and torch.equal(with_grad.detach(), plain)


def test_bad_input_names_the_value(gen):
    p, inputs = params(gen), tokens(gen, 5)
    with pytest.raises(ValueError, match="sequence 0 starts at position 3 but there is no recurrent state"):
        ssd(SPEC, *inputs, *p, SeqSpans((0, 5), (3,)))
    state = SSDState.empty(1, H, P, G, N, 16, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="chunks of 16 tokens, the spec's ssd.chunk is 8"):
        ssd(SPEC, *inputs, *p, SeqSpans((0, 5), (0,), (0,)), state)
    with pytest.raises(ValueError, match="dt is \\[T, heads\\]"):
        ssd(SPEC, inputs[0], inputs[1][:, :3], *inputs[2:], *p, SeqSpans((0, 5), (0,)))
