"""attention over a paged KV cache: prefill, chunked prefill, decode and the training forward.

The new K/V are written into the cache first (slot_mapping), then every query attends to its own
sequence's keys at absolute positions 0..pos through the block table.

consistent: one path for every phase. For a query at position p the scores over keys 0..p are
summed in KV tiles of absolute positions [i*kv_tile, (i+1)*kv_tile), ascending, tree inside a
tile; keys past p contribute exact zeros. A query's bits therefore depend neither on how many
queries share its launch nor on the phase nor on the batch. The softmax max is exact and global.
baseline: the stock fast path: one padded SDPA call on the fresh K/V of whole prompts, SDPA with a
mask for a chunk over a cached prefix, a batched matmul decode path for single-token queries (on CUDA
the paged kernel with a batch-dependent KV split, as flash-decoding runs: torch has no paged decode).

FP8 KV cache (the spec's attention.kv, FP8_KV): a layer's cache is an FP8Tensor (codes float8_e4m3fn
[blocks, block_size, Hkv, D], FP32 scales [blocks, block_size, Hkv, 1]). write_kv quantises each new
token's K and V per head by quant.py's rule; every read dequantises the same way, before attending:
    k = (code.float() * scale).to(q.dtype)     one FP32 product, then one rounding to q's dtype
(`load_slots` here, the `FP8_KV` branch of the Triton kernel). Prefill, chunks, decode and the trainer's
private cache all read through it, so the quantisation moves no bit between them. The backward
stays straight-through: `reference` differentiates attention over the fresh, unquantised K/V.
The baseline's SDPA prefill attends to the fresh K/V and so ignores the quantisation (the naive
path a stock engine takes); its chunked prefill and decode read the quantised cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from onepath.numerics.quant import FP8Tensor, quantize_fp8
from onepath.numerics.spec import ExecutionSpec, OpSpec, QuantSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.host import to_device
from onepath.ops.pinned import pinned_unary, row_chunks, tiled_sum, tree_sum


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor      # [T] absolute position of each query token
    query_seq: torch.Tensor      # [T] index of the token's sequence in this batch
    cu_seqlens: list[int]        # [B + 1] query token offsets per sequence
    context_lens: list[int]      # [B] keys in the cache for each sequence once this step's K/V are written
    block_tables: torch.Tensor   # [B, max_blocks] cache block ids (padding entries are never read)
    slot_mapping: torch.Tensor   # [T] cache slot where each new token's K/V go
    block_size: int
    # tensors derived from the batch alone (padded_sdpa's row maps, the kernel's query blocks): made by the
    # first layer, kept for the others
    derived: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def query_len(self, b: int) -> int:
        return self.cu_seqlens[b + 1] - self.cu_seqlens[b]


# the baseline's decode tile: its own choice, not the spec's (the spec's tile is the consistent contract)
BASELINE_KV_TILE = 32


def write_kv(k_cache, v_cache, k, v, slot_mapping, kv: QuantSpec | None = None):
    """This step's K/V [T, Hkv, D] into their slots; quantised by `kv` (the spec's attention.kv) when
    the cache is FP8. On CUDA both take one launch (ops/cuda/attention_kv.py: write_kv, write_kv_fp8)."""
    if isinstance(k_cache, FP8Tensor) != (kv is not None):
        raise TypeError(f"KV cache of {type(k_cache).__name__} with the spec's attention.kv {kv}: build the "
                        "cache from the model's spec (model.make_cache) so its format follows the spec")
    cuda = (k_cache if kv is None else k_cache.codes).is_cuda
    KV_WRITES[kv is not None, cuda](k_cache, v_cache, k.detach(), v.detach(), slot_mapping, kv)


def write_kv_cpu(k_cache, v_cache, k, v, slot_mapping, kv):
    for cache, x in ((k_cache, k), (v_cache, v)):
        write_slots(cache, x, slot_mapping, kv)


def write_slots(cache, x, slots, kv: QuantSpec | None):
    """Rows x [N, *row] into a paged cache's slots [N] (torch, either device): as they are, or quantised by `kv`
    (quant.py's rule, per row) into an FP8 cache."""
    if kv is None:
        cache.view(-1, *cache.shape[2:])[slots] = x.to(cache.dtype)
        return
    fp8 = quantize_fp8(x, kv)
    cache.codes.view(-1, *cache.codes.shape[2:])[slots] = fp8.codes
    cache.scales.view(-1, *cache.scales.shape[2:])[slots] = fp8.scales


def write_kv_cuda(k_cache, v_cache, k, v, slot_mapping, kv):
    from onepath.ops.cuda.attention_kv import write_kv as triton_write_kv
    triton_write_kv(k_cache, v_cache, k, v, slot_mapping)


def write_kv_fp8_cuda(k_cache, v_cache, k, v, slot_mapping, kv):
    from onepath.ops.cuda.attention_kv import write_kv_fp8
    write_kv_fp8(k_cache, v_cache, k, v, slot_mapping, kv)


# (FP8 cache, on CUDA) -> the K/V write (k_cache, v_cache, k, v, slot_mapping, kv)
KV_WRITES = {
    (False, False): write_kv_cpu,
    (True, False): write_kv_cpu,
    (False, True): write_kv_cuda,
    (True, True): write_kv_fp8_cuda,
}


def cache_shape(cache) -> torch.Size:
    """[blocks, block_size, Hkv, D] of a plain or FP8 cache."""
    return cache.codes.shape if isinstance(cache, FP8Tensor) else cache.shape


def load_slots(cache, slots, dtype):
    """The cache rows at `slots` (any shape) -> [*slots.shape, Hkv, D]: an FP8 cache's dequantised to
    dtype, code.float() * scale then one rounding (the kernel's order); a plain cache's as stored."""
    if isinstance(cache, FP8Tensor):
        codes = cache.codes.view(-1, *cache.codes.shape[2:])[slots]
        return (codes.float() * cache.scales.view(-1, *cache.scales.shape[2:])[slots]).to(dtype)
    return cache.view(-1, *cache.shape[2:])[slots]


def _key_mask(pos, length, window):
    j = torch.arange(length, device=pos.device)
    valid = j[None, :] <= pos[:, None]
    if window:
        valid &= j[None, :] > pos[:, None] - window
    return valid


def consistent(q, k_cache, v_cache, meta: AttentionMetadata, scale, window, kv_tile, rows):
    heads = q.shape[1]
    num_kv_heads = cache_shape(k_cache)[2]
    head_to_kv = torch.arange(heads, device=q.device) // (heads // num_kv_heads)
    bs = meta.block_size

    def chunk(qc, pos, seq):
        length = -(-(int(pos.max()) + 1) // kv_tile) * kv_tile
        valid = _key_mask(pos, length, window)
        j = torch.arange(length, device=q.device)
        blocks = meta.block_tables[seq][:, (j // bs).clamp(max=meta.block_tables.shape[1] - 1)]
        slots = torch.where(valid, blocks * bs + j % bs, 0)
        k = load_slots(k_cache, slots, q.dtype)[:, :, head_to_kv].float()     # [R, L, H, D]
        v = load_slots(v_cache, slots, q.dtype)[:, :, head_to_kv].float()
        v = torch.where(valid[:, :, None, None], v, 0.0)
        s = tree_sum(qc.float()[:, None] * k) * scale            # [R, L, H]
        s = torch.where(valid[:, :, None], s, -math.inf)
        e = pinned_unary(torch.exp, s - s.amax(dim=1, keepdim=True))
        denom = tiled_sum(e, kv_tile, dim=1)                      # [R, H]
        num = tiled_sum(e[..., None] * v, kv_tile, dim=1)         # [R, H, D]
        return num / denom[..., None]

    return row_chunks(chunk, rows, q, meta.positions, meta.query_seq).to(q.dtype)


def _gather_context(cache, meta, b, dtype):
    bs = meta.block_size
    j = torch.arange(meta.context_lens[b], device=meta.block_tables.device)
    return load_slots(cache, meta.block_tables[b][j // bs] * bs + j % bs, dtype)


def whole_sequences(meta: AttentionMetadata) -> bool:
    """Every sequence of the batch is here from position 0 (a prefill of fresh prompts, a training batch)."""
    return all(meta.query_len(b) == meta.context_lens[b] for b in range(meta.num_seqs))


def padded_rows(meta: AttentionMetadata, seqs: list[int], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The rows of sequences `seqs` in the batch (src, in order) and in their right-padded [len(seqs),
    longest] layout (dst), and longest: made by the first layer, kept in meta.derived for the others."""
    cached = meta.derived.get("padded_rows")
    if cached is None or cached[0] != seqs:
        lengths = [meta.query_len(b) for b in seqs]
        longest, tokens = max(lengths), sum(lengths)
        count = to_device(lengths, torch.int64, device)
        first = to_device([meta.cu_seqlens[b] for b in seqs], torch.int64, device)
        packed = torch.cumsum(count, 0) - count  # each sequence's first row among the selected rows
        local = torch.arange(tokens, device=device)
        src = local + torch.repeat_interleave(first - packed, count, output_size=tokens)
        dst = local + torch.repeat_interleave(torch.arange(len(seqs), device=device) * longest - packed, count,
                                              output_size=tokens)
        cached = meta.derived["padded_rows"] = (seqs, src, dst, longest)
    return cached[1:]


def padded_sdpa(q, k, v, meta: AttentionMetadata, scale, seqs: list[int] | None = None):
    """Causal SDPA over whole sequences in one call (all of the batch's, or those in `seqs`; their rows'
    outputs, in the order of padded_rows' src): each sequence right-padded with zeros to the longest. A
    query at position p sees keys 0..p, all its own, so the padding changes no valid row and no mask is
    needed (the flash kernels stay eligible); the padded rows are dropped. index_copy and index_select
    move the rows both ways (their backward is the other one: no sort, no loop)."""
    seqs = list(range(meta.num_seqs)) if seqs is None else seqs
    src, dst, longest = padded_rows(meta, seqs, q.device)
    every_row = src.shape[0] == q.shape[0]

    def padded(t):
        rows = t if every_row else t.index_select(0, src)
        out = t.new_zeros(len(seqs) * longest, *t.shape[1:]).index_copy(0, dst, rows)
        return out.view(len(seqs), longest, *t.shape[1:]).transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(q), padded(k).to(q.dtype), padded(v).to(q.dtype), is_causal=True,
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(len(seqs) * longest, *q.shape[1:]).index_select(0, dst)


def baseline(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale, window):
    """Fresh whole prompts in one padded SDPA call, a chunk over a cached prefix (or a window) by a
    masked SDPA call per sequence, single-token queries in one decode call."""
    if not window and meta.num_seqs > 1 and whole_sequences(meta):
        return padded_sdpa(q, k, v, meta, scale)
    out = torch.empty_like(q)
    fresh, decode = [], []
    for b in range(meta.num_seqs):
        s, e = meta.cu_seqlens[b], meta.cu_seqlens[b + 1]
        n, ctx = e - s, meta.context_lens[b]
        if n == 0:
            continue
        if n == 1 and ctx > 1:
            decode.append(b)
        elif n == ctx and not window:
            fresh.append(b)
        else:
            qb = q[s:e].transpose(0, 1)[None]
            kb = _gather_context(k_cache, meta, b, q.dtype).transpose(0, 1)[None].to(q.dtype)
            vb = _gather_context(v_cache, meta, b, q.dtype).transpose(0, 1)[None].to(q.dtype)
            mask = _key_mask(meta.positions[s:e], ctx, window)
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
            out[s:e] = o[0].transpose(0, 1)
    if fresh:
        out[padded_rows(meta, fresh, q.device)[0]] = padded_sdpa(q, k, v, meta, scale, fresh)
    if decode:
        rows = [meta.cu_seqlens[b] for b in decode]
        if q.is_cuda:
            out[rows] = _paged_decode(q[rows], k_cache, v_cache, meta.positions[rows], meta.query_seq[rows],
                                      meta.block_tables, max(meta.context_lens[b] for b in decode), scale, window)
        else:
            out[rows] = _decode(q, k_cache, v_cache, meta, decode, scale, window)
    return out


def _decode(q, k_cache, v_cache, meta, seqs, scale, window):
    """Single-token queries of several sequences in one padded batched matmul."""
    heads = q.shape[1]
    num_kv_heads = cache_shape(k_cache)[2]
    longest = max(meta.context_lens[b] for b in seqs)
    keys = q.new_zeros((len(seqs), longest, num_kv_heads, q.shape[2]))
    values = torch.zeros_like(keys)
    for i, b in enumerate(seqs):
        keys[i, :meta.context_lens[b]] = _gather_context(k_cache, meta, b, q.dtype)
        values[i, :meta.context_lens[b]] = _gather_context(v_cache, meta, b, q.dtype)
    keys = keys.repeat_interleave(heads // num_kv_heads, dim=2).transpose(1, 2)     # [S, H, L, D]
    values = values.repeat_interleave(heads // num_kv_heads, dim=2).transpose(1, 2)
    qs = q[[meta.cu_seqlens[b] for b in seqs]].unsqueeze(2)                          # [S, H, 1, D]
    scores = (qs @ keys.transpose(-1, -2)).float() * scale
    pos = meta.positions[[meta.cu_seqlens[b] for b in seqs]]
    valid = _key_mask(pos, longest, window)
    scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
    return (torch.softmax(scores, dim=-1).to(q.dtype) @ values).squeeze(2)


def baseline_decode(q, k_cache, v_cache, meta: AttentionMetadata, scale, window):
    """One query per sequence on CUDA (a decode step, captured or eager)."""
    return _paged_decode(q, k_cache, v_cache, meta.positions, meta.query_seq, meta.block_tables,
                         max(meta.context_lens), scale, window)


def _paged_decode(q, k_cache, v_cache, positions, query_seq, block_tables, max_context, scale, window,
                  kv_tile=BASELINE_KV_TILE):
    """Single-token queries on CUDA: the paged kernel as flash-decoding runs it, with the number of KV
    splits chosen from the batch (enough programs for two per SM), a shape-dependent choice."""
    from onepath.ops.cuda import sm_count
    from onepath.ops.cuda.attention import paged_attention
    programs = q.shape[0] * cache_shape(k_cache)[2]
    sms = sm_count(q.device)
    splits = max(1, min(-(-max_context // kv_tile), -(-2 * sms // programs)))
    # a power of two times the tile: the split size is a compile-time constant of the kernel
    kv_split = kv_tile << (-(-max_context // (splits * kv_tile)) - 1).bit_length()
    return paged_attention(q, k_cache, v_cache, positions, query_seq, block_tables, scale, window,
                           kv_tile, kv_split, split_kv=splits > 1, max_context=max_context)


def reference(q, k, v, meta: AttentionMetadata, scale, window):
    """Plain differentiable attention of each sequence over its own fresh K/V (training: no cached prefix):
    FP32 math on the CPU, SDPA (flash) in the model's dtype on the GPU."""
    if not whole_sequences(meta):
        raise RuntimeError("attention backward needs whole sequences in the batch (no cached prefix)")
    if q.is_cuda and not window:
        # the backward on the GPU: SDPA's flash kernels in the model's dtype (correct, not deterministic)
        return padded_sdpa(q, k, v, meta, scale)
    heads = q.shape[1]
    group = heads // k.shape[1]
    outs = []
    for b in range(meta.num_seqs):
        s, e = meta.cu_seqlens[b], meta.cu_seqlens[b + 1]
        qb = q[s:e].float().transpose(0, 1)
        kb = k[s:e].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[s:e].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qb @ kb.transpose(-1, -2)) * scale
        valid = _key_mask(meta.positions[s:e], e - s, window)
        scores = scores.masked_fill(~valid[None], -math.inf)
        outs.append((torch.softmax(scores, dim=-1) @ vb).transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


def attention(spec: ExecutionSpec, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
              sliding_window: int | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] for this step's tokens; caches: [blocks, block_size, Hkv, D]
    (FP8Tensors when the spec quantises the KV cache)."""
    o = spec.op("attention")
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping, o.kv)
    kernel = KERNELS[spec.mode, spec.device](o, k_cache, v_cache, meta, scale, sliding_window)
    return apply_kernel(kernel, lambda q, k, v: reference(q, k, v, meta, scale, sliding_window), q, k, v)


def cuda_consistent(o: OpSpec, k_cache, v_cache, meta: AttentionMetadata, scale, window):
    from onepath.ops.cuda.attention import paged_attention
    return lambda q, k, v: paged_attention(q, k_cache, v_cache, meta.positions, meta.query_seq, meta.block_tables,
                                           scale, window, o.kv_tile, o.kv_split, max_context=max(meta.context_lens),
                                           derived=meta.derived, block_m=o.q_rows)


def cpu_consistent(o: OpSpec, k_cache, v_cache, meta: AttentionMetadata, scale, window):
    return lambda q, k, v: consistent(q, k_cache, v_cache, meta, scale, window, o.kv_tile, o.row_chunk)


def cuda_baseline(o: OpSpec, k_cache, v_cache, meta: AttentionMetadata, scale, window):
    """A decode step (one query per sequence) in one paged launch, any other batch by `baseline`."""
    def kernel(q, k, v):
        if meta.num_seqs == q.shape[0]:
            return baseline_decode(q, k_cache, v_cache, meta, scale, window)
        return baseline(q, k, v, k_cache, v_cache, meta, scale, window)
    return kernel


def cpu_baseline(o: OpSpec, k_cache, v_cache, meta: AttentionMetadata, scale, window):
    return lambda q, k, v: baseline(q, k, v, k_cache, v_cache, meta, scale, window)


# (mode, device) -> kernel factory (op spec, caches, meta, scale, window) -> kernel(q, k, v)
KERNELS = {
    ("consistent", "cuda"): cuda_consistent,
    ("consistent", "cpu"): cpu_consistent,
    ("baseline", "cuda"): cuda_baseline,
    ("baseline", "cpu"): cpu_baseline,
}
