"""rope on Hopper (neox / rotate_half): out1 = x1*c - x2*s, out2 = x2*c + x1*s in FP32, one rounding to x's dtype.

Each product is rounded to FP32 before the add: the launch passes `enable_fp_fusion=False`, so the compiler cannot
contract a product and an add into one FMA. That is torch eager's arithmetic, so the kernel gives the
reference's bits exactly (ops/rope.reference).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.ops.cuda import unit_stride

NUM_WARPS = 4


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, x_tok_stride, x_head_stride, out_tok_stride,
                 out_head_stride, table_stride, heads, HALF, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h < heads)[:, None] & (d < HALF)[None, :]
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    c = tl.load(cos_ptr + pos * table_stride + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * table_stride + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    x1_ptrs = x_ptr + tok * x_tok_stride + h[:, None] * x_head_stride + d[None, :]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    # Products in their own variables, and no fp fusion at launch: round(a*b) - round(c*d), as torch does.
    x1c, x2s, x2c, x1s = x1 * c, x2 * s, x2 * c, x1 * s
    out1_ptrs = out_ptr + tok * out_tok_stride + h[:, None] * out_head_stride + d[None, :]
    tl.store(out1_ptrs, (x1c - x2s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out1_ptrs + HALF, (x2c + x1s).to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (a strided view of a fused qkv is fine), positions [T] (each < P, unchecked:
    checking would sync), cos/sin [P, D/2] FP32 -> [T, heads, D] in x.dtype."""
    tokens, heads, dim = x.shape
    if dim % 2 or cos.shape[-1] != dim // 2 or sin.shape != cos.shape or positions.shape != (tokens,):
        raise ValueError(f"rope: x {tuple(x.shape)}, positions {tuple(positions.shape)}, cos {tuple(cos.shape)}, "
                         f"sin {tuple(sin.shape)} (expected x [T, heads, D] with even D, positions [T], "
                         "tables [P, D/2])")
    x = unit_stride(x)
    cos, sin, positions = cos.contiguous(), sin.contiguous(), positions.contiguous()
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if out.numel():
        half = dim // 2
        block_half = triton.next_power_of_2(half)
        block_heads = min(triton.next_power_of_2(heads), max(1, 2048 // block_half))
        grid = (tokens, triton.cdiv(heads, block_heads))
        _rope_kernel[grid](x, positions, cos, sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                           cos.stride(0), heads, half, BLOCK_HEADS=block_heads, BLOCK_HALF=block_half,
                           num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out
