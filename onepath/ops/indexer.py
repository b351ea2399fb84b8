"""index_scores: the lightning indexer's score of each compressed entry for each query, in FP32.

    score_tj = sum_h (w_th * weights_scale) * relu(q_th . k_j) * softmax_scale
q: the indexer's query heads, k_j: entry j's indexer key, w: a per-query weight per head. ops.index_topk then
keeps the best entries of each query.

One arithmetic for every read: the keys come as each query's gathered rows [T, L, d] (from a paged cache in
every phase, ops/cache_rows.py) or as contiguous rows [L, d] shared by all queries (a prefill holding the
whole context); the consistent path scores both by the same per-query formula, dot products as a fixed tree
over d and the head sum as a fixed tree over the heads, on fixed-shape row chunks, so a query's scores do not
depend on the layout its keys were read from, on its neighbours, or on the phase. baseline: the stock prefill
and paged-decode paths, a GEMM over the launch for contiguous keys and per-query products summed by torch for
gathered keys, then a sum over the heads. consistent CUDA: the Triton kernel of ops/cuda/indexer.py (tensor-core
dots in the model's dtype with FP32 accumulation, one fixed head sum), the same invariances. Invalid entries score
-inf. Backward: `reference`.
"""
from __future__ import annotations

import math

import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import row_chunks, tree_sum


def reference(q, keys, weights, valid, softmax_scale, weights_scale):
    k = keys.float() if keys.dim() == 3 else keys.float().expand(q.shape[0], -1, -1)
    dots = torch.matmul(q.float(), k.transpose(1, 2))                                   # [T, H, L]
    scores = (torch.relu(dots) * softmax_scale * (weights.float() * weights_scale)[..., None]).sum(dim=1)
    return scores.masked_fill(~valid, -math.inf)


def stock(q, keys, weights, valid, softmax_scale, weights_scale):
    """A prefill's GEMM over contiguous keys, a paged decode's per-query products and sum over gathered keys."""
    t, h, d = q.shape
    if keys.dim() == 2:
        dots = (q.float().reshape(t * h, d) @ keys.float().t()).view(t, h, -1)
    else:
        dots = (q.float()[:, :, None, :] * keys.float()[:, None]).sum(dim=-1)
    scores = (torch.relu(dots) * softmax_scale * (weights.float() * weights_scale)[..., None]).sum(dim=1)
    return scores.masked_fill(~valid, -math.inf)


def consistent(q, keys, weights, valid, softmax_scale, weights_scale, rows: int):
    w = weights.float() * weights_scale

    def chunk(qc, wc, kc):
        dots = tree_sum(qc.float()[:, None] * kc.float()[:, :, None])                      # [R, L, H]
        return tree_sum(torch.relu(dots) * softmax_scale * wc[:, None])                     # [R, L]

    if keys.dim() == 2:
        shared = keys.float()
        scores = row_chunks(lambda qc, wc: chunk(qc, wc, shared.expand(qc.shape[0], -1, -1)), rows, q, w)
    else:
        scores = row_chunks(chunk, rows, q, w, keys)
    return scores.masked_fill(~valid, -math.inf)


def cpu_consistent(spec: ExecutionSpec, softmax_scale: float, weights_scale: float):
    rows = spec.op("attention").row_chunk
    return lambda q, k, w, valid: consistent(q, k, w, valid, softmax_scale, weights_scale, rows)


def cuda_consistent(spec: ExecutionSpec, softmax_scale: float, weights_scale: float):
    from onepath.ops.cuda.indexer import index_scores as triton_index_scores
    return lambda q, k, w, valid: triton_index_scores(q, k, w, valid, softmax_scale, weights_scale)


def baseline(spec: ExecutionSpec, softmax_scale: float, weights_scale: float):
    return lambda q, k, w, valid: stock(q, k, w, valid, softmax_scale, weights_scale)


# (mode, device) -> kernel factory (spec, scales) -> kernel(q, keys, weights, valid)
KERNELS = {
    ("consistent", "cpu"): cpu_consistent,
    ("consistent", "cuda"): cuda_consistent,
    ("baseline", "cpu"): baseline,
    ("baseline", "cuda"): baseline,
}


def index_scores(spec: ExecutionSpec, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                 valid: torch.Tensor, softmax_scale: float, weights_scale: float) -> torch.Tensor:
    """q [T, H, d]; keys [T, L, d] (gathered per query) or [L, d] (shared); weights [T, H]; valid [T, L] ->
    scores [T, L] FP32, -inf where invalid."""
    length = keys.shape[-2]
    if keys.shape[-1] != q.shape[-1] or valid.shape != (q.shape[0], length) or weights.shape != q.shape[:2]:
        raise ValueError(f"index_scores: q {tuple(q.shape)}, keys {tuple(keys.shape)}, weights "
                         f"{tuple(weights.shape)} and valid {tuple(valid.shape)} do not fit [T, H, d], [T, L, d] or "
                         "[L, d], [T, H] and [T, L]")
    kernel = KERNELS[spec.mode, spec.device](spec, softmax_scale, weights_scale)
    return apply_kernel(lambda q, k, w: kernel(q, k, w, valid),
                        lambda q, k, w: reference(q, k, w, valid, softmax_scale, weights_scale), q, keys, weights)
