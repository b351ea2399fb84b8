"""The Triton rmsnorm kernels on the GPU (BF16, model shapes): batch invariance, determinism and values; the fused
QK-norm + RoPE equal to rmsnorm then rope, with the stock path as its negative control.

Probe rows are computed alone, then embedded at random positions of random batches of M rows for every M in
MS (tests/ops/batch_probes.py): each copy must give the probe's bits (torch.equal), every launch twice the same
bits. torch's
generic reduction (`.mean` over the last dim) picks its block shape from the number of rows, so a row's bits can
move with M; on the H200 it did not for rmsnorm's shapes (reported in test_rmsnorm_rows_alone)."""
import pytest
import torch

from onepath.ops import rmsnorm as RN
from onepath.ops import rope as RP
from onepath.ops.cuda import rmsnorm
from onepath.ops.cuda.rope import rope
from tests.ops.batch_probes import BF16, EPS, MS, gen, places, randn, rows_alone_differ

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


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
        parts = torch.cat([rope(rmsnorm.rmsnorm(qk[:, :q_heads], wq, EPS), pos, cos, sin),
                           rope(rmsnorm.rmsnorm(qk[:, q_heads:], wk, EPS), pos, cos, sin)], dim=1)
        stock = torch.cat([RP.reference(RN.reference(qk[:, :q_heads], wq, EPS), cos[pos], sin[pos]),
                           RP.reference(RN.reference(qk[:, q_heads:], wk, EPS), cos[pos], sin[pos])], dim=1)
        return fused, parts, stock

    for tokens in (1, 7, 300):
        fused, parts, stock = both(tokens)
        assert torch.equal(fused, parts), f"head_dim {dim}, {tokens} tokens: fused != rmsnorm then rope"
    assert not torch.equal(fused, stock), f"head_dim {dim}: the stock path gave the same bits: no control"
