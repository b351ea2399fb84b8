"""onepath.ops.cuda.mhc (hc_pre, hc_head, hc_post) under Triton's CPU interpreter: close to mhc.consistent on random
streams (1, 3 and 4 streams, K in one split and in several, FP32 and BF16); on streams whose mixing GEMM is exact in
any order (entries +-1, fn on a 2^-12 grid, norm_eps 0) and with the CPU's exp in the interpreter, mhc.consistent's
bits exactly, the CPU's sigmoid taken as 1 / (1 + exp(-z)) as the kernel writes it: so the norm's factor, the
epilogue and Sinkhorn's order are the CPU's; hc_post is mhc.consistent_post's bits with nothing installed; a token
alone equals it in a batch, at any position. Controls: a split of K chosen from the batch (as the stock kernels
do) moves bits, and so does the stock GEMM (mhc.reference_pre at M = 1 against the batch) on the same case."""
from __future__ import annotations

from tests.interpret import (check_recorder, interpreted_checks, kernel_case_tools, patch_cpu_exp,
                             patch_gemm_interpreter, print_checks)

CHECKS = ["close_to_cpu_consistent", "exact_gemm_equals_cpu_consistent", "post_equals_cpu_consistent",
          "rows_alone_equal_batch", "split_from_the_batch_moves_bits", "stock_gemm_moves_bits"]

EPS, HC_EPS = 1e-6, 1e-6


def _run_checks() -> dict:
    patch_gemm_interpreter()  # a row-independent dot (the interpreter's own is OpenBLAS's) and bf16 rounding as the GPU's
    import torch

    from onepath.ops import ExecutionSpec
    from onepath.ops import mhc as M
    from onepath.ops import sigmoid as S
    from onepath.ops.cuda import mhc
    from onepath.ops.pinned import pinned_unary

    cpu = ExecutionSpec.default("consistent", "cpu")
    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()
    rand, close, embedded = kernel_case_tools(gen)

    def streams(t, n, d, dtype, exact=False):
        if exact:
            x = (torch.randint(0, 2, (t, n, d), generator=gen) * 2 - 1).to(dtype)
            fn = torch.randint(-255, 256, ((2 + n) * n, n * d), generator=gen) / 4096
        else:
            x, fn = rand(t, n, d, dtype=dtype), torch.randn((2 + n) * n, n * d, generator=gen) / (n * d) ** 0.5
        return x, fn, torch.randn((2 + n) * n, generator=gen), torch.randn(3, generator=gen)

    def kernel_outputs(x, fn, base, scale, eps, iters, split_k):
        n = x.shape[1]
        return (*mhc.hc_pre(x, fn, base, scale, eps, HC_EPS, iters, split_k),
                mhc.hc_head(x, fn[:n], base[:n], scale[:1], eps, HC_EPS, split_k))

    def cpu_outputs(x, fn, base, scale, eps, iters):
        n = x.shape[1]
        return (*M.consistent_pre(cpu, x, fn, base, scale, eps, HC_EPS, iters),
                M.consistent_head(cpu, x, fn[:n], base[:n], scale[:1], eps, HC_EPS))

    # (t, n, d, dtype, iters, split_k): K = n d in one split and in several (the last one partial)
    cases = [(5, 4, 24, torch.float32, 20, 1024), (11, 3, 40, torch.float32, 5, 64),
             (4, 1, 36, torch.float32, 3, 16), (6, 4, 36, torch.bfloat16, 4, 64)]
    for t, n, d, dtype, iters, split_k in cases:
        x, fn, base, scale = streams(t, n, d, dtype)
        got = kernel_outputs(x, fn, base, scale, EPS, iters, split_k)
        want = cpu_outputs(x, fn, base, scale, EPS, iters)
        for name, a, b in zip(("post", "comb", "collapsed", "head"), got, want):
            tol = dict(rtol=1e-5, atol=1e-6) if a.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
            ok, why = close(a.float(), b.float(), **tol)
            record("close_to_cpu_consistent", ok, f"{(t, n, d, dtype)} {name}: {why}")
        out = rand(t, d, dtype=dtype)
        post = mhc.hc_post(out, x, want[0], want[1])
        record("post_equals_cpu_consistent", torch.equal(post, M.consistent_post(out, x, want[0], want[1])),
               f"{(t, n, d, dtype)}")
        alone = [kernel_outputs(x[i:i + 1], fn, base, scale, EPS, iters, split_k) for i in range(t)]
        for j, name in enumerate(("post", "comb", "collapsed", "head")):
            record("rows_alone_equal_batch", torch.equal(torch.cat([a[j] for a in alone]), got[j]),
                   f"{(t, n, d, dtype)} {name} alone")
        record("rows_alone_equal_batch", torch.equal(torch.cat([mhc.hc_post(out[i:i + 1], x[i:i + 1], want[0][i:i + 1],
                                                                            want[1][i:i + 1]) for i in range(t)]),
                                                     post), f"{(t, n, d, dtype)} hc_post alone")
        big, pos = embedded(x[1:3], 9, lambda m: rand(m, n, d, dtype=dtype))
        inside = kernel_outputs(big, fn, base, scale, EPS, iters, split_k)
        record("rows_alone_equal_batch", all(torch.equal(a[pos:pos + 2], b[1:3]) for a, b in zip(inside, got)),
               f"{(t, n, d, dtype)} at {pos} of 10")
        if split_k == 64:  # a split count from the batch: 64 columns alone, 32 in the batch
            moved = kernel_outputs(x, fn, base, scale, EPS, iters, 32)
            record("split_from_the_batch_moves_bits", not all(torch.equal(a, b) for a, b in zip(moved, got)),
                   f"{(t, n, d, dtype)}")
    # the stock ops: F.linear at M = 1 is another CPU kernel than over the batch
    x, fn, base, scale = streams(37, 4, 64, torch.float32)
    batch = M.reference_pre(x, fn, base, scale, EPS, HC_EPS, 20)
    alone = [M.reference_pre(x[i:i + 1], fn, base, scale, EPS, HC_EPS, 20) for i in range(37)]
    record("stock_gemm_moves_bits", not torch.equal(torch.cat([a[2] for a in alone]), batch[2]),
           "the stock GEMM gave a token alone its batch bits")

    patch_cpu_exp()
    S.KERNELS["consistent", "cpu"] = lambda z: 1 / (1 + pinned_unary(torch.exp, -z.float()))
    for t, n, d, dtype, iters, split_k in cases:
        x, fn, base, scale = streams(t, n, d, dtype, exact=True)
        got = kernel_outputs(x, fn, base, scale, 0.0, iters, split_k)
        want = cpu_outputs(x, fn, base, scale, 0.0, iters)
        for name, a, b in zip(("post", "comb", "collapsed", "head"), got, want):
            record("exact_gemm_equals_cpu_consistent", torch.equal(a, b), f"{(t, n, d, dtype)} {name}")
    return results


interpreted, test_mhc_interpreted = interpreted_checks(__file__, "mhc", CHECKS)

if __name__ == "__main__":
    print_checks(_run_checks)


def test_kernels_build_for_sm90_with_their_roundings():
    """The kernels as the H200 compiles them (4 streams, BF16 streams): within shared memory, the mixing dot on
    FMAs in IEEE FP32 (no tensor-core MMA: TF32 would round its inputs), IEEE division, and outside the dot no
    product contracted into an FMA. Control: the epilogue built with FP contraction on has FMAs."""
    from onepath.ops.cuda import mhc
    from tests.interpret import SM90_SHARED_BYTES, build_sm90

    def build(kernel, sig, consts, aligned, fusion=False):
        config = type("Launch", (), dict(num_warps=mhc.NUM_WARPS, num_stages=1, enable_fp_fusion=fusion))
        built = build_sm90(kernel, sig, consts, aligned, config)
        assert built.metadata.shared <= SM90_SHARED_BYTES
        return built.asm["ptx"]

    sig = dict(x_ptr="*bf16", fn_ptr="*fp32", mix_ptr="*fp32", sq_ptr="*fp32", T="i32", K="i32", J="i32",
               x_st="i32", mix_ss="i32", sq_ss="i32")
    for j_pad in (16, 32):  # hc_head's 4 rows of fn, hc_pre's 24
        ptx = build(mhc._mix_partials_kernel, sig, dict(SPLIT_K=mhc.SPLIT_K, BLOCK_T=mhc.BLOCK_T, BLOCK_K=mhc.BLOCK_K,
                                                         J_PAD=j_pad), ("x_ptr", "fn_ptr", "mix_ptr", "sq_ptr"))
        assert "mma" not in ptx and "fma.rn.f32" in ptx, j_pad
    sig = dict(x_ptr="*bf16", mix_ptr="*fp32", sq_ptr="*fp32", base_ptr="*fp32", scale_ptr="*fp32", post_ptr="*fp32",
               comb_ptr="*fp32", out_ptr="*bf16", T="i32", N="i32", D="i32", K="i32", splits="i32", J="i32",
               mix_ss="i32", sq_ss="i32", x_st="i32", o_st="i32", norm_eps="fp32", hc_eps="fp32", iters="i32")
    aligned = ("x_ptr", "mix_ptr", "sq_ptr", "out_ptr")
    for head in (False, True):
        ptx = build(mhc._hc_mix_kernel, sig, dict(N_PAD=4, BLOCK_D=mhc.BLOCK_D, HEAD=head), aligned)
        assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx and "fma.rn" not in ptx, head
        assert "div.full" not in ptx and "div.approx" not in ptx, head
    assert "fma.rn" in build(mhc._hc_mix_kernel, sig, dict(N_PAD=4, BLOCK_D=mhc.BLOCK_D, HEAD=False), aligned, True)
    sig = dict(out_ptr="*bf16", x_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32", y_ptr="*bf16", N="i32", D="i32",
               o_st="i32", x_st="i32", x_sn="i32", y_st="i32", y_sn="i32")
    ptx = build(mhc._hc_post_kernel, sig, dict(N_PAD=4, BLOCK_D=mhc.BLOCK_D),
                ("out_ptr", "x_ptr", "post_ptr", "comb_ptr", "y_ptr"))
    assert "fma.rn" not in ptx
