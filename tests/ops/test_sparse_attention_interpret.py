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
