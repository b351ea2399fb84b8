"""onepath.ops.cuda.rmsnorm (rmsnorm, rmsnorm_residual, qk_norm_rope) under Triton's CPU interpreter.

Tiny shapes that still cross a chunk boundary (H > BLOCK_H).
The checks run in a subprocess (tests/interpret.py); the bits of Hopper's arithmetic are
tests/ops/test_rmsnorm_gpu.py's job.
"""
from __future__ import annotations

from tests.interpret import check_recorder, interpreted_checks, kernel_case_tools, patch_bf16_rounding, print_checks

CHECKS = ["rmsnorm_values", "rmsnorm_cast_last", "rmsnorm_rows_alone_equal_rows_in_batch", "rmsnorm_residual",
          "rmsnorm_misaligned_input", "qk_norm_rope_equals_norm_then_rope"]


def _run_checks() -> dict:
    patch_bf16_rounding()
    import torch

    from onepath.ops import rmsnorm as RN
    from onepath.ops.cuda import rmsnorm
    from onepath.ops.cuda.rope import rope

    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()
    rand, close, embedded = kernel_case_tools(gen)

    # rmsnorm: H = 1030 walks a full 1024 chunk and a masked 6-wide tail.
    for dtype in (torch.bfloat16, torch.float32):
        for h in (40, 1030):
            x, w = rand(5, h, dtype=dtype, scale=3), rand(h, dtype=dtype)
            ok, why = close(rmsnorm.rmsnorm(x, w, 1e-6), RN.reference(x, w, 1e-6))
            record("rmsnorm_values", ok, f"{dtype} H={h}: {why}")
    # cast_last (DeepSeek-V4's norm: an FP32 weight applied before the one rounding to x's dtype)
    for h in (40, 1030):
        x, w = rand(5, h, dtype=torch.bfloat16, scale=3), rand(h, dtype=torch.float32)
        got, want = rmsnorm.rmsnorm(x, w, 1e-6, cast_last=True), RN.reference(x, w, 1e-6, cast_last=True)
        ok, why = close(got, want)
        record("rmsnorm_cast_last", ok and got.dtype == torch.bfloat16, f"H={h}: {why} {got.dtype}")
    h = 1030
    w = rand(h)
    probe = rand(1, h, scale=3)
    alone = rmsnorm.rmsnorm(probe, w, 1e-5)
    for m in (1, 2, 3, 7):
        batch, pos = embedded(probe, m, lambda n: rand(n, h, scale=3))
        record("rmsnorm_rows_alone_equal_rows_in_batch", torch.equal(rmsnorm.rmsnorm(batch, w, 1e-5)[pos], alone[0]),
               f"M={m} pos={pos}")
    x, r = rand(4, h, scale=2), rand(4, h, scale=2)
    normed, summed = rmsnorm.rmsnorm_residual(x, r, w, 1e-5)
    record("rmsnorm_residual", torch.equal(summed, x + r), "new residual != x + residual")
    record("rmsnorm_residual", torch.equal(normed, rmsnorm.rmsnorm(x + r, w, 1e-5)), "normed != rmsnorm(x + residual)")
    x3 = rand(2, 3, h)
    flat_out = rmsnorm.rmsnorm(x3.reshape(6, h), w, 1e-5)
    record("rmsnorm_residual", torch.equal(rmsnorm.rmsnorm(x3, w, 1e-5).reshape(6, h), flat_out), "leading dims")
    # A view one element off 16-byte alignment (and odd H) takes aligned_rows' copy: same bits.
    for hh in (1030, 37):
        ww = rand(hh)
        flat = rand(1 + 3 * hh)
        odd = flat[1:].view(3, hh)
        same = torch.equal(rmsnorm.rmsnorm(odd, ww, 1e-5), rmsnorm.rmsnorm(odd.clone(), ww, 1e-5))
        record("rmsnorm_misaligned_input", same, f"H={hh}")


    dim, positions_max = 24, 64
    cos, sin = torch.randn(positions_max, dim // 2, generator=gen), torch.randn(positions_max, dim // 2, generator=gen)
    # qk_norm_rope: 3 q heads and 2 k heads of a stacked qkv view (v's 2 heads after them), D = 24; the
    # bits of rmsnorm then rope, each part by its own weight; a token alone equals it in a batch.
    wq, wk = rand(dim, scale=0.5) + 1, rand(dim, scale=0.5) + 1
    qkv = rand(7, 7, dim, scale=3)
    qk, pos = qkv[:, :5], torch.randint(0, positions_max, (7,), generator=gen)
    fused = rmsnorm.qk_norm_rope(qk, wq, wk, 3, 1e-6, pos, cos, sin)
    parts = [rope(rmsnorm.rmsnorm(qk[:, :3], wq, 1e-6), pos, cos, sin),
             rope(rmsnorm.rmsnorm(qk[:, 3:], wk, 1e-6), pos, cos, sin)]
    record("qk_norm_rope_equals_norm_then_rope", torch.equal(fused, torch.cat(parts, dim=1)), "fused != two ops")
    swapped = rmsnorm.qk_norm_rope(qk, wk, wq, 3, 1e-6, pos, cos, sin)
    record("qk_norm_rope_equals_norm_then_rope", not torch.equal(swapped, fused), "the weights are not read")
    alone = rmsnorm.qk_norm_rope(qk[4:5].clone(), wq, wk, 3, 1e-6, pos[4:5], cos, sin)
    record("qk_norm_rope_equals_norm_then_rope", torch.equal(alone[0], fused[4]), "a token alone != in its batch")

    return results


interpreted, test_rmsnorm_interpreted = interpreted_checks(__file__, "rmsnorm", CHECKS)


if __name__ == "__main__":
    print_checks(_run_checks)
