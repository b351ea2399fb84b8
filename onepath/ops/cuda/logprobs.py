"""Token log-probs, entropy and probabilities on Hopper: one program per row, batch-invariant.

The distribution is softmax(logits / temperature) restricted to `keep` (masked -> -inf). Each
program walks its row's vocabulary in fixed BLOCK_V chunks in ascending order:
  pass 1  m = max of kept logits / t (division is monotone, so the max of the raw logits is
          divided once: the same value as the max of the divided ones);
  pass 2  x = div_rn(logit, t), d = x - m, e = exp(d) (d = e = 0 where not kept): S = sum e, D = sum e*d,
          each accumulated elementwise into an FP32 vector, reduced once by tl.sum at the end;
  logprob = (x_tok - m) - log S, entropy = log S - div_rn(D, S)  (= -sum p log p, p = e / S);
  probs   = div_rn(e, S) in a third pass.
The order is a function of V alone: no atomics, no row count in the kernel, and one binary for
every launch of a (V, dtype): row strides unspecialised with an alignment hint (rmsnorm.aligned_rows
makes it true), the per-row scalars' pointers unspecialised on alignment (a view of tokens cannot
pick another binary, hence another reduction layout). keep=None reads an all-kept chunk through the
same loads as a real mask (row and chunk strides 0), so a row with no filter has the same bits
whether or not its batch carries masks for other rows.
FP32 logits are never materialised: BF16 logits are read twice (three times for probs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.ops.cuda.rmsnorm import aligned_rows, row_stride

# The vocabulary chunk of one step: it fixes the order of a row's sums.
BLOCK_V = 4096
NUM_WARPS = 8


@triton.jit
def _load_chunk(l_row, k_row, start, keep_chunk_stride, cols, V, BLOCK: tl.constexpr):
    """Raw logits (FP32, -inf outside the row or where not kept) and the kept flags of one chunk."""
    offs = start + cols
    in_row = offs < V
    k_ptrs = k_row + tl.multiple_of(start * keep_chunk_stride, BLOCK) + cols
    kept = (tl.load(k_ptrs, mask=in_row, other=0) != 0) & in_row
    raw = tl.load(l_row + offs, mask=kept, other=float("-inf")).to(tl.float32)
    return raw, kept


@triton.jit
def _row_stats(l_row, k_row, keep_chunk_stride, t, V, BLOCK: tl.constexpr):
    """(m, S, D) of one row by the fixed chunk order: max, sum of exp(x - m), sum of exp(x - m)(x - m)."""
    cols = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        raw, kept = _load_chunk(l_row, k_row, start, keep_chunk_stride, cols, V, BLOCK)
        top = tl.maximum(top, raw)
    m = tl.math.div_rn(tl.max(top, axis=0), t)

    s_acc = tl.zeros([BLOCK], tl.float32)
    d_acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        raw, kept = _load_chunk(l_row, k_row, start, keep_chunk_stride, cols, V, BLOCK)
        d = tl.where(kept, tl.math.div_rn(raw, t) - m, 0.0)
        e = tl.where(kept, tl.exp(d), 0.0)
        s_acc += e
        d_acc += e * d
    return m, tl.sum(s_acc, axis=0), tl.sum(d_acc, axis=0)


@triton.jit(do_not_specialize=["logits_stride", "keep_row_stride", "keep_chunk_stride"],
            do_not_specialize_on_alignment=["tokens_ptr", "temp_ptr", "lp_ptr", "ent_ptr"])
def _token_logprobs_kernel(logits_ptr, keep_ptr, tokens_ptr, temp_ptr, lp_ptr, ent_ptr, logits_stride,
                           keep_row_stride, keep_chunk_stride, V, VEC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    l_row = logits_ptr + tl.multiple_of(row * logits_stride, VEC)
    k_row = keep_ptr + tl.multiple_of(row * keep_row_stride, 16)
    t = tl.load(temp_ptr + row).to(tl.float32)
    m, s, dsum = _row_stats(l_row, k_row, keep_chunk_stride, t, V, BLOCK)
    log_s = tl.log(s)

    tok = tl.load(tokens_ptr + row).to(tl.int64)
    tok_kept = tl.load(k_row + (tok // BLOCK) * BLOCK * keep_chunk_stride + tok % BLOCK) != 0
    x_tok = tl.math.div_rn(tl.load(l_row + tok).to(tl.float32), t)
    lp = tl.where(tok_kept, (x_tok - m) - log_s, float("-inf"))
    tl.store(lp_ptr + row, lp)
    tl.store(ent_ptr + row, log_s - tl.math.div_rn(dsum, s))


@triton.jit(do_not_specialize=["logits_stride", "keep_row_stride", "keep_chunk_stride", "out_stride"],
            do_not_specialize_on_alignment=["temp_ptr"])
def _probs_kernel(logits_ptr, keep_ptr, temp_ptr, out_ptr, logits_stride, keep_row_stride, keep_chunk_stride,
                  out_stride, V, VEC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    l_row = logits_ptr + tl.multiple_of(row * logits_stride, VEC)
    k_row = keep_ptr + tl.multiple_of(row * keep_row_stride, 16)
    o_row = out_ptr + tl.multiple_of(row * out_stride, 4)
    t = tl.load(temp_ptr + row).to(tl.float32)
    m, s, _ = _row_stats(l_row, k_row, keep_chunk_stride, t, V, BLOCK)
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        raw, kept = _load_chunk(l_row, k_row, start, keep_chunk_stride, cols, V, BLOCK)
        e = tl.where(kept, tl.exp(tl.math.div_rn(raw, t) - m), 0.0)
        tl.store(o_row + start + cols, tl.math.div_rn(e, s), mask=start + cols < V)


def _prepare(logits, temperature, keep):
    """Logits rows, temperature, and keep as (bytes, row stride, chunk stride): a real mask, or one
    all-kept chunk read with strides 0 by the very same loads."""
    if logits.dim() != 2 or temperature.shape != logits.shape[:1]:
        raise ValueError(f"logprobs: logits {tuple(logits.shape)}, temperature {tuple(temperature.shape)} "
                         "(expected logits [N, V], temperature [N])")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"logprobs: logits dtype {logits.dtype} unsupported; use bfloat16, float16 or float32")
    logits = aligned_rows(logits)
    temperature = temperature.to(torch.float32).contiguous()
    if keep is None:
        kept = torch.ones(BLOCK_V, dtype=torch.uint8, device=logits.device)
        return logits, temperature, kept, 0, 0
    if keep.shape != logits.shape or keep.dtype != torch.bool:
        raise ValueError(f"logprobs: keep {tuple(keep.shape)} {keep.dtype} must be bool of the logits' shape "
                         f"{tuple(logits.shape)}")
    kept = aligned_rows(keep.view(torch.uint8))
    return logits, temperature, kept, row_stride(kept), 1


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor,
                   keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] (bf16/fp16/fp32), tokens [N], temperature [N] (> 0), keep [N, V] bool or None
    -> (logprob [N], entropy [N]) FP32. A token outside its row's keep gets -inf; tokens must lie
    in [0, V) (unchecked: checking would sync)."""
    logits, temperature, kept, keep_row, keep_chunk = _prepare(logits, temperature, keep)
    n, vocab = logits.shape
    if tokens.shape != (n,):
        raise ValueError(f"token_logprobs: tokens {tuple(tokens.shape)} for logits {tuple(logits.shape)}")
    lp = torch.empty(n, device=logits.device, dtype=torch.float32)
    entropy = torch.empty_like(lp)
    if n:
        _token_logprobs_kernel[(n,)](logits, kept, tokens.contiguous(), temperature, lp, entropy, row_stride(logits),
                                     keep_row, keep_chunk, vocab, VEC=16 // logits.element_size(), BLOCK=BLOCK_V,
                                     num_warps=NUM_WARPS)
    return lp, entropy


def probs(logits: torch.Tensor, temperature: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(logits / temperature) restricted to keep, [N, V] FP32, by token_logprobs' recipe."""
    logits, temperature, kept, keep_row, keep_chunk = _prepare(logits, temperature, keep)
    out = aligned_rows(torch.empty(logits.shape, device=logits.device, dtype=torch.float32))
    if out.numel():
        _probs_kernel[(logits.shape[0],)](logits, kept, temperature, out, row_stride(logits), keep_row, keep_chunk,
                                          row_stride(out), logits.shape[1], VEC=16 // logits.element_size(),
                                          BLOCK=BLOCK_V, num_warps=NUM_WARPS)
    return out
