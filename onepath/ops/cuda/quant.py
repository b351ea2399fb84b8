"""Block-FP8 activation quantiser on Hopper: the rule of onepath/numerics/quant.py, the same codes and scales.

Per row, per group of G consecutive elements along K (G = 128: QuantSpec.block (1, G)), in FP32:
    amax = min(max(max|x|, amax_floor), amax_ceil); scale = div_rn(amax, 448) (ue8m0: rounded up to a power of two
    from its bits); y = x * div_rn(1, scale) or div_rn(x, scale); q = e4m3(clamp(y, -448, 448)).
- IEEE division (`div_rn`), not Triton's default approximate `/`: one more ulp would move codes;
- the clamp before `.to(float8e4nv)`: Triton's cast saturates where torch's has made NaN; the spec
  clamps, so both sides cast values in range and agree bit for bit;
- a group holding +-inf or NaN gets scale NaN and codes 0 (torch's rule): tl.max is not relied on
  to propagate NaN, the finiteness is tested explicitly;
- max is exact in any order, so a group's bits depend on that group alone: any M, any grid.
The engine and the trainer call this one kernel on the GPU; numerics/quant.py is the same rule in torch.
`write_kv_fp8` applies the same rule per token and head (FP8_KV: one group = one head's D values) and
writes K and V's codes and scales into their cache slots in one launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.numerics.quant import FP8Tensor
from onepath.numerics.spec import FP8_ACT, QuantSpec
from onepath.ops.cuda.elementwise import kv_write_rows
from onepath.ops.cuda.fp8_rows import quantize_rows, rule_args, scales_by_column

GROUPS_PER_PROGRAM = 4
NUM_WARPS = 4


@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, x_stride, q_stride, s_stride, s_gstride, K, n_groups, amax_floor, amax_ceil,
                      UE8M0: tl.constexpr, DIVIDE: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (groups[:, None] < n_groups) & (cols < K)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y, scale = quantize_rows(x, amax_floor, amax_ceil, UE8M0, DIVIDE)
    tl.store(q_ptr + row * q_stride + cols, y.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row * s_stride + groups * s_gstride, scale, mask=groups < n_groups)


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


def quantize_fp8(x: torch.Tensor, q: QuantSpec = FP8_ACT) -> FP8Tensor:
    """x [..., K] (BF16/FP16/FP32) -> FP8Tensor(codes [..., K] float8_e4m3fn, scales [..., ceil(K/G)] FP32),
    bit-equal to onepath.numerics.quant.quantize_fp8(x, q) for a 1 x G block rule. The scales are stored by
    column (fp8_rows.scales_by_column), as the FP8 GEMM loads them."""
    if q.format != "fp8_e4m3" or q.scale_domain != "per_block" or q.block[0] != 1 or q.block[1] & (q.block[1] - 1):
        raise ValueError(f"the Triton FP8 quantiser takes per_block fp8_e4m3 groups (1, G), G a power of two "
                         f"(activations, e.g. FP8_ACT); got {q.format} {q.scale_domain} {q.block}: "
                         "use onepath.numerics.quant.quantize for the others")
    k, group = x.shape[-1], q.block[1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n_groups = x2.shape[0], triton.cdiv(k, group)
    codes = torch.empty((m, k), device=x.device, dtype=torch.float8_e4m3fn)
    scales = scales_by_column(m, n_groups, x.device)
    if m and k:
        grid = (m, triton.cdiv(n_groups, GROUPS_PER_PROGRAM))
        args, constexprs = rule_args(q)
        _quant_fp8_kernel[grid](x2, codes, scales, x2.stride(0), codes.stride(0), scales.stride(0), scales.stride(1), k,
                                n_groups, *args, GROUP=group, GROUPS=GROUPS_PER_PROGRAM, num_warps=NUM_WARPS,
                                **constexprs)
    return FP8Tensor(codes.reshape(x.shape), scales.reshape(*x.shape[:-1], n_groups), q.block, q)


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
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    args, constexprs = rule_args(q)
    _write_kv_fp8_kernel[(tokens,)](
        k, v, slot_mapping.contiguous(), codes, v_cache.codes, scales, v_cache.scales,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), codes.stride(1), codes.stride(2),
        scales.stride(1), scales.stride(2), heads, dim, *args, **constexprs,
        BLOCK_HEADS=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim), num_warps=NUM_WARPS)
