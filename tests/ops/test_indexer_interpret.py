"""onepath.ops.cuda.indexer (index_scores) under Triton's CPU interpreter: close to the FP32 reference in FP32 and
BF16, -inf where invalid; the same bits from keys gathered per query [T, L, d] and from contiguous rows [L, d]
shared by every query (the paged decode and the prefill read); a query alone equals it in a batch, and a longer
candidate list leaves the scores of the shared entries as they were."""
from __future__ import annotations

from tests.interpret import (check_recorder, interpreted_checks, kernel_case_tools, patch_gemm_interpreter,
                             print_checks)

CHECKS = ["close_to_reference", "contiguous_equals_gathered", "rows_alone_equal_batch", "longer_list_keeps_scores"]


def _run_checks() -> dict:
    patch_gemm_interpreter()  # the interpreter's own dot reads bf16 as raw integers
    import torch

    from onepath.ops import indexer as IX
    from onepath.ops.cuda import indexer

    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()
    rand, close, _ = kernel_case_tools(gen)
    for dtype, heads, d, length in ((torch.float32, 4, 24, 70), (torch.bfloat16, 20, 128, 150)):
        q, shared, w = rand(9, heads, d, dtype=dtype), rand(length, d, dtype=dtype), rand(9, heads, dtype=dtype)
        valid = torch.rand(9, length, generator=gen) < 0.8
        gathered = shared.expand(9, -1, -1).contiguous()
        got = indexer.index_scores(q, gathered, w, valid, d ** -0.5, heads ** -0.5)
        want = IX.reference(q, gathered, w, valid, d ** -0.5, heads ** -0.5)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        ok, why = close(got, want, **tol)
        record("close_to_reference", ok and bool(torch.isinf(got[~valid]).all()), f"{dtype}: {why}")
        record("contiguous_equals_gathered", torch.equal(indexer.index_scores(q, shared, w, valid, d ** -0.5,
                                                                              heads ** -0.5), got), f"{dtype}")
        alone = torch.cat([indexer.index_scores(q[i:i + 1], gathered[i:i + 1], w[i:i + 1], valid[i:i + 1],
                                                d ** -0.5, heads ** -0.5) for i in range(9)])
        record("rows_alone_equal_batch", torch.equal(alone, got), f"{dtype}")
        longer = torch.cat([gathered, rand(9, 33, d, dtype=dtype)], 1)
        more = torch.cat([valid, torch.ones(9, 33, dtype=torch.bool)], 1)
        record("longer_list_keeps_scores", torch.equal(indexer.index_scores(q, longer, w, more, d ** -0.5,
                                                                            heads ** -0.5)[:, :length], got),
               f"{dtype}")
    return results


interpreted, test_index_scores_interpreted = interpreted_checks(__file__, "index_scores", CHECKS)

if __name__ == "__main__":
    print_checks(_run_checks)
