"""The exponential race of ops/sampling.py in Triton: on given probabilities, or fused with the log-probs.

token = argmax_i p_i / E_i, E_i = -log1p(-u_i), u_i from splitmix64(key + (i + 1) * golden): the
torch version's integer noise and FP64 race, ties to the larger index, without its [rows, vocab]
temporaries. Each program walks a fixed SPAN of one row in BLOCK-wide blocks and keeps its span's
winner (largest race value, ties to the larger index); the spans' winners are then compared in
ascending order with the same rule. A max is exact, so the token is a function of the row's p and
key alone: no span size, row count or batch can move it.

The race costs arithmetic, not bytes: 64-bit integer noise, an FP64 log1p and an FP64 division per
entry. So a block is raced in FP64 only where it can matter. u >= u_lo (its top 23 bits) and
-log1p(-u) >= u + u^2/2 >= e_lo, so race_i <= p_i / e_lo_i: when every p_i < floor(best) * e_lo_i
(FP32, with margins of 2^-19 and 2^-20 over each rounding) no entry can reach the span's best so far,
and the block is skipped. The test takes p as e * fl(1/S), within 2^-22 of p = div_rn(e, S); the
exact p is divided out only in a raced block. A block whose e are all 0 is all ties at race 0 and
needs no noise. A span races its first block and then only the blocks that may hold a new best: about
one block in five (a CPU simulation at V = 151936, flat and peaked rows). The skip never moves the
winner (tests: against the torch race, with planted near-ties, and on the bound itself). What remains
per entry is the noise (about 30 integer instructions), e and the bound: the race is bound by the
SMs' instruction issue, not by HBM.

sample_with_logprobs is the engine's sampler: logprobs.row_stats (one read of the logits), the race
on p = div_rn(e, S) from logprobs.chunk_exp and those stats (the probs kernel's values bit for bit,
never written to HBM; a second read), then logprobs.finish picks the token and computes its log-prob
with the trainer's token_logprobs arithmetic. Four launches; no [N, V] tensor.

A greedy row skips the race: its spans keep the largest kept logit (as FP64, exact) and its index,
ties to the larger index, and finish merges the spans by the same rule. Its temperature row is 1, so
the log-prob finish computes is the untempered distribution's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra import libdevice

from onepath.ops.cuda import logprobs as LP
from onepath.ops.cuda.logprobs import chunk_exp, load_chunk, row_pointers
from onepath.ops.splitmix import GOLDEN, MIX1, MIX2, signed64

BLOCK = 1024        # the unit of the race-or-skip decision
SPAN = 16 * BLOCK   # vocabulary entries per program
NUM_WARPS = 4
_MIX = (signed64(GOLDEN), signed64(MIX1), signed64(MIX2))


@triton.jit
def _race_bound(z):
    """e_lo <= -log1p(-u) for u = (z >> 11) * 2^-53: u_lo = (z >> 41) * 2^-23 <= u, then u + u^2/2 and a
    2^-20 margin over the FP32 roundings."""
    u_lo = (z >> 41).to(tl.int32).to(tl.float32) * 1.1920928955078125e-07   # 2 ** -23
    return (u_lo + 0.5 * u_lo * u_lo) * 0.9999990463256836                       # 1 - 2 ** -20


@triton.jit
def _race_block(e, s, i, last, V, best, best_index, key, g, m1, m2):
    """(best, best_index) after the entries i race, p = div_rn(e, s) (FP32; s = 1: e are the probabilities;
    `last` the block's last index < V)."""
    if tl.max(e, axis=0) > 0:
        z = (i + 1).to(tl.uint64) * g + key   # uint64: >> is a logical shift
        z = (z ^ (z >> 30)) * m1
        z = (z ^ (z >> 27)) * m2
        z = z ^ (z >> 31)
        # p <= e * fl(1 / s) * (1 + 2^-22), so e * fl(1 / s) < floor * e_lo proves race < best (a NaN
        # product, inf * 0, proves nothing); below 1e-30 a denormal p could slip past the margin
        floor = tl.where(best > 1e-30, best * 0.9999980926513672, 0.0).to(tl.float32)   # 1 - 2 ** -19
        if tl.max(tl.where(e * tl.math.div_rn(1.0, s) < floor * _race_bound(z), 0, 1), axis=0) > 0:
            p = tl.math.div_rn(e, s)
            u = (z >> 11).to(tl.float64) * 1.1102230246251565e-16   # 2 ** -53
            race = tl.where(i < V, p.to(tl.float64) / -libdevice.log1p(-u), -1.0)
            top = tl.max(race, axis=0)
            take = top >= best   # ascending blocks: ties go to the later (larger) index
            best_index = tl.where(take, tl.max(tl.where(race == top, i, -1), axis=0).to(tl.int64), best_index)
            best = tl.where(take, top, best)
    elif best <= 0:   # every race value is 0: the block's last entry wins the tie
        best = tl.full([], 0.0, tl.float64)
        best_index = last.to(tl.int64)
    return best, best_index


@triton.jit
def _race_kernel(probs_ptr, keys_ptr, best_ptr, index_ptr, V, stride_row, golden, mix1, mix2,
                 BLOCK: tl.constexpr, SPAN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    span = tl.program_id(1)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    g, m1, m2 = golden.to(tl.uint64, bitcast=True), mix1.to(tl.uint64, bitcast=True), mix2.to(tl.uint64, bitcast=True)
    cols = tl.arange(0, BLOCK)
    best, best_index = tl.full([], -1.0, tl.float64), tl.full([], -1, tl.int64)
    for start in range(span * SPAN, tl.minimum((span + 1) * SPAN, V), BLOCK):
        i = start + cols
        p = tl.load(probs_ptr + row * stride_row + i, mask=i < V, other=0.0).to(tl.float32)
        best, best_index = _race_block(p, 1.0, i, tl.minimum(start + BLOCK, V) - 1, V, best, best_index,
                                       key, g, m1, m2)
    tl.store(best_ptr + row * tl.num_programs(1) + span, best)
    tl.store(index_ptr + row * tl.num_programs(1) + span, best_index)


@triton.jit
def _argmax_block(raw, i, best, best_index):
    """(best, best_index) after the raw logits of block i (-inf where not kept or past V): the largest,
    ties to the later block and within a block to the larger index."""
    top = tl.max(raw, axis=0).to(tl.float64)
    take = (top >= best) & (top > float("-inf"))
    best_index = tl.where(take, tl.max(tl.where(raw == top, i, -1), axis=0).to(tl.int64), best_index)
    return tl.where(take, top, best), best_index


@triton.jit(do_not_specialize=["logits_stride", "keep_row_stride", "keep_chunk_stride"],
            do_not_specialize_on_alignment=["temp_ptr", "greedy_ptr"])
def _sample_kernel(logits_ptr, keep_ptr, temp_ptr, stats_ptr, keys_ptr, greedy_ptr, best_ptr, index_ptr,
                   logits_stride, keep_row_stride, keep_chunk_stride, V, golden, mix1, mix2, VEC: tl.constexpr,
                   BLOCK: tl.constexpr, SPAN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    span = tl.program_id(1)
    l_row, k_row = row_pointers(logits_ptr, keep_ptr, row, logits_stride, keep_row_stride, VEC)
    cols = tl.arange(0, BLOCK)
    if tl.load(greedy_ptr + row) != 0:
        best, best_index = tl.full([], float("-inf"), tl.float64), tl.full([], -1, tl.int64)
        for start in range(span * SPAN, tl.minimum((span + 1) * SPAN, V), BLOCK):
            raw, _ = load_chunk(l_row, k_row, start, keep_chunk_stride, cols, V, BLOCK)
            best, best_index = _argmax_block(raw, start + cols, best, best_index)
    else:
        t = tl.load(temp_ptr + row).to(tl.float32)
        m, s = tl.load(stats_ptr + row * 3), tl.load(stats_ptr + row * 3 + 1)
        key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
        g = golden.to(tl.uint64, bitcast=True)
        m1, m2 = mix1.to(tl.uint64, bitcast=True), mix2.to(tl.uint64, bitcast=True)
        best, best_index = tl.full([], -1.0, tl.float64), tl.full([], -1, tl.int64)
        for start in range(span * SPAN, tl.minimum((span + 1) * SPAN, V), BLOCK):
            e = chunk_exp(l_row, k_row, start, keep_chunk_stride, cols, V, t, m, BLOCK)
            best, best_index = _race_block(e, s, start + cols, tl.minimum(start + BLOCK, V) - 1, V, best,
                                           best_index, key, g, m1, m2)
    tl.store(best_ptr + row * tl.num_programs(1) + span, best)
    tl.store(index_ptr + row * tl.num_programs(1) + span, best_index)


def _span_winners(rows: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    spans = triton.cdiv(vocab, SPAN)
    return (torch.empty((rows, spans), dtype=torch.float64, device=device),
            torch.empty((rows, spans), dtype=torch.int64, device=device))


def sample(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (FP32 or BF16, zeros outside the allowed set), keys [N] int64 -> token ids [N] int64."""
    rows, vocab = probs.shape
    probs = probs if probs.stride(-1) == 1 else probs.contiguous()
    best, index = _span_winners(rows, vocab, probs.device)
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=probs.device)
    _race_kernel[best.shape](probs, keys.contiguous(), best, index, vocab, probs.stride(0), *_MIX,
                             BLOCK=BLOCK, SPAN=SPAN, num_warps=NUM_WARPS)
    # the spans' winners in ascending order, ties to the larger span (hence the larger index)
    last = best.shape[1] - 1 - torch.argmax(best.flip(-1), dim=-1)
    return index.gather(-1, last[:, None])[:, 0]


def sample_with_logprobs(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                         keep: torch.Tensor | None = None,
                         greedy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V], temperature [N], keys [N] int64, keep [N, V] bool or None, greedy [N] bool or None ->
    (tokens [N] int64, logprobs [N] FP32): sample(probs(logits, temperature, keep), keys) (the argmax of the
    kept logits on greedy rows) and token_logprobs of those tokens, bit for bit, in one pass over the logits
    after the row stats."""
    rows = LP.prepare(logits, temperature, keep)
    stats = LP.row_stats(rows)
    n, vocab = rows.logits.shape
    best, index = _span_winners(n, vocab, logits.device)
    flags = (torch.zeros(n, dtype=torch.uint8, device=logits.device) if greedy is None
             else greedy.to(device=logits.device, dtype=torch.uint8).contiguous())
    if n:
        _sample_kernel[best.shape](*rows.args, stats, keys.contiguous(), flags, best, index, *rows.strides, vocab,
                                   *_MIX, VEC=rows.vec, BLOCK=BLOCK, SPAN=SPAN, num_warps=NUM_WARPS)
    tokens, lp, _ = LP.finish(rows, stats, race=(best, index))
    return tokens, lp
