"""sparse_attention: each query over its own gathered keys, one KV head read as K and V, with a sink per head.

DeepSeek-V4's attention: a query sees a list of L candidate rows gathered for it (its sliding window, then
the compressed entries its layer keeps: all of them, or the indexer's selection), `valid` marking the real
ones; a learnable logit per head (the sink) joins the softmax's denominator only:
    out_h = sum_j exp(s_hj - M) k_j / (sum_j exp(s_hj - M) + exp(sink_h - M)),   s_hj = q_h . k_j * scale
with M the largest of the valid s_hj and sink_h.

consistent: the dot products as a fixed tree over the head dim, the sums over the candidates in tiles of
`kv_tile` candidates (tree inside, tiles in ascending order), the sink's term added last; invalid candidates
give exact zeros, so a query's bits follow from its own candidate list alone: not from the queries beside it,
their number, the phase, or how many candidates its neighbours needed (a longer padded list adds zero tiles).
The list's order is the model's (window in ascending position, then the entries in the order the layer
emits them), so it fixes the accumulation order; `decode` is not read. consistent CUDA: the Triton kernel of
ops/cuda/sparse_attention.py (one program per query, tiles of kv_tile, an online softmax that starts at the
sink), with the same invariances.

baseline, the stock paths: a prefill (or a chunk) as transformers' eager attention runs it in the model's
dtype (the scores from a GEMM in that dtype, FP32 softmax with the sink, the probabilities rounded to the
model's dtype for the value GEMM); a decode step (`decode`: one query per sequence) by a path of its own, as
flash-decoding runs it: the candidates in splits whose number is chosen from the batch (enough work for
STOCK_PROGRAMS programs), each split's probabilities against its own maximum rounded to the model's dtype, the
FP32 partial outputs merged by their log-sum-exp. Backward: `reference`. `weights` gives the probabilities
themselves (the target of the indexer's training loss): plain FP32 math, no consistency claim.
"""
from __future__ import annotations

import math

import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import pinned_unary, row_chunks, tiled_sum, tree_sum


def weights(q, keys, valid, sinks, scale):
    """The attention probabilities of each query's candidates [T, H, L] (the sink's share left out), FP32."""
    s = torch.matmul(q.float(), keys.float().transpose(1, 2)) * scale                  # [T, H, L]
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    logits = torch.cat([s, sinks.float()[None, :, None].expand(s.shape[0], -1, 1)], dim=-1)
    return torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]


def reference(q, keys, valid, sinks, scale):
    """Plain FP32 attention with sinks (transformers' eager recipe): [T, H, D]."""
    return torch.matmul(weights(q, keys, valid, sinks, scale), keys.float()).to(q.dtype)


def consistent(q, keys, valid, sinks, scale, kv_tile: int, rows: int):
    sink = sinks.float()

    def chunk(qc, kc, vc):
        k = kc.float()
        s = tree_sum(qc.float()[:, None] * k[:, :, None]) * scale                         # [R, L, H]
        s = torch.where(vc[:, :, None], s, -math.inf)
        top = torch.maximum(s.amax(dim=1), sink)                                          # [R, H]
        e = pinned_unary(torch.exp, s - top[:, None])
        denom = tiled_sum(e, kv_tile, dim=1) + pinned_unary(torch.exp, sink - top)
        num = tiled_sum(e[..., None] * torch.where(vc[..., None], k, 0.0)[:, :, None], kv_tile, dim=1)
        return num / denom[..., None]

    return row_chunks(chunk, rows, q, keys, valid).to(q.dtype)


def stock_prefill(q, keys, valid, sinks, scale):
    s = torch.matmul(q, keys.to(q.dtype).transpose(1, 2)).float() * scale                # [T, H, L]
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    logits = torch.cat([s, sinks.float()[None, :, None].expand(s.shape[0], -1, 1)], dim=-1)
    p = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(p.to(q.dtype), keys.to(q.dtype))


STOCK_TILE = 8        # the stock decode's candidates per tile: a split holds whole tiles
STOCK_PROGRAMS = 32   # the (query, head, split) programs the stock decode fills: fewer splits as the batch grows


def stock_decode(q, keys, valid, sinks, scale):
    t, length = q.shape[0], keys.shape[1]
    splits = max(1, min(-(-length // STOCK_TILE), -(-STOCK_PROGRAMS // max(t * q.shape[1], 1))))
    size = -(-length // splits // STOCK_TILE) * STOCK_TILE
    s = torch.matmul(q.float(), keys.float().transpose(1, 2)) * scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    parts = []
    for a in range(0, length, size):
        part = s[..., a:a + size]
        top = part.amax(dim=-1)
        top = torch.where(torch.isinf(top), 0.0, top)                                   # an all-invalid split
        p = torch.exp(part - top[..., None])
        parts.append((top, p.sum(-1), torch.matmul(p.to(q.dtype), keys[:, a:a + size].to(q.dtype)).float()))
    sink = sinks.float()[None].expand(t, -1)
    top = torch.stack([p[0] for p in parts] + [sink]).amax(0)
    denom, out = torch.exp(sink - top), 0.0
    for m, total, o in parts:
        w = torch.exp(m - top)
        denom, out = denom + w * total, out + w[..., None] * o
    return (out / denom[..., None]).to(q.dtype)


def cpu_consistent(spec: ExecutionSpec, scale: float, decode: bool):
    o = spec.op("attention")
    return lambda q, keys, valid, sinks: consistent(q, keys, valid, sinks, scale, o.kv_tile, o.row_chunk)


def cuda_consistent(spec: ExecutionSpec, scale: float, decode: bool):
    from onepath.ops.cuda.sparse_attention import sparse_attention as triton_sparse_attention
    tile = spec.op("attention").kv_tile
    return lambda q, keys, valid, sinks: triton_sparse_attention(q, keys, valid, sinks, scale, tile)


def stock(spec: ExecutionSpec, scale: float, decode: bool):
    recipe = stock_decode if decode else stock_prefill
    return lambda q, keys, valid, sinks: recipe(q, keys, valid, sinks, scale)


# (mode, device) -> kernel factory (spec, scale, decode) -> kernel(q, keys, valid, sinks)
KERNELS = {
    ("consistent", "cpu"): cpu_consistent,
    ("consistent", "cuda"): cuda_consistent,
    ("baseline", "cpu"): stock,
    ("baseline", "cuda"): stock,
}


def sparse_attention(spec: ExecutionSpec, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                     sinks: torch.Tensor, scale: float, decode: bool = False) -> torch.Tensor:
    """q [T, H, D]; keys [T, L, D] each query's candidates (K = V); valid [T, L] bool; sinks [H] -> [T, H, D].
    decode: the launch is a decode step (one query per sequence); the baseline alone reads it."""
    if keys.shape[:2] != valid.shape or keys.shape[0] != q.shape[0] or keys.shape[-1] != q.shape[-1]:
        raise ValueError(f"sparse_attention: q {tuple(q.shape)}, keys {tuple(keys.shape)} and valid "
                         f"{tuple(valid.shape)} must be [T, H, D], [T, L, D] and [T, L]")
    kernel = KERNELS[spec.mode, spec.device](spec, scale, decode)
    return apply_kernel(lambda q, k, s: kernel(q, k, valid, s), lambda q, k, s: reference(q, k, valid, s, scale),
                        q, keys, sinks)
