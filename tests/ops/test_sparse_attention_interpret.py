"""onepath.ops.cuda.sparse_attention under Triton's CPU interpreter: close to the FP32 reference (transformers'
eager recipe with sinks) in FP32 and BF16, a query with no valid candidate gives exact zeros, a query's bits alone
equal its bits in a batch, and a candidate list padded with invalid entries (a longer context in the batch, an
entry bound) gives the same bits."""
from __future__ import annotations

from tests.interpret import (check_recorder, interpreted_checks, kernel_case_tools, patch_gemm_interpreter,
                             print_checks)

CHECKS = ["close_to_reference", "no_valid_candidate_is_zero", "rows_alone_equal_batch", "padding_adds_nothing"]


def _run_checks() -> dict:
    patch_gemm_interpreter()  # the interpreter's own dot reads bf16 as raw integers
    import torch

    from onepath.ops import sparse_attention as SA
    from onepath.ops.cuda import sparse_attention

    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()
    rand, close, _ = kernel_case_tools(gen)
    for dtype, d, heads, length in ((torch.float32, 80, 4, 45), (torch.bfloat16, 144, 20, 70)):
        q, keys = rand(7, heads, d, dtype=dtype), rand(7, length, d, dtype=dtype)
        valid = torch.rand(7, length, generator=gen) < 0.7
        valid[2] = False
        sinks = torch.randn(heads, generator=gen)
        got = sparse_attention.sparse_attention(q, keys, valid, sinks, 0.1, 32)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        ok, why = close(got.float(), SA.reference(q, keys, valid, sinks, 0.1).float(), **tol)
        record("close_to_reference", ok, f"{dtype}: {why}")
        record("no_valid_candidate_is_zero", bool((got[2] == 0).all()), f"{dtype}")
        alone = torch.cat([sparse_attention.sparse_attention(q[i:i + 1], keys[i:i + 1], valid[i:i + 1], sinks, 0.1, 32)
                           for i in range(7)])
        record("rows_alone_equal_batch", torch.equal(alone, got), f"{dtype}")
        padded = torch.cat([keys, rand(7, 50, d, dtype=dtype)], 1)
        more = torch.cat([valid, torch.zeros(7, 50, dtype=torch.bool)], 1)
        record("padding_adds_nothing", torch.equal(sparse_attention.sparse_attention(q, padded, more, sinks, 0.1, 32),
                                                   got), f"{dtype}")
    return results


interpreted, test_sparse_attention_interpreted = interpreted_checks(__file__, "sparse_attention", CHECKS)

if __name__ == "__main__":
    print_checks(_run_checks)


def test_kernel_builds_for_sm90():
    """The kernel as the GPU compiles it, at the launches the model makes (FP32 with IEEE dots, BF16; a head count
    and head width that pad): it builds for sm_90 within shared memory."""
    import triton

    from onepath.ops.cuda import sparse_attention as SA
    from tests.interpret import SM90_SHARED_BYTES, build_sm90

    config = type("Launch", (), dict(num_warps=SA.NUM_WARPS, num_stages=1))
    for dtype, precision, heads, d, kv_tile in (("fp32", "ieee", 4, 80, 32), ("bf16", "tf32", 20, 144, 64),
                                                ("bf16", "tf32", 64, 512, 128)):
        sig = dict(q_ptr=f"*{dtype}", k_ptr=f"*{dtype}", valid_ptr="*i8", sink_ptr="*fp32", o_ptr=f"*{dtype}",
                   L="i32", H="i32", D="i32", scale="fp32", q_st="i32", q_sh="i32", k_st="i32", k_sl="i32",
                   v_st="i32", o_st="i32", o_sh="i32")
        block_dv = min(SA.BLOCK_DV, max(16, triton.next_power_of_2(d)))
        consts = dict(BLOCK_H=max(16, triton.next_power_of_2(heads)),
                      BLOCK_D=min(SA.BLOCK_D, max(16, triton.next_power_of_2(d))), BLOCK_DV=block_dv,
                      KV_TILE=kv_tile, PRECISION=precision)
        built = build_sm90(SA._sparse_attention_kernel, sig, consts, ("q_ptr", "k_ptr", "o_ptr"), config)
        assert built.metadata.shared <= SM90_SHARED_BYTES, (dtype, heads, d, built.metadata.shared)
