"""The attention op's K/V write on Hopper: a step's K and V into their paged-cache slots, one launch for both.

write_kv copies (no arithmetic). write_kv_fp8 quantises each token's K and V per head by the FP8_KV rule
(one group = one head's D values; quant_rows.quantize_rows, numerics/quant.py's rule bit for bit) and writes the
codes and scales into their slots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.numerics.quant import FP8Tensor
from onepath.numerics.spec import QuantSpec
from onepath.ops.cuda import unit_stride
from onepath.ops.cuda.quant_rows import quantize_rows, rule_args

NUM_WARPS = 4


@triton.jit
def kv_write_rows(slot_ptr, heads, D, BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A KV write program's token (one per program), its heads and head dims with their mask, and the
    cache slot it writes; shared by the plain and the FP8 write."""
    tok = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_D)
    mask = (h < heads)[:, None] & (d < D)[None, :]
    return tok, h, d, mask, tl.load(slot_ptr + tok).to(tl.int64)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, k_tok_stride, k_head_stride, v_tok_stride,
                     v_head_stride, cache_slot_stride, cache_head_stride, heads, D,
                     BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    tok, h, d, mask, slot = kv_write_rows(slot_ptr, heads, D, BLOCK_HEADS, BLOCK_D)
    dst = slot * cache_slot_stride + h[:, None] * cache_head_stride + d[None, :]
    k = tl.load(k_ptr + tok * k_tok_stride + h[:, None] * k_head_stride + d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * v_tok_stride + h[:, None] * v_head_stride + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (strided views of a stacked projection are fine) into caches [blocks, block_size,
    Hkv, D] at slot_mapping [T] (slot = block * block_size + offset), both in one launch: a copy."""
    tokens, heads, dim = k.shape
    if (v.shape != k.shape or k_cache.shape[2:] != (heads, dim) or v_cache.shape != k_cache.shape
            or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1
            or k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1) or slot_mapping.shape != (tokens,)):
        raise ValueError(f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, caches {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}, slots {tuple(slot_mapping.shape)} (expected k, v [T, Hkv, D], "
                         "caches [blocks, block_size, Hkv, D] alike, each block's slots contiguous, slots [T])")
    if tokens == 0:
        return
    k, v = unit_stride(k), unit_stride(v)
    _write_kv_kernel[(tokens,)](k, v, slot_mapping.contiguous(), k_cache, v_cache, k.stride(0), k.stride(1),
                                v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2), heads, dim,
                                BLOCK_HEADS=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
                                num_warps=NUM_WARPS)


@triton.jit
def _quantize_into(x_ptr, codes_ptr, scales_ptr, codes_at, scales_at, h, mask, heads, amax_floor, amax_ceil,
                   UE8M0: tl.constexpr, DIVIDE: tl.constexpr):
    """One token's K or V [heads, D] (x_ptr at its rows) quantised per head into its cache slot."""
    x = tl.load(x_ptr, mask=mask, other=0.0)
    y, scale = quantize_rows(x.to(tl.float32), amax_floor, amax_ceil, UE8M0, DIVIDE)
    tl.store(codes_ptr + codes_at, y.to(tl.float8e4nv), mask=mask)
    tl.store(scales_ptr + scales_at, scale, mask=h < heads)


@triton.jit
def _write_kv_fp8_kernel(k_ptr, v_ptr, slot_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, k_tok_stride, k_head_stride,
                         v_tok_stride, v_head_stride, code_slot_stride, code_head_stride, scale_slot_stride,
                         scale_head_stride, heads, D, amax_floor, amax_ceil, UE8M0: tl.constexpr, DIVIDE: tl.constexpr,
                         BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    tok, h, d, mask, slot = kv_write_rows(slot_ptr, heads, D, BLOCK_HEADS, BLOCK_D)
    codes_at = slot * code_slot_stride + h[:, None] * code_head_stride + d[None, :]
    scales_at = slot * scale_slot_stride + h * scale_head_stride
    _quantize_into(k_ptr + tok * k_tok_stride + h[:, None] * k_head_stride + d[None, :], kc_ptr, ks_ptr, codes_at,
                   scales_at, h, mask, heads, amax_floor, amax_ceil, UE8M0, DIVIDE)
    _quantize_into(v_ptr + tok * v_tok_stride + h[:, None] * v_head_stride + d[None, :], vc_ptr, vs_ptr, codes_at,
                   scales_at, h, mask, heads, amax_floor, amax_ceil, UE8M0, DIVIDE)


def write_kv_fp8(k_cache: FP8Tensor, v_cache: FP8Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor, q: QuantSpec) -> None:
    """k, v [T, Hkv, D] quantised per token and head by `q` (a per_token fp8_e4m3 rule, FP8_KV) into FP8
    caches (codes [blocks, block_size, Hkv, D], scales [blocks, block_size, Hkv, 1]) at slot_mapping [T],
    both in one launch: the codes and scales of onepath.numerics.quant.quantize_fp8(k, q), bit for bit."""
    tokens, heads, dim = k.shape
    codes, scales = k_cache.codes, k_cache.scales
    if q.format != "fp8_e4m3" or q.scale_domain != "per_token":
        raise ValueError(f"write_kv_fp8 takes a per_token fp8_e4m3 rule (FP8_KV), got {q.format} {q.scale_domain}")
    if (v.shape != k.shape or codes.shape[2:] != (heads, dim) or v_cache.codes.shape != codes.shape
            or scales.shape != (*codes.shape[:3], 1) or v_cache.scales.shape != scales.shape
            or codes.stride() != v_cache.codes.stride() or scales.stride() != v_cache.scales.stride()
            or codes.stride(-1) != 1 or codes.stride(0) != codes.shape[1] * codes.stride(1)
            or scales.stride(0) != scales.shape[1] * scales.stride(1) or slot_mapping.shape != (tokens,)):
        raise ValueError(f"write_kv_fp8: k {tuple(k.shape)}, v {tuple(v.shape)}, codes {tuple(codes.shape)}, "
                         f"scales {tuple(scales.shape)}, slots {tuple(slot_mapping.shape)} (expected k, v [T, Hkv, D], "
                         "codes [blocks, block_size, Hkv, D] and scales [..., Hkv, 1] alike for K and V, each "
                         "block's slots contiguous, slots [T])")
    if tokens == 0:
        return
    k, v = unit_stride(k), unit_stride(v)
    args, constexprs = rule_args(q)
    _write_kv_fp8_kernel[(tokens,)](
        k, v, slot_mapping.contiguous(), codes, v_cache.codes, scales, v_cache.scales,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), codes.stride(1), codes.stride(2),
        scales.stride(1), scales.stride(2), heads, dim, *args, **constexprs,
        BLOCK_HEADS=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim), num_warps=NUM_WARPS)
