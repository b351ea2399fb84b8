"""silu_mul on Hopper: out = round(div_rn(g, 1 + exp(-g)) * u), g and u in FP32, one rounding to gate's dtype.

Elementwise, so a row's bits cannot depend on its batch; what is pinned is the arithmetic: exp is Triton's
tl.exp (on NVIDIA `ex2.approx.f32(g * log2 e)`), the division IEEE (`div_rn`), so it is close to, not bitwise
equal to, torch's expf-based F.silu. silu_mul(act=...) also quantises its output for the next FP8 GEMM
(quant_rows.quantize_stored).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.numerics.spec import QuantSpec
from onepath.ops.cuda import unit_stride
from onepath.ops.cuda.quant_rows import fused_quant_outputs, fused_quant_result, quantize_stored

BLOCK_I = 1024
NUM_WARPS = 4


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, gate_stride, up_stride, out_stride, I, codes_ptr, scales_ptr,
                     codes_stride, scales_stride, scales_gstride, amax_floor, amax_ceil, BLOCK: tl.constexpr,
                     QUANT: tl.constexpr, UE8M0: tl.constexpr, DIVIDE: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(gate_ptr + row * gate_stride + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_stride + offs, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + tl.exp(-g))
    tl.store(out_ptr + row * out_stride + offs, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)
    if QUANT:
        # the down projection's FP8 input, by its quantiser's rule, from the chunk just stored
        tl.debug_barrier()
        quantize_stored(out_ptr + row * out_stride, start, I, codes_ptr + row * codes_stride,
                        scales_ptr + row * scales_stride, scales_gstride, amax_floor, amax_ceil, UE8M0, DIVIDE, BLOCK,
                        GROUP)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, act: QuantSpec | None = None):
    """gate, up [..., I] (views of one fused projection are fine) -> silu(gate) * up [..., I] in gate.dtype.
    act (an FP8 rule of 1 x G groups, G dividing BLOCK_I): (out, its FP8Tensor by that rule), the codes and scales
    ops/cuda/quant.quantize_fp8(out, act) gives, computed in the same launch."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must have the same shape and dtype")
    lead, width = gate.shape[:-1], gate.shape[-1]
    g2, u2 = unit_stride(gate.reshape(-1, width)), unit_stride(up.reshape(-1, width))
    out = torch.empty(g2.shape, device=gate.device, dtype=gate.dtype)
    codes, scales, q = fused_quant_outputs(out.shape[0], width, act, out, BLOCK_I)
    if out.numel():
        grid = (g2.shape[0], triton.cdiv(width, BLOCK_I))
        _silu_mul_kernel[grid](g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), width, codes, scales,
                               codes.stride(0), scales.stride(0), scales.stride(1), *q["args"], BLOCK=BLOCK_I,
                               **q["constexprs"], num_warps=NUM_WARPS, enable_fp_fusion=False)
    if act is None:
        return out.reshape(*lead, width)
    return out.reshape(*lead, width), fused_quant_result(codes, scales, lead, act)
