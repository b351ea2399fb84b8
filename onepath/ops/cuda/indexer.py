"""index_scores on Hopper: the lightning indexer's score of each candidate entry for each query.

    score_tj = sum_h (w_th * weights_scale) * relu(q_th . k_j) * softmax_scale

Grid (query, tile of BLOCK_L entries): a program holds every indexer head of one query (BLOCK_H rows, padded to
16) and one tile of its keys; the dots by tl.dot over the head dim in BLOCK_D chunks (FP32 accumulators, chunks
ascending), then relu, the scales and the head weights in FP32 and the sum over the heads by one tl.sum of a fixed
[BLOCK_H, BLOCK_L] block. Nothing in a score's arithmetic depends on the other queries, on L or on where its
keys came from: keys [T, L, d] gathered per query (a paged read) or [L, d] shared by every query (contiguous rows,
read with a zero query stride) give the same bits. Invalid entries score -inf.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_L = 64     # entries a program scores
BLOCK_D = 64     # head-dim chunk of the dot
NUM_WARPS = 4


@triton.jit(do_not_specialize=["L", "H", "D", "q_st", "q_sh", "k_st", "k_sl", "w_st", "v_st", "o_st"])
def _index_scores_kernel(q_ptr, k_ptr, w_ptr, valid_ptr, o_ptr, L, H, D, softmax_scale, weights_scale, q_st, q_sh,
                         k_st, k_sl, w_st, v_st, o_st, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
                         BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    heads = tl.arange(0, BLOCK_H)
    head_ok, inside = heads < H, j < L
    dots = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dims = d0 + tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + t * q_st + heads[:, None] * q_sh + dims[None, :],
                    mask=head_ok[:, None] & (dims < D)[None, :], other=0.0)
        k = tl.load(k_ptr + t * k_st + j[:, None] * k_sl + dims[None, :], mask=inside[:, None] & (dims < D)[None, :],
                    other=0.0)
        dots += tl.dot(q, tl.trans(k), input_precision=PRECISION)
    w = tl.load(w_ptr + t * w_st + heads, mask=head_ok, other=0.0).to(tl.float32) * weights_scale
    scores = tl.sum(tl.maximum(dots, 0.0) * softmax_scale * w[:, None], axis=0)
    valid = inside & (tl.load(valid_ptr + t * v_st + j, mask=inside, other=0) != 0)
    tl.store(o_ptr + t * o_st + j, tl.where(valid, scores, float("-inf")), mask=inside)


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor,
                 softmax_scale: float, weights_scale: float) -> torch.Tensor:
    """q [T, H, d]; keys [T, L, d] (gathered per query) or [L, d] (shared); weights [T, H]; valid [T, L] ->
    scores [T, L] FP32, -inf where invalid."""
    t, h, d = q.shape
    length = keys.shape[-2]
    q, keys, weights = q.contiguous(), keys.to(q.dtype).contiguous(), weights.contiguous()
    v = valid.to(torch.int8).contiguous()
    out = torch.empty(t, length, dtype=torch.float32, device=q.device)
    if t == 0 or length == 0:
        return out
    k_st = 0 if keys.dim() == 2 else keys.stride(0)
    grid = (t, triton.cdiv(length, BLOCK_L))
    _index_scores_kernel[grid](q, keys, weights, v, out, length, h, d, softmax_scale, weights_scale, q.stride(0),
                               q.stride(1), k_st, keys.stride(-2), weights.stride(0), v.stride(0), out.stride(0),
                               BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_L=BLOCK_L,
                               BLOCK_D=min(BLOCK_D, max(16, triton.next_power_of_2(d))),
                               PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS)
    return out
