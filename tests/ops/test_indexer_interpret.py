"""onepath.ops.cuda.indexer (index_scores) under Triton's CPU interpreter: close to the FP32 reference in FP32 and
BF16, -inf where invalid; the same bits from keys gathered per query [T, L, d] and from contiguous rows [L, d]
shared by every query (the paged decode and the prefill read); a query alone equals it in a batch, and a longer
candidate list leaves the scores of the shared entries as they were. The FP8 scorer (index_scores_fp8: e4m3 codes,
the key's row scale after the head sum) the same, against the CPU's exact-dot FP8 path; it builds for sm_90 on an
e4m3 MMA."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.interpret import (SM90_SHARED_BYTES, check_recorder, compile_sm90, interpreted_checks, kernel_case_tools,
                             patch_fp8_gemm_interpreter, patch_gemm_interpreter, print_checks)

CHECKS = ["close_to_reference", "contiguous_equals_gathered", "rows_alone_equal_batch", "longer_list_keeps_scores",
          "fp8_close_to_cpu_fp8", "fp8_contiguous_equals_gathered", "fp8_rows_alone_equal_batch",
          "fp8_longer_list_keeps_scores"]


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
    fp8_checks(gen, record, rand, close)
    return results


def fp8_checks(gen, record, rand, close):
    """index_scores_fp8 on the codes the op makes (ops/indexer.py's fold and quantiser), d of one and two 128-wide
    dots, heads padded to 16 and 32."""
    patch_fp8_gemm_interpreter()  # e4m3 dots summed exactly (Hopper's partial of one dot), RNE casts
    import torch

    from onepath.numerics.quant import quantize_fp8
    from onepath.numerics.spec import FP8_INDEX, ExecutionSpec
    from onepath.ops import indexer as IX
    from onepath.ops.cuda import indexer

    cpu = ExecutionSpec.default(quant="fp8_indexer")
    for heads, d, length in ((4, 24, 70), (20, 200, 150)):
        q, shared, w = rand(9, heads, d, dtype=torch.float32), rand(length, d, dtype=torch.float32), rand(9, heads)
        valid = torch.rand(9, length, generator=gen) < 0.8
        q8, k8 = quantize_fp8(q, FP8_INDEX), quantize_fp8(shared, FP8_INDEX)
        folded = IX.fold(w, q8.scales, d ** -0.5, heads ** -0.5)
        gathered = k8.codes.expand(9, -1, -1).contiguous()
        scales = k8.scales[:, 0].expand(9, -1).contiguous()
        got = indexer.index_scores_fp8(q8.codes, gathered, scales, folded, valid)
        want = IX.index_scores(cpu, q, shared, w, valid, d ** -0.5, heads ** -0.5)
        ok, why = close(got, want, rtol=1e-5, atol=1e-5)  # the same exact dots; the head sums' orders differ
        record("fp8_close_to_cpu_fp8", ok and bool(torch.isinf(got[~valid]).all()), f"d={d}: {why}")
        record("fp8_contiguous_equals_gathered",
               torch.equal(indexer.index_scores_fp8(q8.codes, k8.codes, k8.scales[:, 0], folded, valid), got), f"{d}")
        alone = torch.cat([indexer.index_scores_fp8(q8.codes[i:i + 1], gathered[i:i + 1], scales[i:i + 1],
                                                    folded[i:i + 1], valid[i:i + 1]) for i in range(9)])
        record("fp8_rows_alone_equal_batch", torch.equal(alone, got), f"d={d}")
        extra = quantize_fp8(rand(9, 33, d, dtype=torch.float32), FP8_INDEX)
        longer = indexer.index_scores_fp8(q8.codes, torch.cat([gathered, extra.codes], 1),
                                          torch.cat([scales, extra.scales[..., 0]], 1), folded,
                                          torch.cat([valid, torch.ones(9, 33, dtype=torch.bool)], 1))
        record("fp8_longer_list_keeps_scores", torch.equal(longer[:, :length], got), f"d={d}")


@pytest.mark.parametrize("heads", [16, 64])
def test_fp8_kernel_builds_for_sm90_on_an_e4m3_wgmma(heads):
    """What a launch compiles for the H200 (the Triton wheel's ptxas, no GPU), at DeepSeek-V4-Flash's indexer shape
    (64 heads, index_head_dim 128) and a small one: e4m3 x e4m3 wgmma with FP32 accumulators, no mma.sync (which
    would upcast the codes to f16: another arithmetic)."""
    from onepath.ops.cuda import indexer as ix

    sig = {"q_ptr": "*fp8e4nv", "k_ptr": "*fp8e4nv", "s_ptr": "*fp32", "w_ptr": "*fp32", "valid_ptr": "*i8",
           "o_ptr": "*fp32", "softmax_scale": "fp32", "weights_scale": "fp32",
           **{n: "i32" for n in ("L", "H", "D", "q_st", "q_sh", "k_st", "k_sl", "s_st", "w_st", "v_st", "o_st")}}
    consts = dict(BLOCK_H=ix.block_h(heads, fp8=True), BLOCK_L=ix.BLOCK_L, BLOCK_D=ix.BLOCK_D_FP8, PRECISION="tf32",
                  FP8=True)
    ptx, shared = compile_sm90(ix._index_scores_kernel, sig, consts, ("q_ptr", "k_ptr"),
                               SimpleNamespace(num_warps=ix.NUM_WARPS, num_stages=3))  # the launch's default
    assert "wgmma.mma_async" in ptx and ".f32.e4m3.e4m3" in ptx and "mma.sync" not in ptx
    assert shared <= SM90_SHARED_BYTES


interpreted, test_index_scores_interpreted = interpreted_checks(__file__, "index_scores", CHECKS)

if __name__ == "__main__":
    print_checks(_run_checks)
