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
The rule's Triton functions live in quant_rows.py (shared with the producers that quantise their own output
and with the FP8 K/V write, attention_kv.write_kv_fp8).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.numerics.quant import FP8Tensor
from onepath.numerics.spec import FP8_ACT, QuantSpec
from onepath.ops.cuda.quant_rows import quantize_rows, rule_args, scales_by_column

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


def quantize_fp8(x: torch.Tensor, q: QuantSpec = FP8_ACT) -> FP8Tensor:
    """x [..., K] (BF16/FP16/FP32) -> FP8Tensor(codes [..., K] float8_e4m3fn, scales [..., ceil(K/G)] FP32),
    bit-equal to onepath.numerics.quant.quantize_fp8(x, q) for a 1 x G block rule. The scales are stored by
    column (quant_rows.scales_by_column), as the FP8 GEMM loads them."""
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
