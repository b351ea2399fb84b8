"""onepath.ops.cuda.linear_fp8 run by Triton's CPU interpreter (TRITON_INTERPRET=1) on tiny shapes.

As in test_linear_interpret.py, the interpreter's dot and FMA are replaced by exact models: a block's
fp8 code products summed exactly (float64) and rounded once to FP32 (a K-block partial of e4m3 codes
is exact in float64), and a correctly rounded FP32 FMA. The CPU path of ops/linear_quant.py computes
exactly that, so the interpreted kernel must equal it bit for bit: the kernel's tile walk, K tail,
scale indexing (per row and K group; per 128x128 weight block), epilogue order and masks are the
CPU contract's. Hopper's FP8 MMA rounds its own way: the GPU's bits are a GPU test's job.
"""
from __future__ import annotations

from tests.interpret import (SM90_SHARED_BYTES, check_recorder, compile_sm90, interpreted_checks,
                              patch_fp8_gemm_interpreter, print_checks)

CHECKS = ["equals_cpu_contract", "rows_alone_equal_rows_in_batch", "configs_agree", "bias_bf16_out",
          "cuda_linear_fp8_equals_cpu", "cuda_linear_rows_alone_equal_rows_in_batch"]


def _run_checks() -> dict:
    import torch

    patch_fp8_gemm_interpreter()

    from onepath.numerics.quant import quantize
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT
    from onepath.ops.cuda.linear import TileConfig
    from onepath.ops.cuda.linear_fp8 import TILES_FP8, linear_fp8
    from onepath.ops.linear_quant import fp8_gemm

    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()

    small = TileConfig(16, 16, 4, 2, group_m=2)
    n = 140  # two 128-row weight blocks, the second ragged
    for k in (200, 256, 40):  # ragged K tail, whole blocks, one short block
        w = quantize(torch.randn(n, k, generator=gen) * 0.05, FP8_WEIGHT)
        x = torch.randn(19, k, generator=gen) * 3
        qx = quantize(x, FP8_ACT)
        want = fp8_gemm(qx, w)
        got = linear_fp8(qx, w, out_dtype=torch.float32, config=small)
        record("equals_cpu_contract", torch.equal(got, want), f"K={k}: max diff {(got - want).abs().max().item():.3g}")

        probe = x[:1]
        alone = linear_fp8(quantize(probe, FP8_ACT), w, out_dtype=torch.float32, config=small)
        for m in (2, 17, 33):
            batch = torch.randn(m, k, generator=gen)
            pos = int(torch.randint(m, (1,), generator=gen))
            batch[pos] = probe[0]
            inside = linear_fp8(quantize(batch, FP8_ACT), w, out_dtype=torch.float32, config=small)[pos]
            record("rows_alone_equal_rows_in_batch", torch.equal(inside, alone[0]), f"K={k} M={m} pos={pos}")

        for cfg in (TileConfig(16, 32, 4, 2, group_m=1), *TILES_FP8):
            record("configs_agree", torch.equal(linear_fp8(qx, w, out_dtype=torch.float32, config=cfg), want), f"K={k} {cfg}")

    k = 200
    w = quantize(torch.randn(n, k, generator=gen) * 0.05, FP8_WEIGHT)
    qx = quantize(torch.randn(5, k, generator=gen), FP8_ACT)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    got = linear_fp8(qx, w, b, out_dtype=torch.bfloat16, config=small)
    record("bias_bf16_out", got.dtype == torch.bfloat16 and torch.equal(got, fp8_gemm(qx, w, b).to(torch.bfloat16)),
           "bias added in FP32, one rounding to bf16")

    # ops.linear under a "cuda" spec, run on CPU tensors: the Triton FP8 quantiser + this kernel for W8A8,
    # NVFP4 operands into the Triton BF16 linear; the wiring of ops/linear_quant.py's CUDA branch.
    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops import linear as L
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16) * 0.1
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    gpu, cpu = (ExecutionSpec.default("consistent", dev, quant="fp8") for dev in ("cuda", "cpu"))
    record("cuda_linear_fp8_equals_cpu", torch.equal(L.linear(gpu, x, w, b), L.linear(cpu, x, w, b)), "fp8")
    for preset in ("fp8", "nvfp4_w4a16", "nvfp4_w4a4"):
        gpu = ExecutionSpec.default("consistent", "cuda", quant=preset)
        alone = L.linear(gpu, x[:1], w, b)
        for m in (2, 70):
            batch = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            batch[m // 2] = x[0]
            record("cuda_linear_rows_alone_equal_rows_in_batch",
                   torch.equal(L.linear(gpu, batch, w, b)[m // 2], alone[0]), f"{preset} M={m}")
    return results


def test_every_fp8_config_compiles_for_sm90_on_fp8_wgmma_within_shared_memory():
    """What the launcher can pick builds for the H200 (the Triton wheel's ptxas, no GPU): fp8 wgmma
    (e4m3 operands, no mma.sync fallback), one FMA per K block, within the 227 KiB of shared memory."""
    from onepath.ops.cuda import linear_fp8 as mm

    bad = []
    for cfg in mm.TILES_FP8:
        consts = dict(W_BLOCK_N=128, HAS_BIAS=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=mm.BLOCK_K,
                      GROUP_M=cfg.group_m)
        sig = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sw_ptr": "*fp32", "bias_ptr": "*bf16",
               "out_ptr": "*bf16", **{n: "i32" for n in ("M", "N", "K", "NUM_PROGRAMS", "stride_am", "stride_sam",
                                                         "stride_wn", "stride_swn", "stride_om")}}
        aligned = ("a_ptr", "w_ptr", "out_ptr", "K", "stride_am", "stride_wn", "stride_om")
        ptx, shared = compile_sm90(mm._linear_fp8_kernel, sig, consts, aligned, cfg)
        ok = "wgmma.mma_async" in ptx and ".e4m3.e4m3" in ptx and "mma.sync" not in ptx and "fma.rn.f32" in ptx
        if shared > SM90_SHARED_BYTES or not ok:
            bad.append((cfg, shared, ok))
    assert not bad, f"(config, shared bytes, fp8 wgmma + fma) that break the build contract: {bad}"


interpreted, test_linear_fp8_interpreted = interpreted_checks(__file__, "linear_fp8", CHECKS)


if __name__ == "__main__":
    print_checks(_run_checks)
