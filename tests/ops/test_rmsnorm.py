import torch

from onepath.ops import rmsnorm as R
from tests.ops.batch_probes import max_batch_drift


def test_rmsnorm_batch_invariant(consistent, gen):
    # The stock CPU row reduction happens to be row-serial at these sizes, so this op has no
    # negative control of its own; the model-level tests (tests/engine) carry it.
    hidden = 1000
    x = torch.randn(1, hidden, generator=gen) * 3
    w = torch.randn(hidden, generator=gen)
    assert max_batch_drift(lambda t: R.rmsnorm(consistent, t, w, 1e-6), x, gen) == 0.0


def test_rmsnorm_close_to_reference(consistent, gen):
    x, w = torch.randn(7, 96, generator=gen), torch.randn(96, generator=gen)
    torch.testing.assert_close(R.rmsnorm(consistent, x, w, 1e-5), R.reference(x, w, 1e-5))


def test_add_rmsnorm_equals_add_then_rmsnorm_and_its_gradients(consistent, gen):
    """ops.add_rmsnorm (a decoder layer's residual add fused with the next norm) returns the bits of
    `x + residual` then rmsnorm, in BF16 on awkward shapes, and the unfused pair's gradients. Control: the
    norm of the unrounded FP32 sum gives other bits, so the check sees the rounding of the sum."""
    x = (torch.randn(37, 1030, generator=gen) * 3).bfloat16().requires_grad_()
    r = (torch.randn(37, 1030, generator=gen) * 5).bfloat16().requires_grad_()
    w = torch.randn(1030, generator=gen).bfloat16().requires_grad_()
    normed, summed = R.add_rmsnorm(consistent, x, r, w, 1e-6)
    s = x + r
    ref = R.rmsnorm(consistent, s, w, 1e-6)
    assert torch.equal(summed, s) and torch.equal(normed, ref)
    unrounded = R.rmsnorm(consistent, x.float() + r.float(), w.float(), 1e-6).bfloat16()
    assert not torch.equal(unrounded, normed)
    g_out = torch.randn(normed.shape, generator=gen).bfloat16()
    g_sum = torch.randn(s.shape, generator=gen).bfloat16()
    fused = torch.autograd.grad((normed * g_out).float().sum() + (summed * g_sum).float().sum(), (x, r, w))
    plain = torch.autograd.grad((ref * g_out).float().sum() + (s * g_sum).float().sum(), (x, r, w))
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b)


def test_qk_norm_rope_one_warp_sums_squares_as_four_warps():
    """qk_norm_rope's one-warp launch (ROW_WARP_BLOCK on one warp) sums a row's squares in the layout the
    four-warp BLOCK_H launch (and _rmsnorm_kernel) uses: 8 consecutive elements a thread, 32 lanes, so the
    same in-thread runs meet in the same butterfly (sm_90 builds, no GPU; the bits are compared on the H200 in
    tests/ops/test_rmsnorm_gpu.py). Control: 2 warps over 256 lay out 4 a thread."""
    import os
    import re

    import pytest
    pytest.importorskip("triton.backends.nvidia")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernel is an interpreted function, not compilable")
    from onepath.ops.cuda import rmsnorm, sm90
    sig = dict(x_ptr="*bf16", wq_ptr="*bf16", wk_ptr="*bf16", pos_ptr="*i64", cos_ptr="*bf16", sin_ptr="*bf16",
               out_ptr="*bf16", x_tok_stride="i32", x_head_stride="i32", table_stride="i32", q_heads="i32",
               heads="i32", D="i32", HALF="i32", eps="fp32")
    aligned = ("x_ptr", "wq_ptr", "wk_ptr", "cos_ptr", "sin_ptr", "out_ptr", "D", "table_stride")

    def reduce_layout(block, warps):
        ttgir = sm90.build(rmsnorm._qk_norm_rope_kernel, sig, dict(VEC=8, BLOCK=block, BLOCK_HALF=64), aligned,
                           warps, 3, enable_fp_fusion=False).asm["ttgir"]  # Triton's default stages
        operand = re.search(r'"tt.reduce"\((%[\w]+)\)', ttgir)[1]
        layout = re.search(rf"^\s*{re.escape(operand)} = .*#(blocked\d*)>", ttgir, re.M)[1]
        blocked = re.search(rf"^#{layout} = #ttg.blocked<\{{(.*?)\}}>", ttgir, re.M)[1]
        return re.search(r"sizePerThread = \[(\d+)\], threadsPerWarp = \[(\d+)\]", blocked).groups()

    assert reduce_layout(rmsnorm.ROW_WARP_BLOCK, 1) == reduce_layout(rmsnorm.BLOCK_H, rmsnorm.NUM_WARPS) == ("8", "32")
    assert reduce_layout(rmsnorm.ROW_WARP_BLOCK, 2) != ("8", "32")


def test_gated_rmsnorm_keeps_a_row_bits_in_any_batch_and_matches_the_formula(consistent, gen):
    """Mamba-2's gated norm by group: a row alone or at any position of any batch gives the same bits; the values
    are the grouped formula's (float64 here), and its gradients too."""
    x = torch.randn(1, 96, generator=gen) * 3
    z, w = torch.randn(1, 96, generator=gen), torch.randn(96, generator=gen)
    norm = lambda t: R.gated_rmsnorm(consistent, t, z.expand(t.shape[0], -1), w, 1e-5, 24)
    assert max_batch_drift(norm, x, gen) == 0.0
    xs = torch.randn(5, 96, generator=gen, dtype=torch.float64).requires_grad_()
    zs = torch.randn(5, 96, generator=gen, dtype=torch.float64).requires_grad_()
    w64 = w.double().requires_grad_()
    h = (xs * torch.sigmoid(zs) * zs).view(5, 4, 24)
    want = w64 * (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).view(5, 96)
    got = R.gated_rmsnorm(consistent, xs.float(), zs.float(), w, 1e-5, 24)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    leaves = [t.detach().float().requires_grad_() for t in (xs, zs, w64)]
    grads = torch.autograd.grad(R.gated_rmsnorm(consistent, *leaves, 1e-5, 24).sum(), leaves)
    for a, b in zip(grads, torch.autograd.grad(want.sum(), (xs, zs, w64))):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_gated_rmsnorm_refuses_groups_that_do_not_split_the_row(consistent):
    import pytest
    with pytest.raises(ValueError, match="split into groups of 7"):
        R.gated_rmsnorm(consistent, torch.ones(2, 24), torch.ones(2, 24), torch.ones(24), 1e-5, 7)


def test_cast_last_is_deepseek_v4s_norm(consistent, baseline, gen):
    """cast_last: BF16 rows and an FP32 weight give transformers' DeepseekV4RMSNorm (round(w * normed), out in x's
    dtype) within the tree sum's last bit, a row's bits alone = in a batch; Llama's order (round, then scale) gives
    other bits and an FP32 output."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm
    x = (torch.randn(37, 1030, generator=gen) * 3).bfloat16()
    w = torch.randn(1030, generator=gen) + 1.0
    norm = DeepseekV4RMSNorm(1030, eps=1e-6)
    norm.weight.data.copy_(w)
    with torch.no_grad():
        want = norm(x)
    for spec in (consistent, baseline):
        got = R.rmsnorm(spec, x, w, 1e-6, cast_last=True)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=0, atol=0.02)
    assert torch.equal(R.rmsnorm(baseline, x, w, 1e-6, cast_last=True), want)
    got = R.rmsnorm(consistent, x, w, 1e-6, cast_last=True)
    assert torch.equal(torch.cat([R.rmsnorm(consistent, x[i:i + 1], w, 1e-6, cast_last=True) for i in range(37)]), got)
    llama = R.rmsnorm(consistent, x, w, 1e-6)
    assert llama.dtype == torch.float32 and not torch.equal(llama.bfloat16(), got)
