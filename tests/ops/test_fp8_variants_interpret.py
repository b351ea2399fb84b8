"""bench/fp8_variants.py's K-loop variants keep the shipped FP8 GEMM's bits: run by Triton's CPU
interpreter (TRITON_INTERPRET=1) on awkward shapes, and built for sm_90.

The interpreter's dot and FMA are test_quant_linear_interpret.py's exact models (a K block's fp8
products summed exactly and rounded once to FP32; a correctly rounded FMA), so what must match is the
order of operations: every variant (split tiles, one-block software pipelining, persistent walk,
fewer stages) gives each element the shipped chain (fresh dot per K block, one FMA, ascending K),
hence torch.equal with ops/cuda/linear_fp8.py on the same inputs. The negative control, mul + add
(two roundings per block), must differ. Hopper's MMA bits are the GPU bench's check (torch.equal).
The Gluon variant (gluon_wait1) cannot be interpreted: here it is only built for sm_90, with the
`wgmma.wait_group 1` that is its reason to exist; its bits rest on the GPU bench alone.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
from tests.interpret import (SM90_SHARED_BYTES, compile_sm90, interpreted_checks, patch_fp8_gemm_interpreter,
                              print_checks)

SHAPES = [(m, n, k) for m in (1, 37, 130) for n in (72, 200) for k in (200, 384)]  # (M, N, K)


def _run_checks() -> dict:
    import torch

    patch_fp8_gemm_interpreter()

    from bench.fp8_variants import Variant, run_variant, variants
    from onepath.numerics.quant import quantize
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT
    from onepath.ops.cuda.linear_fp8 import matmul_fp8

    gen = torch.Generator().manual_seed(0)
    control = Variant(64, 128, 4, 4, fma=False)
    # warps, stages and the register cap only shape the GPU build: one interpreted run per program
    programs = {}
    for v in _interpretable(variants()):
        programs.setdefault((tuple(v.consts().items()), v.persistent), []).append(v)
    results = {str(v): {"ok": True, "detail": ""} for v in _interpretable(variants())}
    results["negative_control_differs"] = {"ok": False, "detail": f"{control} equalled the shipped bits everywhere"}
    for m, n, k in SHAPES:
        qw = quantize(torch.randn(n, k, generator=gen) * 0.05, FP8_WEIGHT)
        qa = quantize(torch.randn(m, k, generator=gen) * 3, FP8_ACT)
        for out_dtype in (torch.float32, torch.bfloat16) if (m, n, k) == SHAPES[-1] else (torch.float32,):
            shipped = matmul_fp8(qa, qw, out_dtype=out_dtype)
            for same in programs.values():
                got = run_variant(qa, qw, same[0], out_dtype=out_dtype)
                for v in same:
                    if not torch.equal(got, shipped) and results[str(v)]["ok"]:
                        results[str(v)] = {"ok": False, "detail": f"M={m} N={n} K={k} {out_dtype}: "
                                           f"{(got != shipped).sum().item()} elements differ"}
            if not torch.equal(run_variant(qa, qw, control, out_dtype=out_dtype), shipped):
                results["negative_control_differs"] = {"ok": True, "detail": ""}
    return results


def _interpretable(variants) -> list:
    return [v for v in variants if not v.wait1]


def _variant_names() -> list[str]:
    from bench.fp8_variants import variants
    return [str(v) for v in _interpretable(variants())]


interpreted, test_variant_bits_equal_shipped_interpreted = interpreted_checks(
    __file__, "fp8 variants", [*_variant_names(), "negative_control_differs"])


def test_every_variant_compiles_for_sm90_on_fp8_wgmma_within_shared_memory():
    """What the GPU bench times builds for the H200 (the wheel's ptxas, no GPU): fp8 wgmma (e4m3, no
    mma.sync fallback, which would round differently), FMA promotion, within 227 KiB of shared memory.
    The launch-time register cap (maxnreg) is not part of this build: it only changes allocation."""
    from bench.fp8_variants import _variant_kernel, variants

    sig = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sw_ptr": "*fp32", "out_ptr": "*bf16",
           **{n: "i32" for n in ("M", "N", "K", "NUM_PROGRAMS", "stride_am", "stride_sam", "stride_wn",
                                 "stride_swn", "stride_om")}}
    aligned = ("a_ptr", "w_ptr", "out_ptr", "K", "stride_am", "stride_wn", "stride_om")
    bad = []
    for v in {replace(v, maxnreg=None, persistent=False) for v in _interpretable(variants())}:
        ptx, shared = compile_sm90(_variant_kernel, sig, dict(W_BLOCK_N=128, **v.consts()), aligned, v)
        ok = "wgmma.mma_async" in ptx and ".e4m3.e4m3" in ptx and "mma.sync" not in ptx and "fma.rn.f32" in ptx
        if shared > SM90_SHARED_BYTES or not ok:
            bad.append((v, shared, ok))
    assert not bad, f"(variant, shared bytes, fp8 wgmma + fma) that break the build contract: {bad}"


def test_gluon_variant_compiles_for_sm90_with_one_wgmma_left_in_flight():
    """The Gluon kernel builds for the H200 (ptxas included): fp8 wgmma (e4m3, no mma.sync), FMA
    promotion, `wgmma.wait_group 1` in the K loop (block kb's MMA in flight under block kb-1's FMA),
    within 227 KiB of shared memory."""
    pytest.importorskip("triton.backends.nvidia")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from bench.fp8_variants import _wait1_kernel, variants

    names = _wait1_kernel.arg_names
    aligned = ("a_ptr", "w_ptr", "out_ptr", "K", "stride_am", "stride_wn")  # any N; K a multiple of 16
    bad = []
    for v in {replace(v, maxnreg=None) for v in variants() if v.wait1}:
        consts = dict(W_BLOCK_N=128, **v.consts())
        sig = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sw_ptr": "*fp32", "out_ptr": "*bf16",
               **{n: "i32" for n in names if n not in consts and "ptr" not in n}, **{n: "constexpr" for n in consts}}
        src = GluonASTSource(_wait1_kernel, {n: sig[n] for n in names},
                             constexprs={(names.index(n),): c for n, c in consts.items()},
                             attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=v.num_warps))
        ptx, shared = compiled.asm["ptx"], compiled.metadata.shared
        ok = ("wgmma.mma_async" in ptx and ".e4m3.e4m3" in ptx and "mma.sync" not in ptx and "fma.rn.f32" in ptx
              and "wgmma.wait_group.sync.aligned 1;" in ptx)
        if shared > SM90_SHARED_BYTES or not ok:
            bad.append((str(v), shared, ok))
    assert not bad, f"(variant, shared bytes, fp8 wgmma + fma + wait_group 1) that break the build contract: {bad}"


if __name__ == "__main__":
    print_checks(_run_checks)
