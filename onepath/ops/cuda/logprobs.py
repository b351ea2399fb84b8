"""Token log-probs, entropy and probabilities on Hopper: each row's vocabulary split at fixed chunks.

The distribution is softmax(logits / temperature) restricted to `keep` (masked -> -inf). A row's
vocabulary is cut at the absolute multiples of BLOCK_V (like the attention's split-KV tiles), and
every step below runs on that cut:
  chunk stats  one program per (row, chunk), one read of the chunk: m_c = max of kept logits / t
               (division is monotone: the max of the raw logits, divided once), x = div_rn(logit, t),
               d = x - m_c, e = exp(d) (d = e = 0 where not kept), S_c = sum e, D_c = sum e*d;
  row stats    one program per row merges its chunks: m = max m_c, w_c = exp(m_c - m),
               S = sum w_c S_c, D = sum w_c (D_c + (m_c - m) S_c) (= sum e*(x - m) over the row);
  finish       logprob = (x_tok - m) - log S, entropy = log S - div_rn(D, S) (= -sum p log p);
  probs        p = div_rn(exp(x - m), S), one program per (row, chunk) (e = exp(x - m) by `chunk_exp`).
Many short programs per row (38 at V = 151936) fill the SMs at small M and keep each program's
chain short, and the log-probs read the logits once; the sampler (ops/cuda/sampling.py) races on p
computed in registers from `chunk_exp` and the same row stats, so probabilities never reach HBM.

The order of every sum is a function of V alone: fixed chunk boundaries, one tl.sum per chunk and
one per row at constexpr shapes, no atomics, no row count in a kernel, and one binary for every
launch of a (V, dtype): row strides unspecialised with an alignment hint (cuda.aligned_rows
makes it true), the per-row scalars' pointers unspecialised on alignment (a view of tokens cannot
pick another binary, hence another reduction layout). keep=None reads an all-kept chunk through the
same loads as a real mask (row and chunk strides 0), so a row with no filter has the same bits
whether or not its batch carries masks for other rows. The row-stats and finish kernels run with
`enable_fp_fusion=False`: every product rounds before its add, so the finish's two binaries (token
given, or picked from the sampler's race) compute a log-prob by the same IEEE steps, and the engine's
sampled log-prob is the trainer's token_logprobs bit for bit. FP32 logits are never materialised.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from onepath.ops.cuda import aligned_rows, row_stride

# The vocabulary chunk: it fixes the order of a row's sums, whatever M is.
BLOCK_V = 4096
NUM_WARPS = 8
ROW_WARPS = 1   # the per-row merge and finish: a few scalars each


@triton.jit
def row_pointers(logits_ptr, keep_ptr, row, logits_stride, keep_row_stride, VEC: tl.constexpr):
    return (logits_ptr + tl.multiple_of(row * logits_stride, VEC),
            keep_ptr + tl.multiple_of(row * keep_row_stride, 16))


@triton.jit
def load_chunk(l_row, k_row, start, keep_chunk_stride, cols, V, BLOCK: tl.constexpr):
    """Raw logits (FP32, -inf outside the row or where not kept) and the kept flags of one chunk. The
    logits are read whole (vector loads that need not wait for keep's), then masked."""
    offs = start + cols
    in_row = offs < V
    k_ptrs = k_row + tl.multiple_of(start * keep_chunk_stride, BLOCK) + cols
    kept = (tl.load(k_ptrs, mask=in_row, other=0) != 0) & in_row
    raw = tl.load(l_row + offs, mask=in_row, other=float("-inf")).to(tl.float32)
    return tl.where(kept, raw, float("-inf")), kept


@triton.jit
def _scaled(raw, t):
    """div_rn(logit, t). At t = 1 the division is exact, so it is skipped: the same bits, one division less."""
    if t == 1.0:
        x = raw
    else:
        x = tl.math.div_rn(raw, t)
    return x


@triton.jit
def chunk_exp(l_row, k_row, start, keep_chunk_stride, cols, V, t, m, BLOCK: tl.constexpr):
    """e = exp(x - m) of one chunk, 0 where not kept: the probabilities are div_rn(e, S)."""
    raw, kept = load_chunk(l_row, k_row, start, keep_chunk_stride, cols, V, BLOCK)
    return tl.where(kept, tl.exp(_scaled(raw, t) - m), 0.0)


@triton.jit(do_not_specialize=["logits_stride", "keep_row_stride", "keep_chunk_stride"],
            do_not_specialize_on_alignment=["temp_ptr"])
def _chunk_stats_kernel(logits_ptr, keep_ptr, temp_ptr, part_ptr, logits_stride, keep_row_stride, keep_chunk_stride,
                        V, VEC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunks = tl.cdiv(V, BLOCK)
    l_row, k_row = row_pointers(logits_ptr, keep_ptr, row, logits_stride, keep_row_stride, VEC)
    t = tl.load(temp_ptr + row).to(tl.float32)
    raw, kept = load_chunk(l_row, k_row, chunk * BLOCK, keep_chunk_stride, tl.arange(0, BLOCK), V, BLOCK)
    m = _scaled(tl.max(raw, axis=0), t)
    d = tl.where(kept, _scaled(raw, t) - m, 0.0)
    e = tl.where(kept, tl.exp(d), 0.0)
    out = part_ptr + row * 3 * chunks + chunk
    tl.store(out, m)
    tl.store(out + chunks, tl.sum(e, axis=0))
    tl.store(out + 2 * chunks, tl.sum(e * d, axis=0))


@triton.jit
def _row_stats_kernel(part_ptr, stats_ptr, V, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.cdiv(V, BLOCK)
    c = tl.arange(0, CHUNKS)
    ok = c < chunks
    part = part_ptr + row * 3 * chunks + c
    m_c = tl.load(part, mask=ok, other=float("-inf"))
    s_c = tl.load(part + chunks, mask=ok, other=0.0)
    d_c = tl.load(part + 2 * chunks, mask=ok, other=0.0)
    m = tl.max(m_c, axis=0)
    live = s_c > 0   # a chunk with no kept entry has m_c = -inf: (m_c - m) * 0 would be NaN
    w = tl.where(live, tl.exp(m_c - m), 0.0)
    tl.store(stats_ptr + row * 3, m)
    tl.store(stats_ptr + row * 3 + 1, tl.sum(w * s_c, axis=0))
    tl.store(stats_ptr + row * 3 + 2, tl.sum(tl.where(live, w * (d_c + (m_c - m) * s_c), 0.0), axis=0))


@triton.jit(do_not_specialize=["logits_stride", "keep_row_stride", "keep_chunk_stride"],
            do_not_specialize_on_alignment=["temp_ptr", "tokens_ptr", "lp_ptr", "ent_ptr"])
def _finish_kernel(logits_ptr, keep_ptr, temp_ptr, stats_ptr, tokens_ptr, best_ptr, index_ptr, lp_ptr, ent_ptr,
                   logits_stride, keep_row_stride, keep_chunk_stride, V, num_spans, VEC: tl.constexpr,
                   PICK: tl.constexpr, SPANS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    l_row, k_row = row_pointers(logits_ptr, keep_ptr, row, logits_stride, keep_row_stride, VEC)
    if PICK:   # the span winners (race values, or a greedy row's logits): the largest, ties to the later span
        s = tl.arange(0, SPANS)
        best = tl.load(best_ptr + row * num_spans + s, mask=s < num_spans, other=float("-inf"))
        last = tl.max(tl.where((best == tl.max(best, axis=0)) & (s < num_spans), s, -1), axis=0)
        tok = tl.load(index_ptr + row * num_spans + last)
        tl.store(tokens_ptr + row, tok)
    else:
        tok = tl.load(tokens_ptr + row).to(tl.int64)
    t = tl.load(temp_ptr + row).to(tl.float32)
    m, s, dsum = tl.load(stats_ptr + row * 3), tl.load(stats_ptr + row * 3 + 1), tl.load(stats_ptr + row * 3 + 2)
    log_s = tl.log(s)
    # a row without one finite probability (NaN logits) picks no token: -1, read nowhere
    tok_kept = tl.load(k_row + tok * keep_chunk_stride, mask=tok >= 0, other=0) != 0
    x_tok = _scaled(tl.load(l_row + tok, mask=tok >= 0, other=float("nan")).to(tl.float32), t)
    tl.store(lp_ptr + row, tl.where(tok_kept, (x_tok - m) - log_s, float("-inf")))
    tl.store(ent_ptr + row, log_s - tl.math.div_rn(dsum, s))


@triton.jit(do_not_specialize=["logits_stride", "keep_row_stride", "keep_chunk_stride", "out_stride"],
            do_not_specialize_on_alignment=["temp_ptr"])
def _probs_kernel(logits_ptr, keep_ptr, temp_ptr, stats_ptr, out_ptr, logits_stride, keep_row_stride,
                  keep_chunk_stride, out_stride, V, VEC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    l_row, k_row = row_pointers(logits_ptr, keep_ptr, row, logits_stride, keep_row_stride, VEC)
    t = tl.load(temp_ptr + row).to(tl.float32)
    m, s = tl.load(stats_ptr + row * 3), tl.load(stats_ptr + row * 3 + 1)
    cols = tl.arange(0, BLOCK)
    p = tl.math.div_rn(chunk_exp(l_row, k_row, start, keep_chunk_stride, cols, V, t, m, BLOCK), s)
    tl.store(out_ptr + tl.multiple_of(row * out_stride, 4) + start + cols, p, mask=start + cols < V)


@dataclass(frozen=True)
class Rows:
    """Logits [N, V] ready for the kernels: 16-byte aligned rows, FP32 temperature, and keep as bytes
    with (row stride, chunk stride): a real mask, or one all-kept chunk read with strides 0 by the very
    same loads. `args` and `strides` are the leading and the stride arguments of every kernel here."""
    logits: torch.Tensor
    temperature: torch.Tensor
    kept: torch.Tensor
    keep_row: int
    keep_chunk: int

    @property
    def args(self) -> tuple:
        return self.logits, self.kept, self.temperature

    @property
    def strides(self) -> tuple:
        return row_stride(self.logits), self.keep_row, self.keep_chunk

    @property
    def vec(self) -> int:
        return 16 // self.logits.element_size()


def prepare(logits: torch.Tensor, temperature: torch.Tensor, keep: torch.Tensor | None) -> Rows:
    if logits.dim() != 2 or temperature.shape != logits.shape[:1]:
        raise ValueError(f"logprobs: logits {tuple(logits.shape)}, temperature {tuple(temperature.shape)} "
                         "(expected logits [N, V], temperature [N])")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"logprobs: logits dtype {logits.dtype} unsupported; use bfloat16, float16 or float32")
    logits = aligned_rows(logits)
    temperature = temperature.to(torch.float32).contiguous()
    if keep is None:
        return Rows(logits, temperature, torch.ones(BLOCK_V, dtype=torch.uint8, device=logits.device), 0, 0)
    if keep.shape != logits.shape or keep.dtype != torch.bool:
        raise ValueError(f"logprobs: keep {tuple(keep.shape)} {keep.dtype} must be bool of the logits' shape "
                         f"{tuple(logits.shape)}")
    kept = aligned_rows(keep.view(torch.uint8))
    return Rows(logits, temperature, kept, row_stride(kept), 1)


def row_stats(rows: Rows, block: int | None = None) -> torch.Tensor:
    """(m, S, D) [N, 3] FP32 of each row (see the module docstring). `block` is the chunk: BLOCK_V; the
    tests pass others (at most BLOCK_V) to show that a chunk following M would move a row's bits."""
    block = block or BLOCK_V
    n, vocab = rows.logits.shape
    chunks = triton.cdiv(vocab, block)
    part = torch.empty(n, 3, chunks, device=rows.logits.device, dtype=torch.float32)
    stats = torch.empty(n, 3, device=rows.logits.device, dtype=torch.float32)
    if n:
        _chunk_stats_kernel[(n, chunks)](*rows.args, part, *rows.strides, vocab, VEC=rows.vec, BLOCK=block,
                                         num_warps=NUM_WARPS)
        _row_stats_kernel[(n,)](part, stats, vocab, BLOCK=block, CHUNKS=triton.next_power_of_2(chunks),
                                num_warps=ROW_WARPS, enable_fp_fusion=False)
    return stats


def finish(rows: Rows, stats: torch.Tensor, tokens: torch.Tensor | None = None,
           race: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [N] int64, logprob [N], entropy [N]) FP32 of the given tokens, or of the tokens the race's
    span winners (best [N, spans] FP64, index [N, spans] int64) pick."""
    n, vocab = rows.logits.shape
    device = rows.logits.device
    lp = torch.empty(n, device=device, dtype=torch.float32)
    entropy = torch.empty_like(lp)
    pick = race is not None
    best, index = race if pick else (lp, lp)   # without a race: placeholders, never read
    spans = best.shape[1] if pick else 1
    tokens = torch.empty(n, device=device, dtype=torch.int64) if pick else tokens.contiguous()
    if n:
        _finish_kernel[(n,)](*rows.args, stats, tokens, best, index, lp, entropy, *rows.strides, vocab, spans,
                             VEC=rows.vec, PICK=pick, SPANS=triton.next_power_of_2(spans), num_warps=ROW_WARPS,
                             enable_fp_fusion=False)
    return tokens, lp, entropy


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor,
                   keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] (bf16/fp16/fp32), tokens [N], temperature [N] (> 0), keep [N, V] bool or None
    -> (logprob [N], entropy [N]) FP32. A token outside its row's keep gets -inf; tokens must lie
    in [0, V) (unchecked: checking would sync)."""
    rows = prepare(logits, temperature, keep)
    if tokens.shape != logits.shape[:1]:
        raise ValueError(f"token_logprobs: tokens {tuple(tokens.shape)} for logits {tuple(logits.shape)}")
    _, lp, entropy = finish(rows, row_stats(rows), tokens=tokens)
    return lp, entropy


def probs(logits: torch.Tensor, temperature: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(logits / temperature) restricted to keep, [N, V] FP32, from token_logprobs' row stats."""
    rows = prepare(logits, temperature, keep)
    stats = row_stats(rows)
    out = aligned_rows(torch.empty(rows.logits.shape, device=logits.device, dtype=torch.float32))
    n, vocab = rows.logits.shape
    if out.numel():
        _probs_kernel[(n, triton.cdiv(vocab, BLOCK_V))](*rows.args, stats, out, *rows.strides, row_stride(out),
                                                        vocab, VEC=rows.vec, BLOCK=BLOCK_V, num_warps=NUM_WARPS)
    return out
