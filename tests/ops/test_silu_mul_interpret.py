"""onepath.ops.cuda.silu_mul run by Triton's CPU interpreter (TRITON_INTERPRET=1).

I = 1100 crosses a BLOCK_I chunk; gate and up as views of one fused projection.
The checks run in a subprocess (tests/interpret.py); the bits of Hopper's arithmetic are
tests/ops/test_silu_mul_gpu.py's job.
"""
from __future__ import annotations

from tests.interpret import check_recorder, interpreted_checks, kernel_case_tools, patch_bf16_rounding, print_checks

CHECKS = ["silu_mul_values", "silu_mul_rows_alone_equal_rows_in_batch"]


def _run_checks() -> dict:
    patch_bf16_rounding()
    import torch

    from onepath.ops import silu_mul as SM
    from onepath.ops.cuda import silu_mul as kernels

    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()
    rand, close, embedded = kernel_case_tools(gen)

    # silu_mul: I = 1100 crosses a BLOCK_I; gate/up as views of one fused projection.
    width = 1100
    fused = rand(6, 2 * width, scale=4)
    gate, up = fused[:, :width], fused[:, width:]
    ok, why = close(kernels.silu_mul(gate, up), SM.reference(gate, up))
    record("silu_mul_values", ok, why)
    copies = kernels.silu_mul(gate.contiguous(), up.contiguous())
    record("silu_mul_values", torch.equal(kernels.silu_mul(gate, up), copies), "views vs contiguous")
    probe = rand(1, 2 * width, scale=4)
    alone = kernels.silu_mul(probe[:, :width], probe[:, width:])
    for m in (1, 2, 7):
        batch, pos = embedded(probe, m, lambda n: rand(n, 2 * width, scale=4))
        got = kernels.silu_mul(batch[:, :width], batch[:, width:])[pos]
        record("silu_mul_rows_alone_equal_rows_in_batch", torch.equal(got, alone[0]), f"M={m} pos={pos}")

    return results


interpreted, test_silu_mul_interpreted = interpreted_checks(__file__, "silu_mul", CHECKS)


if __name__ == "__main__":
    print_checks(_run_checks)
