"""The Mamba-2 mixer's kernels on the GPU (ops/cuda/ssd.py, conv1d.py, rmsnorm.gated_rmsnorm; BF16, Hopper's
MMA), at Nemotron-3-Nano's mixer shape (64 heads of 64, 8 groups, state 128, chunk 128), through the ops' tables:

- the scan's output and state after a token are the same bits in a whole prefill, a chunked prefill cut off the
  chunks, decode (the open chunk replayed from the slot) and the trainer's forward, FP32 and BF16 states;
- a sequence's bits alone equal its bits in a pass of 256 sequences in mixed phases;
- a decode step captured in a CUDA graph (positions and slots in static buffers) replays the eager bits;
- conv1d and the gated norm: a row alone equals the row in a batch; values near a float64 loop.
Controls: baseline's stock paths (a chunked scan from each pass's start, the one-step recurrence in decode) move
bits on the same phase cases; the batch control is the model's (tests/models/test_nemotron_h_gpu.py). The whole
GPU set of the hybrid, as one command:

    python -m pytest -q -m gpu tests/ops/test_ssd_gpu.py tests/models/test_nemotron_h_gpu.py \
        tests/consistency/test_hybrid_check_gpu.py
"""
import pytest
import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.conv1d import causal_conv1d
from onepath.ops.conv1d import reference as conv_reference
from onepath.ops.rmsnorm import gated_rmsnorm
from onepath.ops.spans import SeqSpans
from onepath.ops.ssd import SSDState, ssd
from tests.ops.test_ssd import loop

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, P, G, N, Q = 64, 64, 8, 128, 128
LIMIT = (0.0, float("inf"))
LENGTHS = (1, Q - 1, Q, Q + 1, 3 * Q + 45)


def spec(mode="consistent"):
    return ExecutionSpec.default(mode, "cuda").with_op("ssd", chunk=Q)


def params(gen):
    return (torch.log(1 + 15 * torch.rand(H, generator=gen)).cuda(), torch.ones(H, device="cuda"),
            (torch.rand(H, generator=gen) * 4 - 6).cuda())  # A_log, D, dt_bias (dt ~ 1e-3 .. 0.1)


def tokens(gen, t, dtype=torch.bfloat16):
    x, dt = torch.randn(t, H, P, generator=gen).to("cuda", dtype), torch.randn(t, H, generator=gen).cuda()
    return x, dt, torch.randn(t, G, N, generator=gen).to("cuda", dtype), \
        torch.randn(t, G, N, generator=gen).to("cuda", dtype)


def state(dtype=torch.bfloat16, state_dtype=torch.float32, slots=2):
    return SSDState.empty(slots, H, P, G, N, Q, dtype, state_dtype, "cuda")


def passes(sp, inputs, p, cuts, st, slot=1, state_dtype=torch.float32):
    return torch.cat([ssd(sp, *(v[a:b] for v in inputs), *p, SeqSpans.of((0, b - a), (b,), (slot,), "cuda"), st,
                          LIMIT, state_dtype) for a, b in zip(cuts, cuts[1:])])


def cuts_of(t):
    return sorted({0, t, *(c for c in (3, 5, Q - 3, Q + 7, 2 * Q + 1, 3 * Q) if c < t)})


def phases(mode, t, state_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed + t)
    p, inputs = params(gen), tokens(gen, t)
    sp = spec(mode)
    out = {"trainer": ssd(sp, *inputs, *p, SeqSpans((0, t), (0,)), None, LIMIT, state_dtype)}
    states = {}
    for name, cut in (("whole", [0, t]), ("chunked", cuts_of(t)), ("decode", list(range(t + 1)))):
        states[name] = state(state_dtype=state_dtype)
        out[name] = passes(sp, inputs, p, cut, states[name], state_dtype=state_dtype)
    return out, states


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_every_phase_gives_the_trainer_bits_gpu(state_dtype):
    for t in LENGTHS:
        out, states = phases("consistent", t, state_dtype)
        for name in ("whole", "chunked", "decode"):
            assert torch.equal(out[name], out["trainer"]), (t, name, (out[name] - out["trainer"]).abs().max())
            assert torch.equal(states[name].ssm, states["whole"].ssm), (t, name)
            m = t % Q
            for k in ("x", "dt", "B"):
                assert torch.equal(getattr(states[name], k)[1, :m], getattr(states["whole"], k)[1, :m]), (t, name, k)


def test_negative_control_stock_paths_move_bits_gpu():
    moved = 0
    for t in LENGTHS[1:]:
        out, _ = phases("baseline", t)
        moved += (not torch.equal(out["decode"], out["whole"])) + (not torch.equal(out["chunked"], out["whole"]))
    assert moved >= len(LENGTHS)


def test_values_near_a_float64_loop_gpu():
    gen = torch.Generator().manual_seed(1)
    t = 2 * Q + 9
    p, inputs = params(gen), tokens(gen, t, torch.float32)  # FP32: IEEE dots, FP32 tolerance
    y = ssd(spec(), *inputs, *p, SeqSpans((0, t), (0,)), None, LIMIT, torch.float32)
    torch.testing.assert_close(y.double().cpu(), loop(inputs, p)[0], rtol=1e-4, atol=1e-4)
    bf = [v.bfloat16() if v.dtype == torch.float32 and v.dim() == 3 else v for v in inputs]
    y16 = ssd(spec(), *bf, *p, SeqSpans((0, t), (0,)), None, LIMIT, torch.float32)
    torch.testing.assert_close(y16.double().cpu(), loop(bf, p)[0], rtol=5e-2, atol=5e-2)


def batch_of(mode="consistent", seed=2, count=256):
    """A probe continuing its slot mid-chunk, alone and among 255 sequences in mixed phases (fresh prompts,
    chunks from mid-chunk, decode tokens) in one pass."""
    gen = torch.Generator().manual_seed(seed)
    sp = spec(mode)
    p = params(gen)
    starts = torch.randint(0, 3 * Q, (count,), generator=gen).tolist()
    lengths = [1 if i % 3 == 0 else int(torch.randint(1, 2 * Q, (1,), generator=gen)) for i in range(count)]
    seqs = [tokens(gen, s + n) for s, n in zip(starts, lengths)]
    probe = count // 2
    st = state(slots=count + 1)
    for i, (s, inputs) in enumerate(zip(starts, seqs)):  # each sequence's earlier tokens, alone
        if s:
            passes(sp, inputs, p, [0, s], st, slot=i)
    alone_state = SSDState(*(v.clone() for v in (st.ssm, st.x, st.dt, st.B)))
    a, n = starts[probe], lengths[probe]
    alone = passes(sp, seqs[probe], p, [a, a + n], alone_state, slot=probe)
    batch = [torch.cat([v[k][s:s + n] for s, n, v in zip(starts, lengths, seqs)]) for k in range(4)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    ends = [s + n for s, n in zip(starts, lengths)]
    out = ssd(sp, *batch, *p, SeqSpans.of(cu, ends, list(range(count)), "cuda"), st, LIMIT, torch.float32)
    return torch.equal(out[cu[probe]:cu[probe + 1]], alone) and torch.equal(st.ssm[probe], alone_state.ssm[probe])


@pytest.mark.gpu_smoke
def test_alone_equals_in_a_batch_of_256_gpu():
    """(The stock op is batch-invariant here too: its per-sequence scans and batched one-step recurrence are
    not what moves a baseline request's bits in a batch; the model's GEMMs are, and
    tests/models/test_nemotron_h_gpu.py holds that control.)"""
    assert all(batch_of(seed=s) for s in (2, 3))


def test_a_captured_decode_step_replays_the_eager_bits_gpu():
    """ssd and conv1d of a decode step over static buffers (positions, slots), captured once; replayed for 40
    steps of 4 sequences at their own positions, against the same steps run eagerly on a copy of the state."""
    gen = torch.Generator().manual_seed(5)
    sp, p, b, steps = spec(), params(gen), 4, 40
    starts = [7, Q - 2, 3 * Q + 1, 1]
    seqs = [tokens(gen, s + steps) for s in starts]
    conv_w, conv_b = torch.randn(H * P, 4, generator=gen).cuda().bfloat16(), torch.zeros(H * P).cuda().bfloat16()
    st, ring = state(slots=b + 1), torch.zeros(b + 1, 3, H * P, device="cuda", dtype=torch.bfloat16)
    for i, (s, inputs) in enumerate(zip(starts, seqs)):
        passes(sp, inputs, p, [0, s], st, slot=i)
        causal_conv1d(sp, inputs[0][:s].reshape(s, -1), conv_w, conv_b, SeqSpans.of((0, s), (s,), (i,), "cuda"),
                      ring)
    positions, slots = torch.zeros(b, dtype=torch.long, device="cuda"), torch.arange(b, device="cuda")
    bufs = [torch.zeros_like(v[:b]) for v in seqs[0]]

    def step(states, rings, spans):
        y = ssd(sp, *bufs, *p, spans, states, LIMIT, torch.float32)
        c = causal_conv1d(sp, bufs[0].reshape(b, -1), conv_w, conv_b, spans, rings)
        return y, c

    for i, s in enumerate(starts):
        positions[i] = s
        for k in range(4):
            bufs[k][i] = seqs[i][k][s]
    step(st, ring, SeqSpans.decode(positions, slots))  # compile outside the capture (it runs step 0: token s)
    eager_st, eager_ring = SSDState(*(v.clone() for v in (st.ssm, st.x, st.dt, st.B))), ring.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(st, ring, SeqSpans.decode(positions, slots))
    for j in range(1, steps):
        for i, s in enumerate(starts):
            positions[i] = s + j
            for k in range(4):
                bufs[k][i] = seqs[i][k][s + j]
        graph.replay()
        eager = step(eager_st, eager_ring, SeqSpans.of(tuple(range(b + 1)), [s + j + 1 for s in starts],
                                                       list(range(b)), "cuda"))
        assert torch.equal(outs[0], eager[0]) and torch.equal(outs[1], eager[1]), j
    assert torch.equal(st.ssm[:b], eager_st.ssm[:b]) and torch.equal(ring[:b], eager_ring[:b])


def test_conv1d_and_gated_norm_rows_alone_equal_rows_in_a_batch_gpu():
    gen = torch.Generator().manual_seed(6)
    sp, c = spec(), 2 * H * P + 2 * G * N
    w = (torch.randn(c, 4, generator=gen) * 0.5).cuda().bfloat16()
    bias = torch.randn(c, generator=gen).cuda().bfloat16()
    x = torch.randn(300, c, generator=gen).cuda().bfloat16()
    whole = causal_conv1d(sp, x, w, bias, SeqSpans((0, 300), (0,)))
    split = causal_conv1d(sp, x, w, bias, SeqSpans((0, 100, 300), (0, 0)))
    alone = causal_conv1d(sp, x[100:], w, bias, SeqSpans((0, 200), (0,)))
    assert torch.equal(split[100:], alone) and torch.equal(whole[:100], split[:100])
    want = conv_reference(x[:100].float(), w.float(), bias.float(), SeqSpans((0, 100), (0,)))
    torch.testing.assert_close(split[:100].float(), want, rtol=2e-2, atol=2e-2)
    i = H * P
    y, z, wn = torch.randn(257, i, generator=gen).cuda(), torch.randn(257, i, generator=gen).cuda().bfloat16(), \
        torch.ones(i, device="cuda").bfloat16()
    batch = gated_rmsnorm(sp, y, z, wn, 1e-5, i // G)
    for row in (0, 100, 256):
        assert torch.equal(gated_rmsnorm(sp, y[row:row + 1], z[row:row + 1], wn, 1e-5, i // G)[0], batch[row])
