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
emits them), so it fixes the accumulation order. baseline: one batched matmul and torch.softmax over the
launch, as a stock eager attention with sinks runs it. Backward: `reference`. `weights` gives the probabilities
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


def cpu_consistent(spec: ExecutionSpec, scale: float):
    o = spec.op("attention")
    return lambda q, keys, valid, sinks: consistent(q, keys, valid, sinks, scale, o.kv_tile, o.row_chunk)


def stock(spec: ExecutionSpec, scale: float):
    return lambda q, keys, valid, sinks: reference(q, keys, valid, sinks, scale)


# (mode, device) -> kernel factory (spec, scale) -> kernel(q, keys, valid, sinks); the torch recipes serve CUDA
# until its Triton kernel lands
KERNELS = {
    ("consistent", "cpu"): cpu_consistent,
    ("consistent", "cuda"): cpu_consistent,
    ("baseline", "cpu"): stock,
    ("baseline", "cuda"): stock,
}


def sparse_attention(spec: ExecutionSpec, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                     sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D]; keys [T, L, D] each query's candidates (K = V); valid [T, L] bool; sinks [H] -> [T, H, D]."""
    if keys.shape[:2] != valid.shape or keys.shape[0] != q.shape[0] or keys.shape[-1] != q.shape[-1]:
        raise ValueError(f"sparse_attention: q {tuple(q.shape)}, keys {tuple(keys.shape)} and valid "
                         f"{tuple(valid.shape)} must be [T, H, D], [T, L, D] and [T, L]")
    kernel = KERNELS[spec.mode, spec.device](spec, scale)
    return apply_kernel(lambda q, k, s: kernel(q, k, valid, s), lambda q, k, s: reference(q, k, valid, s, scale),
                        q, keys, sinks)
