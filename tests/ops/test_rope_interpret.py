"""onepath.ops.cuda.rope run by Triton's CPU interpreter (TRITON_INTERPRET=1).

A partial head block and a partial power-of-two half; q as a strided view of a stacked qkv.
The checks run in a subprocess (tests/interpret.py); the bits of Hopper's arithmetic are
tests/ops/test_rope_gpu.py's job.
"""
from __future__ import annotations

from tests.interpret import check_recorder, interpreted_checks, kernel_case_tools, patch_bf16_rounding, print_checks

CHECKS = ["rope_equals_reference", "rope_rows_alone_equal_rows_in_batch"]


def _run_checks() -> dict:
    patch_bf16_rounding()
    import torch

    from onepath.ops import rope as RP
    from onepath.ops.cuda import rope as kernels

    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()
    rand, close, embedded = kernel_case_tools(gen)

    # rope: 5 heads (a partial head block), D = 24 (half 12, a partial power of two); q as a view of qkv.
    heads, dim, positions_max = 5, 24, 64
    cos, sin = torch.randn(positions_max, dim // 2, generator=gen), torch.randn(positions_max, dim // 2, generator=gen)
    qkv = rand(9, heads + 2, dim, scale=2)
    q = qkv[:, :heads]
    pos = torch.randint(0, positions_max, (9,), generator=gen)
    same = torch.equal(kernels.rope(q, pos, cos, sin), RP.reference(q, cos[pos], sin[pos]))
    record("rope_equals_reference", same, "bf16 rope != torch eager's unfused arithmetic")
    qf = rand(4, heads, dim, dtype=torch.float32)
    pf = torch.randint(0, positions_max, (4,), generator=gen)
    same = torch.equal(kernels.rope(qf, pf, cos, sin), RP.reference(qf, cos[pf], sin[pf]))
    record("rope_equals_reference", same, "fp32")
    probe, probe_pos = rand(1, heads, dim, scale=2), torch.tensor([17])
    alone = kernels.rope(probe, probe_pos, cos, sin)
    for m in (1, 2, 7):
        batch, at = embedded(probe, m, lambda n: rand(n, heads, dim, scale=2))
        positions = torch.randint(0, positions_max, (m,), generator=gen)
        positions[at] = 17
        same = torch.equal(kernels.rope(batch, positions, cos, sin)[at], alone[0])
        record("rope_rows_alone_equal_rows_in_batch", same, f"M={m} pos={at}")

    return results


interpreted, test_rope_interpreted = interpreted_checks(__file__, "rope", CHECKS)


if __name__ == "__main__":
    print_checks(_run_checks)
