"""RMSNorm and SiLU-mul quantising their own output for the next FP8 GEMM (ops/cuda/quant_rows.quantize_stored),
run by Triton's CPU interpreter (TRITON_INTERPRET=1) in a subprocess, as tests/ops/test_quant_interpret.py runs
the quantiser. Each fused launch gives the unfused kernel's output bit for bit, and codes and scales equal to the
standalone quantiser's (ops/cuda/quant.quantize_fp8) and torch's (numerics/quant.quantize_fp8) on that output,
under every FP8 rule (FP32 or UE8M0 scales, multiply or divide), over rows that cross the kernels' 1024-column
chunks and end in a ragged group, with a residual, and with a row holding inf / NaN (its group poisoned alone).
Control: quantising under another rule gives other codes. The same on the H200: tests/ops/test_linear_quant_fused_gpu.py.
"""
from __future__ import annotations

from tests.interpret import check_recorder, interpreted_checks, patch_bf16_rounding, print_checks

CHECKS = ["rmsnorm_out_unchanged", "rmsnorm_codes_equal_quantiser", "rmsnorm_residual_out_unchanged",
          "rmsnorm_residual_codes_equal_quantiser", "silu_mul_out_unchanged", "silu_mul_codes_equal_quantiser",
          "other_rule_differs", "rejects_other_rules"]


def _run_checks() -> dict:
    patch_bf16_rounding()
    from tests.interpret import patch_fp8_rounding
    patch_fp8_rounding()
    import math
    from dataclasses import replace

    import torch

    from onepath.numerics import quant as torch_quant
    from onepath.numerics.spec import FP8_ACT, FP8_KV, NVFP4_ACT
    from onepath.ops.cuda import rmsnorm, silu_mul
    from onepath.ops.cuda import quant as triton_quant

    gen = torch.Generator().manual_seed(0)
    rules = {"fp32_mul": FP8_ACT, "ue8m0_mul": replace(FP8_ACT, scale_dtype="ue8m0"),
             "fp32_div": replace(FP8_ACT, scale_apply="divide"),
             "ue8m0_div": replace(FP8_ACT, scale_dtype="ue8m0", scale_apply="divide")}
    results, record = check_recorder()

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).bfloat16()

    def same(a, b):
        return (a.codes.shape == b.codes.shape and a.scales.shape == b.scales.shape
                and torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
                and torch.equal(a.scales.view(torch.int32), b.scales.view(torch.int32)))

    def equal_quantisers(out, fused, rule):
        return same(fused, triton_quant.quantize_fp8(out, rule)) and same(fused, torch_quant.quantize_fp8(out, rule))

    # H = 200: one chunk, a ragged group of 72; 1100: two chunks, the second 76 wide; 2048: two whole chunks
    for h in (200, 1100, 2048):
        x, r, w = rand(5, h, scale=3.0), rand(5, h), rand(h)
        x[2, 7] = math.inf if h != 2048 else math.nan  # poisons that row's first group (and its norm)
        for name, rule in rules.items():
            plain = rmsnorm.rmsnorm(x, w, 1e-6)
            out, fused = rmsnorm.rmsnorm(x, w, 1e-6, rule)
            record("rmsnorm_out_unchanged", torch.equal(out.view(torch.int16), plain.view(torch.int16)),
                   f"H {h} {name}")
            record("rmsnorm_codes_equal_quantiser", equal_quantisers(out, fused, rule) and fused.rule == rule,
                   f"H {h} {name}")
            plain_out, plain_sum = rmsnorm.rmsnorm_residual(x, r, w, 1e-6)
            out, s, fused = rmsnorm.rmsnorm_residual(x, r, w, 1e-6, rule)
            record("rmsnorm_residual_out_unchanged", torch.equal(out.view(torch.int16), plain_out.view(torch.int16))
                   and torch.equal(s.view(torch.int16), plain_sum.view(torch.int16)), f"H {h} {name}")
            record("rmsnorm_residual_codes_equal_quantiser", equal_quantisers(out, fused, rule), f"H {h} {name}")

    # I = 300 (a ragged group), 2125 (three chunks, the last 77 wide), leading dims
    for shape in ((4, 300), (2, 3, 2125)):
        gate, up = rand(*shape, scale=2.0), rand(*shape, scale=40.0)
        up[(0,) * (len(shape) - 1) + (5,)] = math.nan
        for name, rule in rules.items():
            plain = silu_mul.silu_mul(gate, up)
            out, fused = silu_mul.silu_mul(gate, up, rule)
            record("silu_mul_out_unchanged", torch.equal(out.view(torch.int16), plain.view(torch.int16)),
                   f"{shape} {name}")
            record("silu_mul_codes_equal_quantiser", equal_quantisers(out, fused, rule), f"{shape} {name}")

    # control: the fused codes of one rule are not another rule's (the comparison can tell)
    x, w = rand(3, 1100, scale=5.0), rand(1100)
    out, fused = rmsnorm.rmsnorm(x, w, 1e-6, rules["fp32_mul"])
    record("other_rule_differs", not same(fused, triton_quant.quantize_fp8(out, rules["ue8m0_mul"])), "fp32 vs ue8m0")

    for rule in (replace(FP8_ACT, block=(1, 96)), FP8_KV, NVFP4_ACT):
        try:
            rmsnorm.rmsnorm(x, w, 1e-6, rule)
            record("rejects_other_rules", False, f"{rule} was taken")
        except ValueError as e:
            record("rejects_other_rules", "quantises its output by a per_block fp8_e4m3 rule" in str(e), str(e))
    return results


interpreted, test_linear_quant_fused_interpreted = interpreted_checks(__file__, "fused activation quantiser", CHECKS)


def _first_reduce_layout(ttgir: str) -> str:
    """The blocked layout of the first tt.reduce's operand in a TTGIR: the RMSNorm's sum of squares (inv_rms)."""
    import re
    operand = re.search(r'"tt.reduce"\((%[\w]+)\)', ttgir)[1]
    layout = re.search(rf"^\s*{re.escape(operand)} = .*#(blocked\d*)>", ttgir, re.M)[1]
    return re.search(rf"^#{layout} = #ttg.blocked<\{{(.*?)\}}>", ttgir, re.M)[1]


def test_fused_kernels_build_for_sm90_and_keep_the_norm_reduction():
    """The fused launches build for the H200 (sm_90, no GPU needed), and the RMSNorm's sum of squares keeps the
    layout, so the reduction tree, of the unfused build: the quantiser reads the stored row back instead of
    reshaping the kernel's registers (quant_rows.quantize_stored). Both builds take the 16-byte FP8 stores."""
    from onepath.ops.cuda import rmsnorm, silu_mul
    from tests.interpret import build_sm90

    class Launch:
        num_warps, num_stages, enable_fp_fusion = rmsnorm.NUM_WARPS, 3, False

    ints = ("x_stride", "r_stride", "out_stride", "res_stride", "H", "codes_stride", "scales_stride", "scales_gstride")
    sig = dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", res_ptr="*bf16", eps="fp32",
               codes_ptr="*fp8e4nv", scales_ptr="*fp32", amax_floor="fp32", amax_ceil="fp32", **{n: "i32" for n in ints})
    aligned = ("x_ptr", "r_ptr", "w_ptr", "out_ptr", "res_ptr", "codes_ptr")
    layouts = {}
    for quant in (False, True):
        consts = dict(HAS_RESIDUAL=True, VEC=8, BLOCK=rmsnorm.BLOCK_H, QUANT=quant, UE8M0=True, DIVIDE=False, GROUP=128,
                      CAST_LAST=False)
        built = build_sm90(rmsnorm._rmsnorm_kernel, sig, consts, aligned, Launch)
        layouts[quant] = _first_reduce_layout(built.asm["ttgir"])
        assert ("cvt.rn.satfinite.e4m3x2.f32" in built.asm["ptx"]) == quant, quant
    assert layouts[True] == layouts[False], layouts

    sig = dict(gate_ptr="*bf16", up_ptr="*bf16", out_ptr="*bf16", gate_stride="i32", up_stride="i32", out_stride="i32",
               I="i32", codes_ptr="*fp8e4nv", scales_ptr="*fp32", codes_stride="i32", scales_stride="i32",
               scales_gstride="i32",
               amax_floor="fp32", amax_ceil="fp32")
    built = build_sm90(silu_mul._silu_mul_kernel, sig, dict(BLOCK=silu_mul.BLOCK_I, QUANT=True, UE8M0=False,
                                                               DIVIDE=True, GROUP=128), ("out_ptr",), Launch)
    assert "cvt.rn.satfinite.e4m3x2.f32" in built.asm["ptx"]


if __name__ == "__main__":
    print_checks(_run_checks)


def test_attached_quantisation_is_taken_only_while_it_holds():
    """quant_linear takes a producer's FP8Tensor for x only under the linear's own rule, for x itself (its shape
    and version: an in-place change drops it), flattened to the GEMM's [M, K] / [M, groups]."""
    from dataclasses import replace

    import torch

    from onepath.numerics.quant import quantize_fp8
    from onepath.numerics.spec import FP8_ACT
    from onepath.ops.linear_quant import attach_quantized, attached_quantized

    x = torch.randn(2, 3, 300).bfloat16()
    q = quantize_fp8(x, FP8_ACT)
    assert attached_quantized(x, FP8_ACT) is None
    attach_quantized(x, q)
    got = attached_quantized(x, FP8_ACT)
    assert got.codes.shape == (6, 300) and got.scales.shape == (6, 3) and got.rule == FP8_ACT
    assert torch.equal(got.codes.view(torch.uint8), q.codes.reshape(6, 300).view(torch.uint8))
    assert attached_quantized(x, replace(FP8_ACT, scale_dtype="ue8m0")) is None
    assert attached_quantized(x.reshape(6, 300), FP8_ACT) is None
    x.mul_(2)
    assert attached_quantized(x, FP8_ACT) is None


def test_fused_act_rule_only_where_it_applies(monkeypatch):
    """Producers quantise for the next linear only when FUSED_ACT_QUANT is on, on the CUDA consistent path,
    without autograd, under FP8 W8A8 linears whose groups divide the producer's chunk."""
    import torch

    from onepath.numerics.spec import FP8_ACT, ExecutionSpec
    from onepath.ops import linear_quant as QL

    fp8 = ExecutionSpec.default("consistent", "cuda", quant="fp8")
    with torch.no_grad():
        monkeypatch.setattr(QL, "FUSED_ACT_QUANT", False)
        assert QL.fused_act_rule(fp8, 1024) is None
        monkeypatch.setattr(QL, "FUSED_ACT_QUANT", True)
        assert QL.fused_act_rule(fp8, 1024) == FP8_ACT
        assert QL.fused_act_rule(fp8, 64) is None                      # 128-wide groups do not divide 64 columns
        assert QL.fused_act_rule(fp8.with_mode("baseline"), 1024) is None
        assert QL.fused_act_rule(ExecutionSpec.default("consistent", "cpu", quant="fp8"), 1024) is None
        assert QL.fused_act_rule(ExecutionSpec.default("consistent", "cuda"), 1024) is None
        assert QL.fused_act_rule(ExecutionSpec.default("consistent", "cuda", quant="nvfp4_w4a4"), 1024) is None
    assert QL.fused_act_rule(fp8, 1024) is None                        # autograd on: the trainer's own path
