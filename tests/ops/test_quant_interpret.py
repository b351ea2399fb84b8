"""onepath.ops.cuda.quant (the Triton block-FP8 activation quantiser) run by Triton's CPU interpreter
(TRITON_INTERPRET=1): the same codes and scales as onepath.numerics.quant's torch rule, bit for bit (the FP8
K/V write by the same rule: tests/ops/test_attention_kv_interpret.py).

The interpreter must be on before the kernel is decorated, so the checks run in a subprocess: this
file, run as a script, prints one JSON line of results that the tests below assert on. Triton 3.6's
interpreter converts FP32 -> float8e4nv by rounding half up, without the carry into the exponent
(1.0625 -> 1.125, 3 * 2^-11 -> 0, 464 -> NaN); Hopper's cvt.rn.satfinite rounds to nearest even,
as torch does, so the checks give the interpreter torch's conversion (values are in range: the kernel
clamps first). What this proves is the kernel's rule (groups, masks, ragged tail, amax floor, IEEE
divisions, ue8m0 bits, multiply vs divide, NaN/inf poisoning); the cast's bits on the GPU are the GPU
test's job (tests/numerics/test_quant_gpu.py). Negative control: with the interpreter's own
conversion the codes differ.
"""
from __future__ import annotations

from tests.interpret import check_recorder, fp8_spread, interpreted_checks, patch_fp8_rounding, print_checks, same_fp8

CHECKS = ["random_equal_torch", "adversarial_equal_torch", "rows_alone_equal_rows_in_batch", "strided_input",
          "other_group_size", "rejects_other_rules", "interpreter_cast_is_not_rne", "scales_stored_by_column"]


def _run_checks() -> dict:
    interpreter_convert = patch_fp8_rounding()
    import math
    from dataclasses import replace

    import torch
    from triton.runtime import interpreter

    from onepath.numerics import quant as torch_quant
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT
    from onepath.ops.cuda import quant as triton_quant

    gen = torch.Generator().manual_seed(0)
    rules = {"fp32_mul": FP8_ACT, "ue8m0_mul": replace(FP8_ACT, scale_dtype="ue8m0"),
             "fp32_div": replace(FP8_ACT, scale_apply="divide"),
             "ue8m0_div": replace(FP8_ACT, scale_dtype="ue8m0", scale_apply="divide")}
    results, record = check_recorder()

    same = same_fp8

    def spread(*shape, dtype=torch.float32):
        return fp8_spread(gen, *shape, dtype=dtype)

    # K = 300: two full groups and a ragged 44; 257 and 129: a tail of one; 1 x 1; leading dims.
    for shape in [(1, 1), (3, 129), (5, 300), (2, 3, 257)]:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = spread(*shape, dtype=dtype) if dtype != torch.float16 else torch.randn(*shape, generator=gen).half()
            for name, rule in rules.items():
                record("random_equal_torch", same(triton_quant.quantize_fp8(x, rule), torch_quant.quantize_fp8(x, rule)),
                       f"{shape} {dtype} {name}")

    # ties (amax 448: scale 1), -0, zeros, subnormals, values past 448 / 464, near FLT_MAX, below the
    # amax floor, +-inf and NaN (their group only: scale NaN, codes 0)
    adv = torch.zeros(9, 300)
    ties = [448.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, 5 * 2.0 ** -10, 248.0, 432.0, -0.0, 2.0 ** -12]
    adv[0, :len(ties)] = torch.tensor(ties)
    adv[1] = -0.0
    adv[2, :4] = torch.tensor([1e-40, -3e-42, 2.0 ** -149, -(2.0 ** -149)])
    adv[2, 128:131] = torch.tensor([1e-39, -5e-40, 1.0])
    adv[3, :5] = torch.tensor([449.0, 464.0, 465.0, 1e4, -480.0])
    adv[4, :3] = torch.tensor([3.4028234663852886e38, -3e38, 1.0])
    adv[4, 128:131] = torch.tensor([3e-5, -9e-5, 1e-5])
    adv[5, 3], adv[5, 200], adv[5, 299] = math.inf, -math.inf, math.nan
    adv[6, 0], adv[6, 1] = math.nan, math.inf
    adv[7] = torch.randn(300, generator=gen) * 1e3
    for name, rule in rules.items():
        got, want = triton_quant.quantize_fp8(adv, rule), torch_quant.quantize_fp8(adv, rule)
        record("adversarial_equal_torch", same(got, want), name)
        record("adversarial_equal_torch", int(got.scales.isnan().sum()) == 4, f"{name}: 4 poisoned groups")

    # a row's codes alone equal its codes in any batch, at any position
    probe = spread(1, 300, dtype=torch.bfloat16)
    alone = triton_quant.quantize_fp8(probe)
    for m in (2, 5):
        batch = spread(m, 300, dtype=torch.bfloat16)
        at = int(torch.randint(m, (1,), generator=gen))
        batch[at] = probe[0]
        got = triton_quant.quantize_fp8(batch)
        record("rows_alone_equal_rows_in_batch",
               torch.equal(got.codes.view(torch.uint8)[at], alone.codes.view(torch.uint8)[0])
               and torch.equal(got.scales[at], alone.scales[0]), f"M={m} at={at}")

    # scales stored by column, each column 16-byte aligned (the FP8 GEMM's TMA loads a K block's column)
    for shape in [(1, 300), (5, 300), (2, 3, 257)]:
        scales = triton_quant.quantize_fp8(spread(*shape)).scales
        rows = math.prod(shape[:-1])
        flat = scales.reshape(rows, -1)
        # (one row: its stride is free, torch may set any)
        record("scales_stored_by_column", (flat.stride(0) == 1 or rows == 1) and flat.stride(1) % 4 == 0
               and flat.stride(1) >= rows and flat.data_ptr() % 16 == 0, f"{shape}: strides {flat.stride()}")

    # a view of a wider tensor (q of a fused qkv): strided rows read in place
    fused = spread(4, 700, dtype=torch.bfloat16)
    view = fused[:, 100:400]
    record("strided_input", same(triton_quant.quantize_fp8(view), torch_quant.quantize_fp8(view.contiguous())))

    # G = 32 groups (the rule is per (1, G); G = 128 is the preset)
    g32 = replace(FP8_ACT, block=(1, 32))
    x = spread(3, 100)
    record("other_group_size", same(triton_quant.quantize_fp8(x, g32), torch_quant.quantize_fp8(x, g32)))

    for bad in (FP8_WEIGHT, replace(FP8_ACT, block=(1, 96))):
        try:
            triton_quant.quantize_fp8(x, bad)
            record("rejects_other_rules", False, f"{bad.block} accepted")
        except ValueError as e:
            record("rejects_other_rules", "numerics.quant" in str(e), str(e))

    # negative control: the interpreter's own FP32 -> fp8 conversion is not RNE; the check sees it
    ours = interpreter._convert_float
    interpreter._convert_float = interpreter_convert
    try:
        differs = not same(triton_quant.quantize_fp8(adv), torch_quant.quantize_fp8(adv))
    finally:
        interpreter._convert_float = ours
    record("interpreter_cast_is_not_rne", differs, "the unpatched interpreter matched torch: drop the patch")
    return results


interpreted, test_quant_interpreted = interpreted_checks(__file__, "FP8 quantiser", CHECKS)


if __name__ == "__main__":
    print_checks(_run_checks)
