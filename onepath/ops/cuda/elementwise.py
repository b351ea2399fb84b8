"""silu_mul and rope on Hopper: elementwise, FP32 inside, one rounding to the input dtype at the end.

Nothing is reduced, so a row's bits cannot depend on its batch; what must be pinned is the
arithmetic itself, the same on every launch and both sides:
- silu_mul: out = round(div_rn(g, 1 + exp(-g)) * u), g and u in FP32; exp is Triton's tl.exp
  (on NVIDIA `ex2.approx.f32(g * log2 e)`), the division IEEE (`div_rn`); so it is close to,
  not bitwise equal to, torch's expf-based F.silu.
- rope (neox / rotate_half): out1 = x1*c - x2*s, out2 = x2*c + x1*s in FP32, each product
  rounded to FP32 before the add: the launches pass `enable_fp_fusion=False`, so the compiler
  cannot contract a product and an add into one FMA. That is torch eager's arithmetic, so the
  kernel gives the reference's bits exactly.
`write_kv` copies a step's K and V into their cache slots in one launch (a copy: no arithmetic).
silu_mul(act=...) also quantises its output for the next FP8 GEMM (fp8_rows.quantize_stored).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.numerics.spec import QuantSpec
from onepath.ops.cuda.fp8_rows import fused_quant_outputs, fused_quant_result, quantize_stored

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


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor, act: QuantSpec | None = None):
    """gate, up [..., I] (views of one fused projection are fine) -> silu(gate) * up [..., I] in gate.dtype.
    act (an FP8 rule of 1 x G groups, G dividing BLOCK_I): (out, its FP8Tensor by that rule), the codes and scales
    ops/cuda/quant.quantize_fp8(out, act) gives, computed in the same launch."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must have the same shape and dtype")
    lead, width = gate.shape[:-1], gate.shape[-1]
    g2, u2 = _rows(gate.reshape(-1, width)), _rows(up.reshape(-1, width))
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
    x = _rows(x)
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


@triton.jit
def kv_write_rows(slot_ptr, heads, D, BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A KV write program's token (one per program), its heads and head dims with their mask, and the
    cache slot it writes; shared with ops/cuda/quant.py's FP8 write."""
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
    k, v = _rows(k), _rows(v)
    _write_kv_kernel[(tokens,)](k, v, slot_mapping.contiguous(), k_cache, v_cache, k.stride(0), k.stride(1),
                                v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2), heads, dim,
                                BLOCK_HEADS=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
                                num_warps=NUM_WARPS)
