"""The block-FP8 rule of onepath/numerics/quant.py as Triton functions (see ops/cuda/quant.py's docstring for how
each step keeps torch's bits), shared by the activation quantiser (quant.py), the FP8 K/V write
(attention_kv.py) and the kernels that quantise their own output for the next FP8 GEMM (rmsnorm.py, silu_mul.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.numerics.quant import FP8Tensor


@triton.jit
def quantize_rows(x, amax_floor, amax_ceil, UE8M0: tl.constexpr, DIVIDE: tl.constexpr):
    """x [R, G] FP32 (masked elements 0) -> (y [R, G] FP32 in range, ready for the e4m3 cast; scale [R]):
    the rule for each row of x, one group each."""
    finite = (x == x) & (tl.abs(x) < float("inf"))
    bad = tl.max(tl.where(finite, 0, 1), axis=1)
    amax = tl.minimum(tl.maximum(tl.max(tl.abs(x), axis=1), amax_floor), amax_ceil)
    scale = tl.math.div_rn(amax, 448.0)
    if UE8M0:
        bits = scale.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = (tl.minimum(tl.maximum(exp, 1), 254) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(bad == 0, scale, float("nan"))
    if DIVIDE:
        y = tl.math.div_rn(x, scale[:, None])
    else:
        y = x * tl.math.div_rn(1.0, scale)[:, None]
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return tl.where(bad[:, None] == 0, y, 0.0), scale


@triton.jit
def quantize_stored(row, start, H, codes_row, scales_row, scales_gstride, amax_floor, amax_ceil, UE8M0: tl.constexpr,
                    DIVIDE: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Columns [start, start + BLOCK) of a row this program has stored at `row` (start a multiple of GROUP, the
    stores behind a tl.debug_barrier), read back as the GEMM's quantiser reads them and quantised per GROUP:
    codes to codes_row, one scale per group to scales_row (groups scales_gstride apart). Read back rather than
    taken from registers, so the kernel's own arithmetic keeps the layouts, and so the bits, it has without the
    quantiser."""
    g = start // GROUP + tl.arange(0, BLOCK // GROUP)
    offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = offs < H
    x = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    y, scale = quantize_rows(x, amax_floor, amax_ceil, UE8M0, DIVIDE)
    tl.store(codes_row + offs, y.to(tl.float8e4nv), mask=mask)
    tl.store(scales_row + g * scales_gstride, scale, mask=g < tl.cdiv(H, GROUP))


def scale_column_stride(m: int) -> int:
    """P, the stride between columns of m rows' scales stored by column: m rounded up to 4 floats (16 bytes)."""
    return -(-m // 4) * 4


def scales_by_column(m: int, groups: int, device) -> torch.Tensor:
    """An [m, groups] FP32 buffer for a 1 x G rule's scales, stored by column (strides (1, P), P from
    scale_column_stride): a K block's scales of consecutive rows adjacent and each column 16-byte aligned, the
    layout the FP8 GEMM's TMA loads them in (linear_fp8_ws.tma_scales)."""
    return torch.empty((groups, scale_column_stride(m)), device=device, dtype=torch.float32)[:, :m].t()


def rule_args(q) -> tuple[tuple[float, float], dict]:
    """A rule as quantize_rows' kernel arguments: (amax_floor, amax_ceil) (inf without a ceiling: min(amax, inf)
    is amax) and the constexprs UE8M0 and DIVIDE."""
    ceil = float("inf") if q.amax_ceil is None else q.amax_ceil
    return (q.amax_floor, ceil), dict(UE8M0=q.scale_dtype == "ue8m0", DIVIDE=q.scale_apply == "divide")


def fused_quant_outputs(m: int, width: int, act, placeholder: torch.Tensor, block: int):
    """The codes and scales buffers and the kernel arguments of an [m, width] output that its producer also
    quantises by `act` (a 1 x G FP8 rule, G dividing the producer's `block` columns), in its own launch; act None:
    no quantisation, `placeholder` stands for the unused buffers. Returns (codes, scales, dict(args=(floor, ceil),
    constexprs=...))."""
    if act is None:
        return placeholder, placeholder, dict(args=(0.0, 0.0),
                                              constexprs=dict(QUANT=False, UE8M0=False, DIVIDE=False, GROUP=1))
    group = act.block[1] if act.block else 0
    if act.format != "fp8_e4m3" or act.scale_domain != "per_block" or act.block[0] != 1 or group & (group - 1) \
            or block % group:
        raise ValueError(f"a producer quantises its output by a per_block fp8_e4m3 rule of (1, G) groups, G a power "
                         f"of two dividing {block}; got {act.format} {act.scale_domain} {act.block}: quantise "
                         "with ops/cuda/quant.quantize_fp8 instead")
    codes = torch.empty((m, width), device=placeholder.device, dtype=torch.float8_e4m3fn)
    scales = scales_by_column(m, triton.cdiv(width, group), placeholder.device)
    args, constexprs = rule_args(act)
    return codes, scales, dict(args=args, constexprs=dict(QUANT=True, GROUP=group, **constexprs))


def fused_quant_result(codes: torch.Tensor, scales: torch.Tensor, lead: tuple, act):
    """The FP8Tensor of fused_quant_outputs' buffers, shaped [*lead, width] / [*lead, groups]; None without act."""
    # the widths named, not -1: a shape with zero rows still has them
    return (FP8Tensor(codes.reshape(*lead, codes.shape[-1]), scales.reshape(*lead, scales.shape[-1]), act.block, act)
            if act else None)
