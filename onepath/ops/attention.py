"""attention over a paged KV cache: prefill, chunked prefill, decode and the training forward.

The new K/V are written into the cache first (slot_mapping), then every query attends to its own
sequence's keys at absolute positions 0..pos through the block table.

consistent: one path for every phase. For a query at position p the scores over keys 0..p are
summed in KV tiles of absolute positions [i*kv_tile, (i+1)*kv_tile), ascending, tree inside a
tile; keys past p contribute exact zeros. A query's bits therefore depend neither on how many
queries share its launch nor on the phase nor on the batch. The softmax max is exact and global.
baseline: the stock fast path: SDPA on the fresh K/V for a pure prefill, SDPA with a mask for a
chunk over a cached prefix, a batched matmul decode path for single-token queries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
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

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def query_len(self, b: int) -> int:
        return self.cu_seqlens[b + 1] - self.cu_seqlens[b]


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k.detach().to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v.detach().to(v_cache.dtype)


def _key_mask(pos, length, window):
    j = torch.arange(length, device=pos.device)
    valid = j[None, :] <= pos[:, None]
    if window:
        valid &= j[None, :] > pos[:, None] - window
    return valid


def consistent(q, k_cache, v_cache, meta: AttentionMetadata, scale, window, kv_tile, rows):
    heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    head_to_kv = torch.arange(heads, device=q.device) // (heads // num_kv_heads)
    bs = meta.block_size
    keys_flat = k_cache.view(-1, num_kv_heads, head_dim)
    values_flat = v_cache.view(-1, num_kv_heads, head_dim)

    def chunk(qc, pos, seq):
        length = -(-(int(pos.max()) + 1) // kv_tile) * kv_tile
        valid = _key_mask(pos, length, window)
        j = torch.arange(length, device=q.device)
        blocks = meta.block_tables[seq][:, (j // bs).clamp(max=meta.block_tables.shape[1] - 1)]
        slots = torch.where(valid, blocks * bs + j % bs, 0)
        k = keys_flat[slots][:, :, head_to_kv].float()           # [R, L, H, D]
        v = values_flat[slots][:, :, head_to_kv].float()
        v = torch.where(valid[:, :, None, None], v, 0.0)
        s = tree_sum(qc.float()[:, None] * k) * scale            # [R, L, H]
        s = torch.where(valid[:, :, None], s, -math.inf)
        e = pinned_unary(torch.exp, s - s.amax(dim=1, keepdim=True))
        denom = tiled_sum(e, kv_tile, dim=1)                      # [R, H]
        num = tiled_sum(e[..., None] * v, kv_tile, dim=1)         # [R, H, D]
        return num / denom[..., None]

    return row_chunks(chunk, rows, q, meta.positions, meta.query_seq).to(q.dtype)


def _gather_context(cache, meta, b):
    bs = meta.block_size
    j = torch.arange(meta.context_lens[b], device=cache.device)
    slots = meta.block_tables[b][j // bs] * bs + j % bs
    return cache.view(-1, *cache.shape[2:])[slots]


def baseline(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale, window):
    out = torch.empty_like(q)
    decode = []
    for b in range(meta.num_seqs):
        s, e = meta.cu_seqlens[b], meta.cu_seqlens[b + 1]
        n, ctx = e - s, meta.context_lens[b]
        if n == 0:
            continue
        if n == 1 and ctx > 1:
            decode.append(b)
            continue
        qb = q[s:e].transpose(0, 1)[None]
        if n == ctx and not window:
            kb, vb = k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qb, kb.to(q.dtype), vb.to(q.dtype), is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            kb = _gather_context(k_cache, meta, b).transpose(0, 1)[None].to(q.dtype)
            vb = _gather_context(v_cache, meta, b).transpose(0, 1)[None].to(q.dtype)
            mask = _key_mask(meta.positions[s:e], ctx, window)
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)
    if decode:
        out[[meta.cu_seqlens[b] for b in decode]] = _decode(q, k_cache, v_cache, meta, decode, scale, window)
    return out


def _decode(q, k_cache, v_cache, meta, seqs, scale, window):
    """Single-token queries of several sequences in one padded batched matmul."""
    heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    longest = max(meta.context_lens[b] for b in seqs)
    keys = q.new_zeros((len(seqs), longest, num_kv_heads, q.shape[2]))
    values = torch.zeros_like(keys)
    for i, b in enumerate(seqs):
        keys[i, :meta.context_lens[b]] = _gather_context(k_cache, meta, b)
        values[i, :meta.context_lens[b]] = _gather_context(v_cache, meta, b)
    keys = keys.repeat_interleave(heads // num_kv_heads, dim=2).transpose(1, 2)     # [S, H, L, D]
    values = values.repeat_interleave(heads // num_kv_heads, dim=2).transpose(1, 2)
    qs = q[[meta.cu_seqlens[b] for b in seqs]].unsqueeze(2)                          # [S, H, 1, D]
    scores = (qs @ keys.transpose(-1, -2)).float() * scale
    pos = meta.positions[[meta.cu_seqlens[b] for b in seqs]]
    valid = _key_mask(pos, longest, window)
    scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
    return (torch.softmax(scores, dim=-1).to(q.dtype) @ values).squeeze(2)


def reference(q, k, v, meta: AttentionMetadata, scale, window):
    """Plain differentiable attention of each sequence over its own fresh K/V (training: no cached prefix)."""
    heads = q.shape[1]
    group = heads // k.shape[1]
    outs = []
    for b in range(meta.num_seqs):
        s, e = meta.cu_seqlens[b], meta.cu_seqlens[b + 1]
        if e - s != meta.context_lens[b]:
            raise RuntimeError("attention backward needs whole sequences in the batch (no cached prefix)")
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
    """q: [T, H, D]; k, v: [T, Hkv, D] for this step's tokens; caches: [blocks, block_size, Hkv, D]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    o = spec.op("attention")
    if spec.mode == "consistent" and spec.device == "cuda":
        from onepath.ops.cuda.attention import paged_attention
        kernel = lambda q, k, v: paged_attention(q, k_cache, v_cache, meta.positions, meta.query_seq, meta.block_tables,
                                                 scale, sliding_window, o.kv_tile, o.kv_split,
                                                 max_context=max(meta.context_lens))
    elif spec.mode == "consistent":
        kernel = lambda q, k, v: consistent(q, k_cache, v_cache, meta, scale, sliding_window, o.kv_tile, o.row_chunk)
    else:
        kernel = lambda q, k, v: baseline(q, k, v, k_cache, v_cache, meta, scale, sliding_window)
    return apply_kernel(kernel, lambda q, k, v: reference(q, k, v, meta, scale, sliding_window), q, k, v)
