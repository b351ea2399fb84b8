"""compress on Hopper: DeepSeek-V4's gated pooling of a window's slots into one entry, compressor.consistent's
arithmetic step for step.

    g = gate + bias (-inf where the slot is invalid); e = exp(g - max_s g); w = div_rn(e, tree_sum_s e)
    entry = round(tree_sum_s(where(valid, kv, 0) * w), kv.dtype)

Grid (entry, block of channels): a program holds its entry's slots (padded to S_PAD, a power of two) for BLOCK_C
channels, slots on the last dim, and sums over them by pinned.tree_sum's halving tree (the CPU's, padded slots
adding exact zeros). Every entry is computed from its own slots alone: its bits do not depend on the other
entries, on how many windows close in the launch or on the phase. Launched with enable_fp_fusion=False, so every
product rounds before its add as torch's do, and the division is IEEE (div_rn); exp is the GPU's (tl.exp), the
only step whose bits are not the CPU's (tests/ops/test_compressor_interpret.py installs the CPU's exp in the
interpreter and gets compressor.consistent's bits).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.ops.cuda import unit_stride
from onepath.ops.cuda.pinned import pow2, tree_sum

TILE = 4096      # slots x channels a program holds: BLOCK_C = TILE // S_PAD (channels are independent)
NUM_WARPS = 4


@triton.jit(do_not_specialize=["S", "C", "kv_se", "kv_ss", "g_se", "g_ss", "b_ss", "v_se", "o_se"])
def _compress_kernel(kv_ptr, gate_ptr, bias_ptr, valid_ptr, out_ptr, S, C, kv_se, kv_ss, g_se, g_ss, b_ss, v_se,
                     o_se, S_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.arange(0, S_PAD)
    inside = (c < C)[:, None] & (s < S)[None, :]
    valid = (tl.load(valid_ptr + e * v_se + s, mask=s < S, other=0) != 0)[None, :]
    gate = tl.load(gate_ptr + e * g_se + s[None, :] * g_ss + c[:, None], mask=inside, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + s[None, :] * b_ss + c[:, None], mask=inside, other=0.0)
    g = tl.where(valid, gate + bias, float("-inf"))                                      # [BLOCK_C, S_PAD]
    ex = tl.exp(g - tl.max(g, axis=1)[:, None])
    w = tl.math.div_rn(ex, tree_sum(ex)[:, None])
    kv = tl.load(kv_ptr + e * kv_se + s[None, :] * kv_ss + c[:, None], mask=inside, other=0.0).to(tl.float32)
    pooled = tree_sum(tl.where(valid, kv, 0.0) * w)
    tl.store(out_ptr + e * o_se + c, pooled.to(out_ptr.dtype.element_ty), mask=c < C)


def compress(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """kv, gate [E, S, C] (any strides but unit channel stride); bias [S, C] FP32; valid [E, S] -> [E, C] in kv's
    dtype."""
    n, slots, channels = kv.shape
    kv, gate, bias = unit_stride(kv.detach()), unit_stride(gate.detach()), unit_stride(bias.detach().float())
    v = valid.to(torch.int8).contiguous()
    out = torch.empty(n, channels, dtype=kv.dtype, device=kv.device)
    if n == 0 or channels == 0:
        return out
    s_pad = pow2(slots)
    block_c = min(triton.next_power_of_2(channels), max(16, TILE // s_pad))
    _compress_kernel[(n, triton.cdiv(channels, block_c))](
        kv, gate, bias, v, out, slots, channels, kv.stride(0), kv.stride(1), gate.stride(0), gate.stride(1),
        bias.stride(0), v.stride(0), out.stride(0), S_PAD=s_pad, BLOCK_C=block_c, num_warps=NUM_WARPS,
        enable_fp_fusion=False)
    return out
