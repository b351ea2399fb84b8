"""index_scores on Hopper: the lightning indexer's score of each candidate entry for each query.

    score_tj = sum_h (w_th * weights_scale) * relu(q_th . k_j) * softmax_scale           (the model's dtype)
    score_tj = (sum_h relu(q8_th . k8_j) * w'_th) * s_k[j]                               (FP8, ops/indexer.py)

Grid (query, tile of BLOCK_L entries): a program holds every indexer head of one query (BLOCK_H rows, padded
to 16, FP8 to 64) and one tile of its keys; the dots by tl.dot over the head dim in BLOCK_D chunks (FP32
accumulators, chunks ascending), then relu, the scales and the head weights in FP32 and the sum over the heads by
one tl.sum of a fixed [BLOCK_H, BLOCK_L] block. FP8: q8 and k8 are e4m3 codes (an e4m3 wgmma per 128-wide chunk of
d, accumulated as Hopper's FP8 tensor cores do, as DeepGEMM's), w' the head weights with the query's scales folded
in (FP32), and each entry's row scale s_k multiplies its head-weighted sum. Nothing in a score's arithmetic depends
on the other queries, on L or on where its keys came from: keys [T, L, d] gathered per query (a paged read) or
[L, d] shared by every query (contiguous rows, read with a zero query stride) give the same bits. Invalid entries
score -inf.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_L = 64     # entries a program scores
BLOCK_D = 64     # head-dim chunk of the dot (the model's dtype)
BLOCK_D_FP8 = 128  # head-dim chunk of an e4m3 dot (the recipe's index_head_dim: one dot)
NUM_WARPS = 4


def block_h(heads: int, fp8: bool) -> int:
    """Rows of a program's dot: the heads padded to a power of two, at least 16; FP8 at least 64, the M of Hopper's
    e4m3 wgmma (below it Triton upcasts the codes to an f16 mma.sync: another arithmetic)."""
    return max(64 if fp8 else 16, triton.next_power_of_2(heads))


@triton.jit(do_not_specialize=["L", "H", "D", "q_st", "q_sh", "k_st", "k_sl", "s_st", "w_st", "v_st", "o_st"])
def _index_scores_kernel(q_ptr, k_ptr, s_ptr, w_ptr, valid_ptr, o_ptr, L, H, D, softmax_scale, weights_scale, q_st,
                         q_sh, k_st, k_sl, s_st, w_st, v_st, o_st, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
                         BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr):
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
    w = tl.load(w_ptr + t * w_st + heads, mask=head_ok, other=0.0).to(tl.float32)
    if FP8:  # w' folds the query's scale; the key's scale leaves the head sum
        scores = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
        scores = scores * tl.load(s_ptr + t * s_st + j, mask=inside, other=0.0)
    else:
        scores = tl.sum(tl.maximum(dots, 0.0) * softmax_scale * (w * weights_scale)[:, None], axis=0)
    valid = inside & (tl.load(valid_ptr + t * v_st + j, mask=inside, other=0) != 0)
    tl.store(o_ptr + t * o_st + j, tl.where(valid, scores, float("-inf")), mask=inside)


def _launch(q, keys, scales, weights, valid, softmax_scale, weights_scale, fp8: bool) -> torch.Tensor:
    t, h, d = q.shape
    length = keys.shape[-2]
    v = valid.to(torch.int8).contiguous()
    out = torch.empty(t, length, dtype=torch.float32, device=q.device)
    if t == 0 or length == 0:
        return out
    k_st = 0 if keys.dim() == 2 else keys.stride(0)
    s_st = 0 if scales is None or scales.dim() == 1 else scales.stride(0)
    chunk = BLOCK_D_FP8 if fp8 else BLOCK_D
    grid = (t, triton.cdiv(length, BLOCK_L))
    _index_scores_kernel[grid](q, keys, out if scales is None else scales, weights, v, out, length, h, d,
                               softmax_scale, weights_scale, q.stride(0), q.stride(1), k_st, keys.stride(-2), s_st,
                               weights.stride(0), v.stride(0), out.stride(0), BLOCK_H=block_h(h, fp8),
                               BLOCK_L=BLOCK_L, BLOCK_D=min(chunk, max(32 if fp8 else 16, triton.next_power_of_2(d))),
                               PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=fp8,
                               num_warps=NUM_WARPS)
    return out


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor,
                 softmax_scale: float, weights_scale: float) -> torch.Tensor:
    """q [T, H, d]; keys [T, L, d] (gathered per query) or [L, d] (shared); weights [T, H]; valid [T, L] ->
    scores [T, L] FP32, -inf where invalid."""
    return _launch(q.contiguous(), keys.to(q.dtype).contiguous(), None, weights.contiguous(), valid, softmax_scale,
                   weights_scale, fp8=False)


def index_scores_fp8(q_codes: torch.Tensor, key_codes: torch.Tensor, key_scales: torch.Tensor, weights: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
    """q_codes [T, H, d] e4m3; key_codes [T, L, d] or [L, d] e4m3 with their row scales key_scales [T, L] or [L];
    weights [T, H] FP32, the query's scales folded in -> scores [T, L] FP32, -inf where invalid."""
    return _launch(q_codes.contiguous(), key_codes.contiguous(), key_scales.float().contiguous(),
                   weights.float().contiguous(), valid, 1.0, 1.0, fp8=True)
