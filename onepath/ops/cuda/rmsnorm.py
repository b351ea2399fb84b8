"""rmsnorm on Hopper: Hugging Face's formula, one program per row, batch-invariant and deterministic.

    xf = x.float(); inv = 1 / sqrt_rn(sum(xf^2) / H + eps); out = round(w * round(xf * inv, x.dtype))

with the optional fused residual add `s = round(x + residual, x.dtype)` (what a model's
`x = x + r` stores) normalised in place of x. A row's bits depend on that row alone:
- the sum of squares walks H in fixed BLOCK_H chunks in ascending order into one FP32 vector,
  reduced once by tl.sum at the end: the order is a function of H only; no atomics; the number
  of rows is never passed to the kernel, so nothing can dispatch on it;
- every launch compiles to one binary per (H, dtypes): row strides are not specialised on and
  carry an explicit 16-byte alignment hint, and every vector-loaded pointer (the weight included:
  the engine's copy may sit elsewhere than the trainer's) is 16-byte aligned by `aligned_rows`,
  because a different binary could lay the vector out differently and so sum it in another tree;
- 1 / sqrt is IEEE (`sqrt_rn`, `div_rn`), not the approximate rsqrt, so the formula is portable;
- the squares are summed by explicit FMAs and the launches pass `enable_fp_fusion=False`, so no
  other product and add is contracted at the compiler's choice.
`qk_norm_rope` runs this reduction (`inv_rms`) and rounding on each head of q and k (Qwen3's QK-norm),
then rope.py's RoPE arithmetic, in one launch: the bits of the two kernels. `gated_rmsnorm` (Mamba-2's norm of
x * silu(z) by groups of channels) sums each group's squares the same way, one program per (row, group).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.numerics.spec import QuantSpec
from onepath.ops.cuda import aligned_rows, row_stride, unit_stride
from onepath.ops.cuda.quant_rows import fused_quant_outputs, fused_quant_result, quantize_stored

# The chunk of H summed per step: it fixes the reduction order of a row.
BLOCK_H = 1024
NUM_WARPS = 4
# A row of at most this many elements gets inv_rms's sum of squares on ONE warp with BLOCK = 256: on four
# warps with BLOCK_H each thread holds 8 consecutive elements (16 bytes) and the row fills lanes
# 0..D/8-1 of warp 0; on one warp with 256 the same, once. Each thread sums its 8 in order, the lanes
# meet in the same butterfly, and what four warps add besides (other lanes, other warps) is exact zeros.
ROW_WARP_BLOCK = 256


@triton.jit
def _summed_row(x_row, r_row, offs, mask, HAS_RESIDUAL: tl.constexpr):
    """The row the norm sees, in FP32: x, or x + residual rounded to x's dtype."""
    v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
        v = (v + r).to(x_row.dtype.element_ty).to(tl.float32)
    return v


@triton.jit
def inv_rms(x_row, r_row, res_row, H, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """1 / sqrt(mean(v^2) + eps) of one row, v = _summed_row (stored to res_row with a residual): the
    squares summed by explicit FMAs into one [BLOCK] vector over H in ascending chunks, then one tl.sum.
    Every kernel that normalises a row calls this, so they share one reduction tree (launched with
    num_warps=NUM_WARPS and enable_fp_fusion=False: the FMAs are the code's, not the compiler's)."""
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, H, BLOCK):
        offs = start + cols
        mask = offs < H
        v = _summed_row(x_row, r_row, offs, mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(res_row + offs, v.to(res_row.dtype.element_ty), mask=mask)
        acc = tl.fma(v, v, acc)
    var = tl.math.div_rn(tl.sum(acc, axis=0), H * 1.0)
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))


@triton.jit
def normed(v, inv, w, dtype: tl.constexpr):
    """round(w * round(v * inv)) in dtype, back in FP32: Hugging Face's order (normalise, cast, scale)."""
    return (w * (v * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["x_stride", "r_stride", "out_stride", "res_stride", "codes_stride", "scales_stride",
                               "scales_gstride"])
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, x_stride, r_stride, out_stride, res_stride, H, eps,
                    codes_ptr, scales_ptr, codes_stride, scales_stride, scales_gstride, amax_floor, amax_ceil,
                    HAS_RESIDUAL: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                    UE8M0: tl.constexpr, DIVIDE: tl.constexpr, GROUP: tl.constexpr, CAST_LAST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + tl.multiple_of(row * x_stride, VEC)
    r_row = r_ptr + tl.multiple_of(row * r_stride, VEC)
    res_row = res_ptr + tl.multiple_of(row * res_stride, VEC)
    out_row = out_ptr + tl.multiple_of(row * out_stride, VEC)
    cols = tl.arange(0, BLOCK)
    inv = inv_rms(x_row, r_row, res_row, H, eps, HAS_RESIDUAL, BLOCK)

    for start in range(0, H, BLOCK):
        offs = start + cols
        mask = offs < H
        v = _summed_row(x_row, r_row, offs, mask, HAS_RESIDUAL)
        y = v * inv
        if not CAST_LAST:  # Llama's order rounds the normalised row before the weight; DeepSeek-V4's does not
            y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)
    if QUANT:
        # the next FP8 GEMM's input, by its quantiser's rule, from the row just stored (quant_rows.quantize_stored)
        tl.debug_barrier()
        for start in range(0, H, BLOCK):
            quantize_stored(out_row, start, H, codes_ptr + row * codes_stride, scales_ptr + row * scales_stride,
                            scales_gstride, amax_floor, amax_ceil, UE8M0, DIVIDE, BLOCK, GROUP)


@triton.jit(do_not_specialize=["x_tok_stride", "x_head_stride"])
def _qk_norm_rope_kernel(x_ptr, wq_ptr, wk_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, x_tok_stride, x_head_stride,
                         table_stride, q_heads, heads, D, HALF, eps, VEC: tl.constexpr, BLOCK: tl.constexpr,
                         BLOCK_HALF: tl.constexpr):
    """One (token, head) row: RMSNorm by its head's weight (the first q_heads heads q's, the others k's),
    rounded as _rmsnorm_kernel rounds, then RoPE on the rounded halves as rope.py's _rope_kernel
    computes it (products rounded on their own, one rounding per output). Launched on one warp with BLOCK
    = ROW_WARP_BLOCK when the row fits it (`qk_norm_rope`)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    x_row = x_ptr + tl.multiple_of(tok * x_tok_stride + head * x_head_stride, VEC)
    inv = inv_rms(x_row, x_row, x_row, D, eps, False, BLOCK)
    w_ptr = wq_ptr if head < q_heads else wk_ptr
    d = tl.arange(0, BLOCK_HALF)
    mask = d < HALF
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    n1 = normed(tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32), inv,
                tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32), dtype)
    n2 = normed(tl.load(x_row + HALF + d, mask=mask, other=0.0).to(tl.float32), inv,
                tl.load(w_ptr + HALF + d, mask=mask, other=0.0).to(tl.float32), dtype)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    c = tl.load(cos_ptr + pos * table_stride + d, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * table_stride + d, mask=mask, other=0.0).to(tl.float32)
    x1c, x2s, x2c, x1s = n1 * c, n2 * s, n2 * c, n1 * s
    out_row = out_ptr + (tok * heads + head) * D
    tl.store(out_row + d, (x1c - x2s).to(dtype), mask=mask)
    tl.store(out_row + HALF + d, (x2c + x1s).to(dtype), mask=mask)


def _launch(x, residual, weight, eps, act=None, cast_last=False):
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rmsnorm: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match "
                         "(expected x [..., H], weight [H])")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rmsnorm: residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    lead, h = x.shape[:-1], x.shape[-1]
    x2 = aligned_rows(x.reshape(-1, h))
    r2 = aligned_rows(residual.reshape(-1, h)) if residual is not None else x2
    m = x2.shape[0]
    # Fresh outputs: contiguous and 16-byte aligned; rows padded so the hint holds for any H.
    vec = 16 // x.element_size()
    dtype = x.dtype if cast_last else torch.promote_types(x.dtype, weight.dtype)
    out = aligned_rows(torch.empty((m, h), device=x.device, dtype=dtype))
    res = aligned_rows(torch.empty_like(x2)) if residual is not None else out
    codes, scales, q = fused_quant_outputs(m, h, act, out, BLOCK_H)
    if m and h:
        _rmsnorm_kernel[(m,)](x2, r2, aligned_rows(weight[None])[0], out, res, row_stride(x2), row_stride(r2),
                              row_stride(out), row_stride(res), h, eps, codes, scales, codes.stride(0),
                              scales.stride(0), scales.stride(1), *q["args"], HAS_RESIDUAL=residual is not None,
                              VEC=min(vec, 16 // out.element_size()), BLOCK=BLOCK_H, **q["constexprs"],
                              CAST_LAST=cast_last, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out.reshape(*lead, h), res.reshape(*lead, h), fused_quant_result(codes, scales, lead, act)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, act: QuantSpec | None = None,
            cast_last: bool = False):
    """x [..., H], weight [H] -> [..., H] in promote(x.dtype, weight.dtype) (x.dtype for a model's BF16 weights);
    cast_last: round(w * xf * inv) in x.dtype (DeepSeek-V4's FP32 norm weights). act (an FP8 rule of 1 x G groups,
    G dividing BLOCK_H): also its quantisation by that rule, computed in the same launch, (out, FP8Tensor): the
    codes and scales ops/cuda/quant.quantize_fp8(out, act) gives."""
    out, _, quantized = _launch(x, None, weight, eps, act, cast_last)
    return (out, quantized) if act else out


def rmsnorm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     act: QuantSpec | None = None):
    """(rmsnorm(s), s) with s = x + residual rounded to x.dtype, in one pass over memory; with act (see rmsnorm)
    (rmsnorm(s), s, its FP8Tensor)."""
    out, res, quantized = _launch(x, residual, weight, eps, act)
    return (out, res, quantized) if act else (out, res)


def qk_norm_rope(x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_heads: int, eps: float,
                 positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (q's heads then k's: a strided view of a stacked qkv projection is fine), weights
    [D] -> rope(rmsnorm(x[:, :q_heads], q_weight)) and the same of the k heads by k_weight, [T, heads, D]
    contiguous in x.dtype: the bits of rmsnorm() then rope.rope(), in one launch."""
    tokens, heads, dim = x.shape
    if (dim % 2 or q_weight.shape != (dim,) or k_weight.shape != (dim,) or not 0 < q_heads < heads
            or positions.shape != (tokens,) or cos.shape[-1] != dim // 2 or sin.shape != cos.shape):
        raise ValueError(f"qk_norm_rope: x {tuple(x.shape)}, weights {tuple(q_weight.shape)}, "
                         f"{tuple(k_weight.shape)}, q_heads {q_heads}, positions {tuple(positions.shape)}, "
                         f"cos {tuple(cos.shape)} (expected x [T, heads, D] with even D, weights [D], "
                         "0 < q_heads < heads, positions [T], tables [P, D/2])")
    if q_weight.dtype != x.dtype or k_weight.dtype != x.dtype:
        raise ValueError(f"qk_norm_rope: weights {q_weight.dtype}, {k_weight.dtype} must be x's {x.dtype}")
    vec = 16 // x.element_size()
    if x.stride(-1) != 1 or x.data_ptr() % 16 or (tokens > 1 and x.stride(0) % vec) or x.stride(1) % vec:
        x = x.contiguous()
    out = torch.empty((tokens, heads, dim), device=x.device, dtype=x.dtype)
    if out.numel():
        half = dim // 2
        cos, sin, positions = cos.contiguous(), sin.contiguous(), positions.contiguous()
        # a head's row on one warp when it fits ROW_WARP_BLOCK: the same sum of squares (see there), a
        # quarter of the threads and of the masked columns of BLOCK_H on four
        block, warps = (ROW_WARP_BLOCK, 1) if dim <= ROW_WARP_BLOCK else (BLOCK_H, NUM_WARPS)
        _qk_norm_rope_kernel[(tokens, heads)](
            x, aligned_rows(q_weight[None])[0], aligned_rows(k_weight[None])[0], positions, cos, sin, out,
            x.stride(0) if tokens > 1 else 0, x.stride(1), cos.stride(0), q_heads, heads, dim, half, eps,
            VEC=vec, BLOCK=block, BLOCK_HALF=triton.next_power_of_2(half), num_warps=warps,
            enable_fp_fusion=False)
    return out


@triton.jit
def _gated(x_row, z_row, offs, mask):
    """x * silu(z) in FP32 (silu as silu_mul.py computes it)."""
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_row + offs, mask=mask, other=0.0).to(tl.float32)
    return x * tl.math.div_rn(z, 1.0 + tl.exp(-z))


@triton.jit(do_not_specialize=["x_stride", "z_stride", "out_stride"])
def _gated_rmsnorm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, x_stride, z_stride, out_stride, group_size, eps,
                          BLOCK: tl.constexpr):
    """One (row, group): h = x * silu(z); the squares of the group summed by explicit FMAs into one [BLOCK] vector
    in ascending chunks, then one tl.sum (the order a function of the group size alone); out = round(w * (h * inv))."""
    row = tl.program_id(0).to(tl.int64)
    base = tl.program_id(1) * group_size
    x_row, z_row = x_ptr + row * x_stride + base, z_ptr + row * z_stride + base
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, group_size, BLOCK):
        offs = start + cols
        h = _gated(x_row, z_row, offs, offs < group_size)
        acc = tl.fma(h, h, acc)
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(tl.sum(acc, axis=0), group_size * 1.0) + eps))
    for start in range(0, group_size, BLOCK):
        offs = start + cols
        mask = offs < group_size
        h = _gated(x_row, z_row, offs, mask)
        w = tl.load(w_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + base + offs, (w * (h * inv)).to(out_ptr.dtype.element_ty), mask=mask)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                  group_size: int) -> torch.Tensor:
    """x, gate [..., I], weight [I] -> [..., I] in weight's dtype: RMSNorm of x * silu(gate) over groups of
    group_size channels, scaled by weight (Mamba-2's gated norm, norm after the gate)."""
    lead, width = x.shape[:-1], x.shape[-1]
    x2, z2 = unit_stride(x.reshape(-1, width)), unit_stride(gate.reshape(-1, width))
    out = torch.empty(x2.shape, device=x.device, dtype=weight.dtype)
    if out.numel():
        block = min(BLOCK_H, triton.next_power_of_2(group_size))  # a function of the group size alone
        _gated_rmsnorm_kernel[(x2.shape[0], width // group_size)](
            x2, z2, weight.contiguous(), out, x2.stride(0), z2.stride(0), out.stride(0), group_size, eps,
            BLOCK=block, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out.reshape(*lead, width)
