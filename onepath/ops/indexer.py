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

FP8 scoring (the spec's indexer.act / indexer.kv, the fp8_indexer preset; DeepSeek-V3.2 / V4 inference, DeepGEMM's
fp8 MQA logits): the query heads quantised per (token, head) and the keys per row, e4m3 with one power-of-two
scale each (FP8_INDEX, quant.py's rule); a row's scale leaves the dot, so

    w'_th    = ((w_th * weights_scale) * softmax_scale) * s_q[t, h]          FP32, fold()
    score_tj = (sum_h relu(q8_th . k8_j) * w'_th) * s_k[j]                   dots FP32, the head sum fixed

The keys come as the cache stores them (an FP8Tensor of codes and row scales, ops/cache_rows.gather_stored), or
in the model's dtype and quantised here by indexer.kv. consistent CPU: each dot summed exactly (e4m3 products are
exact in FP64 and every partial sum of d <= 2^17 of them is a multiple of 2^-18 below 2^35, so any order gives
the exact dot) and rounded once to FP32, the head sum a fixed tree: a query's scores depend on nothing but its own
codes, whatever the launch. consistent CUDA: the same kernel on e4m3 operands (tl.dot, FP32 accumulation, one dot
per 128-wide chunk of d), the key's scale after the head sum. baseline: both dequantised to FP32, then the stock
paths above. Backward: `reference` on the unquantised query and the keys' values (straight-through).
"""
from __future__ import annotations

import math

import torch

from onepath.numerics.quant import FP8Tensor, quantize_fp8
from onepath.numerics.spec import ExecutionSpec, QuantSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import row_chunks, tree_sum


def reference(q, keys, weights, valid, softmax_scale, weights_scale):
    k = keys.float() if keys.dim() == 3 else keys.float().expand(q.shape[0], -1, -1)
    dots = torch.matmul(q.float(), k.transpose(1, 2))                                   # [T, H, L]
    scores = (torch.relu(dots) * softmax_scale * (weights.float() * weights_scale)[..., None]).sum(dim=1)
    return scores.masked_fill(~valid, -math.inf)


# the stock paged path's [rows, H, L, d] FP32 products held at a time: all T queries' at once (4 T H L d bytes)
# do not fit a GPU at an engine's profiling step (the arithmetic: docs/ops/indexer.md)
STOCK_PRODUCT_BYTES = 1 << 30


def stock(q, keys, weights, valid, softmax_scale, weights_scale):
    """A prefill's GEMM over contiguous keys, a paged decode's per-query products and sum over gathered keys, a
    piece of the queries at a time (on the CPU the pieces move no bit: a query's sums are its own)."""
    t, h, d = q.shape
    if keys.dim() == 2:
        dots = (q.float().reshape(t * h, d) @ keys.float().t()).view(t, h, -1)
    else:
        rows = max(1, STOCK_PRODUCT_BYTES // (4 * h * d * max(keys.shape[1], 1)))
        dots = torch.cat([(qc[:, :, None, :] * kc[:, None]).sum(dim=-1)
                          for qc, kc in zip(q.float().split(rows), keys.float().split(rows))])
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


def fold(weights, q_scales, softmax_scale, weights_scale):
    """The head weights [T, H] with the query's row scales [T, H, 1] folded in, FP32, in one order on every device."""
    return weights.float() * weights_scale * softmax_scale * q_scales[..., 0]


def exact_dots(q_codes, k_codes):
    """[T, H, L]: every e4m3 dot q8_th . k8_j summed exactly in FP64 (any launch shape gives the exact sum), then
    rounded once to FP32. k_codes [T, L, d] (per query) or [L, d] (shared)."""
    k = k_codes.double()
    return torch.matmul(q_codes.double(), k.transpose(-1, -2)).float()


def consistent_fp8(q_codes, keys: FP8Tensor, w, valid):
    dots = exact_dots(q_codes, keys.codes)                                                   # [T, H, L]
    scores = tree_sum((torch.relu(dots) * w[..., None]).transpose(1, 2))                     # [T, L]
    return (scores * keys.scales[..., 0]).masked_fill(~valid, -math.inf)


def fp8_kernel(score):
    """A kernel(q, keys, weights, valid) of FP8 keys from score(q_codes, keys, folded weights, valid): the query
    quantised by the rule, its scales folded into the head weights."""
    def factory(spec: ExecutionSpec, softmax_scale: float, weights_scale: float):
        rule = spec.op("indexer").act

        def kernel(q, keys, w, valid):
            q8 = quantize_fp8(q, rule)
            return score(q8.codes, keys, fold(w, q8.scales, softmax_scale, weights_scale), valid)
        return kernel
    return factory


def cuda_consistent_fp8(q_codes, keys, w, valid):
    from onepath.ops.cuda.indexer import index_scores_fp8
    return index_scores_fp8(q_codes, keys.codes, keys.scales[..., 0], w, valid)


def baseline_fp8(spec: ExecutionSpec, softmax_scale: float, weights_scale: float):
    """The stock way: both sides dequantised to FP32, then the stock prefill GEMM or paged-decode sum."""
    rule = spec.op("indexer").act
    return lambda q, keys, w, valid: stock(quantize_fp8(q, rule).dequantize(), keys.dequantize(), w, valid,
                                           softmax_scale, weights_scale)


# (mode, device) -> kernel factory (spec, scales) -> kernel(q, keys, weights, valid)
KERNELS = {
    ("consistent", "cpu"): cpu_consistent,
    ("consistent", "cuda"): cuda_consistent,
    ("baseline", "cpu"): baseline,
    ("baseline", "cuda"): baseline,
}
# the same under the spec's indexer.kv: keys an FP8Tensor
FP8_KERNELS = {
    ("consistent", "cpu"): fp8_kernel(consistent_fp8),
    ("consistent", "cuda"): fp8_kernel(cuda_consistent_fp8),
    ("baseline", "cpu"): baseline_fp8,
    ("baseline", "cuda"): baseline_fp8,
}


def index_scores(spec: ExecutionSpec, q: torch.Tensor, keys, weights: torch.Tensor, valid: torch.Tensor,
                 softmax_scale: float, weights_scale: float, key_values: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, d]; keys [T, L, d] (gathered per query) or [L, d] (shared), or under the spec's indexer.kv those
    keys' codes and row scales ([T, L, 1] or [L, 1]) as an FP8Tensor; weights [T, H]; valid [T, L] -> scores
    [T, L] FP32, -inf where invalid. key_values: FP8 keys' values for the gradient (straight-through), else their
    dequantised codes."""
    rule: QuantSpec | None = spec.op("indexer").kv
    fp8 = isinstance(keys, FP8Tensor)
    if fp8 and rule is None:
        raise ValueError("index_scores got FP8 keys under a spec without indexer.kv: build the spec with the "
                         "fp8_indexer preset, or read the keys in the model's dtype")
    codes = keys.codes if fp8 else keys
    length = codes.shape[-2]
    if codes.shape[-1] != q.shape[-1] or valid.shape != (q.shape[0], length) or weights.shape != q.shape[:2]:
        raise ValueError(f"index_scores: q {tuple(q.shape)}, keys {tuple(codes.shape)}, weights "
                         f"{tuple(weights.shape)} and valid {tuple(valid.shape)} do not fit [T, H, d], [T, L, d] or "
                         "[L, d], [T, H] and [T, L]")
    if rule is None:
        kernel = KERNELS[spec.mode, spec.device](spec, softmax_scale, weights_scale)
        return apply_kernel(lambda q, k, w: kernel(q, k, w, valid),
                            lambda q, k, w: reference(q, k, w, valid, softmax_scale, weights_scale), q, keys, weights)
    if q.shape[-1] > 1 << 17:
        raise ValueError(f"index_scores: index_head_dim {q.shape[-1]} > 2^17: an FP8 dot of that length is no longer "
                         "exact in FP64 on the CPU; score in the model's dtype (drop fp8_indexer)")
    if not fp8:
        key_values, keys = keys if key_values is None else key_values, quantize_fp8(keys.detach(), rule)
    kernel = FP8_KERNELS[spec.mode, spec.device](spec, softmax_scale, weights_scale)
    score = lambda q, k, w: reference(q, k, w, valid, softmax_scale, weights_scale)
    if key_values is None:
        return apply_kernel(lambda q, w: kernel(q, keys, w, valid), lambda q, w: score(q, keys.dequantize(), w),
                            q, weights)
    return apply_kernel(lambda q, k, w: kernel(q, keys, w, valid), score, q, key_values, weights)
