"""sparse_attention on Hopper: each query over its own gathered candidates (K = V, one KV head), a sink per head.

Grid (query, block of output channels): a program holds every head of one query (BLOCK_H rows of its dots, the
heads padded to 16) and walks the query's candidate list in tiles of KV_TILE, ascending: the scores by tl.dot
over the head dim in BLOCK_D chunks (FP32 accumulators, chunks ascending), an online softmax whose running max
starts at the sink and whose running sum starts at the sink's 1 (so the sink sits in the denominator as
exp(sink - max), no more), P rounded to the keys' dtype for the value dot, the FP32 output block rescaled per
tile. A tile without a valid candidate leaves the max, the sum and the output exactly as they were (alpha = 1,
p = 0), so a list padded with invalid candidates gives the same bits, and a query's bits depend on its own list
alone: not on the other queries, their number, or the phase. The tiles are the spec's attention.kv_tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 64     # head-dim chunk of the score dot
BLOCK_DV = 128   # output channels a program writes
NUM_WARPS = 4


@triton.jit(do_not_specialize=["L", "H", "D", "q_st", "q_sh", "k_st", "k_sl", "v_st", "o_st", "o_sh"])
def _sparse_attention_kernel(q_ptr, k_ptr, valid_ptr, sink_ptr, o_ptr, L, H, D, scale, q_st, q_sh, k_st, k_sl,
                             v_st, o_st, o_sh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_DV: tl.constexpr, KV_TILE: tl.constexpr, PRECISION: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < H
    out_cols = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    out_ok = out_cols < D
    m = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
    l = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    q_row, k_row = q_ptr + t * q_st, k_ptr + t * k_st
    for start in range(0, L, KV_TILE):
        j = start + tl.arange(0, KV_TILE)
        inside = j < L
        valid = inside & (tl.load(valid_ptr + t * v_st + j, mask=inside, other=0) != 0)
        s = tl.zeros([BLOCK_H, KV_TILE], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dims = d0 + tl.arange(0, BLOCK_D)
            q = tl.load(q_row + heads[:, None] * q_sh + dims[None, :], mask=head_ok[:, None] & (dims < D)[None, :],
                        other=0.0)
            k = tl.load(k_row + j[:, None] * k_sl + dims[None, :], mask=inside[:, None] & (dims < D)[None, :],
                        other=0.0)
            s += tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(k_row + j[:, None] * k_sl + out_cols[None, :], mask=inside[:, None] & out_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / l[:, None]
    tl.store(o_ptr + t * o_st + heads[:, None] * o_sh + out_cols[None, :], out.to(o_ptr.dtype.element_ty),
             mask=head_ok[:, None] & out_ok[None, :])


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float,
                     kv_tile: int) -> torch.Tensor:
    """q [T, H, D]; keys [T, L, D] (K = V); valid [T, L] bool; sinks [H] -> [T, H, D] in q's dtype."""
    t, h, d = q.shape
    q, keys = q.contiguous(), keys.to(q.dtype).contiguous()
    v = valid.to(torch.int8).contiguous()
    out = torch.empty_like(q)
    if t == 0:
        return out
    block_dv = min(BLOCK_DV, max(16, triton.next_power_of_2(d)))
    grid = (t, triton.cdiv(d, block_dv))
    _sparse_attention_kernel[grid](q, keys, v, sinks.float().contiguous(), out, keys.shape[1], h, d, scale,
                                   q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), v.stride(0),
                                   out.stride(0), out.stride(1), BLOCK_H=max(16, triton.next_power_of_2(h)),
                                   BLOCK_D=min(BLOCK_D, max(16, triton.next_power_of_2(d))), BLOCK_DV=block_dv,
                                   KV_TILE=max(16, kv_tile),
                                   PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                                   num_warps=NUM_WARPS)
    return out
