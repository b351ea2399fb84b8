"""The Triton rmsnorm, silu_mul, rope and token-logprobs kernels on the GPU (BF16, model shapes):
batch invariance, determinism and values, with the stock CUDA ops as negative controls; the fused
QK-norm + RoPE equal to rmsnorm then rope.

Probe rows are computed alone, then embedded at random positions of random batches of M rows for
every M in MS: each copy must give the probe's bits (torch.equal), every launch twice the same bits.
Negative controls run the same harness on the stock path (onepath/ops/*.py `reference`): torch's
generic reduction (`.mean` / `.sum` over the last dim) picks its block shape from the number of rows
(512 threads on a row at M = 1, 32 at M = 4096), so a row's bits move with M. Stock elementwise
ops (F.silu, products) and torch.log_softmax (one block per row, sized by V alone) have no such
dispatch: they are expected invariant and are reported, not asserted.
"""
import pytest
import torch

from onepath.ops import logprobs as LP
from onepath.ops import rmsnorm as RN
from onepath.ops import rope as RP
from onepath.ops import silu_mul as SM
from onepath.ops.cuda import elementwise, logprobs, rmsnorm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MS = (1, 2, 7, 64, 100, 1000, 4096)
# torch's default BF16 tolerance: kernel and reference may round one intermediate differently.
BF16 = dict(rtol=1.6e-2, atol=1e-5)
# FP32 log-probs against a float64 reference: approximate exp/log, fp32 sums over V terms.
LOGPROB = dict(rtol=1e-5, atol=1e-4)
PROBS = dict(rtol=1e-4, atol=1e-8)
EPS = 1e-6


def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(g, *shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


def places(g, m, k):
    """min(k, m) distinct random rows of an m-row batch."""
    return torch.randperm(m, generator=g, device="cuda")[:min(k, m)].tolist()


def rows_alone_differ(fn, inputs, rows):
    """How many of `rows` get other bits alone (an M = 1 launch) than in the full batch."""
    as_tuple = lambda out: out if isinstance(out, tuple) else (out,)
    full = as_tuple(fn(*inputs))
    differ = 0
    for r in rows:
        alone = as_tuple(fn(*(x[r:r + 1] for x in inputs)))
        differ += any(not torch.equal(a[0], f[r]) for a, f in zip(alone, full))
    return differ


@pytest.mark.parametrize("hidden", [1024, 4096, 5120])
def test_rmsnorm_batch_invariant_deterministic_close(hidden):
    g = gen(hidden)
    w = randn(g, hidden)
    probes, probe_res = randn(g, 3, hidden, scale=3), randn(g, 3, hidden, scale=3)
    alone = [rmsnorm.rmsnorm(p[None], w, EPS)[0] for p in probes]
    alone_res = [rmsnorm.rmsnorm_residual(p[None], r[None], w, EPS) for p, r in zip(probes, probe_res)]
    for m in MS:
        x, res = randn(g, m, hidden, scale=3), randn(g, m, hidden, scale=3)
        at = places(g, m, 3)
        for i, row in enumerate(at):
            x[row], res[row] = probes[i], probe_res[i]
        out = rmsnorm.rmsnorm(x, w, EPS)
        normed, summed = rmsnorm.rmsnorm_residual(x, res, w, EPS)
        assert torch.equal(out, rmsnorm.rmsnorm(x, w, EPS)), f"rmsnorm not deterministic: H {hidden}, M {m}"
        assert torch.equal(normed, rmsnorm.rmsnorm_residual(x, res, w, EPS)[0]), f"residual: H {hidden}, M {m}"
        for i, row in enumerate(at):
            assert torch.equal(out[row], alone[i]), f"rmsnorm: H {hidden}, M {m}, row {row}"
            assert torch.equal(normed[row], alone_res[i][0][0]), f"rmsnorm_residual: H {hidden}, M {m}, row {row}"
        assert torch.equal(summed, x + res), f"new residual != x + residual: H {hidden}, M {m}"
        assert torch.equal(normed, rmsnorm.rmsnorm(x + res, w, EPS)), f"fused != unfused residual: H {hidden}, M {m}"
        torch.testing.assert_close(out, RN.reference(x, w, EPS), **BF16)


def test_rmsnorm_rows_alone():
    # No negative control: on the H200 (torch 2.11, 2026-11-29) the stock x.pow(2).mean(-1) gave all
    # 1024 rows the same bits alone and at M=4096 (each row reduced by one block whatever M is).
    hidden, rows = 4096, range(1024)
    g = gen(7)
    x, w = randn(g, 4096, hidden, scale=3), randn(g, hidden)
    assert rows_alone_differ(lambda x: rmsnorm.rmsnorm(x, w, EPS), (x,), rows) == 0


@pytest.mark.parametrize("width", [3072, 11008])
def test_silu_mul_batch_invariant_deterministic_close(width):
    # Stock F.silu(g) * u is elementwise with no batch-dependent dispatch: no negative control exists.
    g = gen(width)
    probes = randn(g, 2, 2 * width, scale=4)  # [gate | up], as one fused projection produces them
    alone = [elementwise.silu_mul(p[None, :width], p[None, width:])[0] for p in probes]
    for m in MS:
        fused = randn(g, m, 2 * width, scale=4)
        at = places(g, m, 2)
        for i, row in enumerate(at):
            fused[row] = probes[i]
        gate, up = fused[:, :width], fused[:, width:]
        out = elementwise.silu_mul(gate, up)
        assert torch.equal(out, elementwise.silu_mul(gate, up)), f"silu_mul not deterministic: I {width}, M {m}"
        assert torch.equal(out, elementwise.silu_mul(gate.contiguous(), up.contiguous())), "views vs copies"
        for i, row in enumerate(at):
            assert torch.equal(out[row], alone[i]), f"silu_mul: I {width}, M {m}, row {row}"
        torch.testing.assert_close(out, SM.reference(gate, up), **BF16)


def test_rope_batch_invariant_and_equal_to_torch():
    # Unfused products (enable_fp_fusion=False) are torch eager's arithmetic: the bits equal the
    # reference's. Stock rope is elementwise as well: no negative control exists.
    heads, dim, max_pos = 16, 128, 8192
    g = gen(11)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device="cuda", dtype=torch.float32) / dim))
    angles = torch.arange(max_pos, device="cuda", dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = angles.cos(), angles.sin()
    probes = randn(g, 2, heads, dim, scale=2)
    probe_pos = torch.tensor([5, 4000], device="cuda")
    alone = [elementwise.rope(p[None], pos[None], cos, sin)[0] for p, pos in zip(probes, probe_pos)]
    for m in MS:
        qkv = randn(g, m, heads + 8, dim, scale=2)  # q as a strided view of a fused qkv
        positions = torch.randint(0, max_pos, (m,), generator=g, device="cuda")
        at = places(g, m, 2)
        for i, row in enumerate(at):
            qkv[row, :heads], positions[row] = probes[i], probe_pos[i]
        q = qkv[:, :heads]
        out = elementwise.rope(q, positions, cos, sin)
        assert torch.equal(out, elementwise.rope(q, positions, cos, sin)), f"rope not deterministic: M {m}"
        for i, row in enumerate(at):
            assert torch.equal(out[row], alone[i]), f"rope: M {m}, row {row}"
        assert torch.equal(out, RP.reference(q, cos[positions], sin[positions])), f"rope != torch eager: M {m}"


def _logits_batch(g, m, vocab, dtype):
    logits = randn(g, m, vocab, scale=4, dtype=dtype)
    temperature = 0.5 + torch.rand(m, generator=g, device="cuda")
    keep = torch.rand(m, vocab, generator=g, device="cuda") < 0.6
    keep[torch.rand(m, generator=g, device="cuda") < 0.3] = True  # rows without a filter
    tokens = torch.randint(0, vocab, (m,), generator=g, device="cuda")
    keep[torch.arange(m, device="cuda"), tokens] = True
    return logits, tokens, temperature, keep


def _float64(logits, tokens, temperature, keep):
    x = (logits.double() / temperature.double()[:, None]).masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(x, dim=-1)
    entropy = -(logp.exp() * logp.masked_fill(~keep, 0.0)).sum(-1)
    return logp.gather(-1, tokens[:, None])[:, 0], entropy, logp.exp()


@pytest.mark.parametrize("vocab,dtype", [(151936, torch.bfloat16), (32000, torch.bfloat16), (32000, torch.float32)])
def test_token_logprobs_batch_invariant_deterministic_close(vocab, dtype):
    g = gen(vocab)
    # probe 0 has no filter and runs alone with keep=None; in a batch its row is all-kept beside
    # other rows' masks. Probe 1 carries a mask.
    p_logits, p_tokens, p_temp, p_keep = _logits_batch(g, 2, vocab, dtype)
    p_keep[0] = True
    alone = [logprobs.token_logprobs(p_logits[i:i + 1], p_tokens[i:i + 1], p_temp[i:i + 1], k)
             for i, k in ((0, None), (1, p_keep[1:2]))]
    alone_p = [logprobs.probs(p_logits[i:i + 1], p_temp[i:i + 1], k) for i, k in ((0, None), (1, p_keep[1:2]))]
    for m in MS:
        logits, tokens, temperature, keep = _logits_batch(g, m, vocab, dtype)
        at = places(g, m, 2)
        for i, row in enumerate(at):
            logits[row], tokens[row], temperature[row], keep[row] = p_logits[i], p_tokens[i], p_temp[i], p_keep[i]
        lp, entropy = logprobs.token_logprobs(logits, tokens, temperature, keep)
        again = logprobs.token_logprobs(logits, tokens, temperature, keep)
        assert torch.equal(lp, again[0]) and torch.equal(entropy, again[1]), f"not deterministic: V {vocab}, M {m}"
        p = logprobs.probs(logits, temperature, keep)
        for i, row in enumerate(at):
            where = f"V {vocab} {dtype}, M {m}, row {row}, probe {i}"
            assert torch.equal(lp[row], alone[i][0][0]), f"logprob: {where}"
            assert torch.equal(entropy[row], alone[i][1][0]), f"entropy: {where}"
            assert torch.equal(p[row], alone_p[i][0]), f"probs: {where}"
        if m <= 100:
            want_lp, want_entropy, want_p = _float64(logits, tokens, temperature, keep)
            torch.testing.assert_close(lp.double(), want_lp, **LOGPROB)
            torch.testing.assert_close(entropy.double(), want_entropy, **LOGPROB)
            torch.testing.assert_close(p.double(), want_p, **PROBS)
        del p


def test_token_logprobs_rows_alone_with_negative_control():
    vocab, rows = 151936, range(64)
    g = gen(13)
    batch = _logits_batch(g, 4096, vocab, torch.bfloat16)
    assert rows_alone_differ(logprobs.token_logprobs, batch, rows) == 0
    assert rows_alone_differ(lambda lg, t, temp, k: logprobs.probs(lg, temp, k), batch, rows) == 0
    stock_lp = rows_alone_differ(lambda *a: LP.reference(*a)[0], batch, rows)
    stock_entropy = rows_alone_differ(lambda *a: LP.reference(*a)[1], batch, rows)
    print(f"stock log_softmax logprob: {stock_lp} of {len(rows)} rows differ alone vs M=4096 "
          f"(expected 0: one block per row); stock entropy (.sum): {stock_entropy}")
    assert stock_entropy > 0, "negative control: the stock entropy's .sum(-1) gave every row the same bits"


@pytest.mark.parametrize("dim", [64, 128, 256, 320])
def test_qk_norm_rope_equals_norm_then_rope_gpu(dim):
    """The fused QK-norm + RoPE (one warp per head when head_dim <= ROW_WARP_BLOCK, else four warps with
    BLOCK_H) gives the bits of rmsnorm() then rope() on every head of a stacked q/k view (v's heads after
    them), for 1, 7 and 300 tokens at random positions. Control: the stock path (torch's mean and rsqrt, then
    rope) on the same heads gives other bits, so the comparison sees a change."""
    g = gen(dim)
    q_heads, k_heads, v_heads = 16, 8, 8
    positions_max = 4096
    theta = 1e6 ** (-torch.arange(0, dim, 2, device="cuda", dtype=torch.float32) / dim)
    angles = torch.arange(positions_max, device="cuda", dtype=torch.float32)[:, None] * theta[None]
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    wq, wk = randn(g, dim, scale=0.3) + 1, randn(g, dim, scale=0.3) + 1

    def both(tokens):
        qkv = randn(g, tokens, q_heads + k_heads + v_heads, dim, scale=3)
        qk = qkv[:, :q_heads + k_heads]
        pos = torch.randint(0, positions_max, (tokens,), device="cuda", generator=g)
        fused = rmsnorm.qk_norm_rope(qk, wq, wk, q_heads, EPS, pos, cos, sin)
        parts = torch.cat([elementwise.rope(rmsnorm.rmsnorm(qk[:, :q_heads], wq, EPS), pos, cos, sin),
                           elementwise.rope(rmsnorm.rmsnorm(qk[:, q_heads:], wk, EPS), pos, cos, sin)], dim=1)
        stock = torch.cat([RP.reference(RN.reference(qk[:, :q_heads], wq, EPS), cos[pos], sin[pos]),
                           RP.reference(RN.reference(qk[:, q_heads:], wk, EPS), cos[pos], sin[pos])], dim=1)
        return fused, parts, stock

    for tokens in (1, 7, 300):
        fused, parts, stock = both(tokens)
        assert torch.equal(fused, parts), f"head_dim {dim}, {tokens} tokens: fused != rmsnorm then rope"
    assert not torch.equal(fused, stock), f"head_dim {dim}: the stock path gave the same bits: no control"
