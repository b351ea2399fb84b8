"""The exponential race of ops/sampling.py fused into one Triton pass over the probabilities.

token = argmax_i p_i / E_i, E_i = -log1p(-u_i), u_i from splitmix64(key + (i + 1) * golden), the same
integer noise as the torch version, so no [rows, vocab] temporaries are written (the torch version
makes a dozen int64 / float64 copies of that size per step). Each program walks a fixed span of
one row's vocabulary; a span's winner is its largest race value, ties to the larger index; the
spans' winners are then compared in ascending order with the same tie rule. The result is a
function of the row's probabilities and key alone: no row count or batch enters.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra import libdevice

from onepath.ops.sampling import GOLDEN, MIX1, MIX2, _signed

BLOCK = 1024
SPAN = 16 * BLOCK   # vocabulary entries per program
NUM_WARPS = 4


@triton.jit
def _shift(z, s: tl.constexpr):
    return z >> s   # z is uint64: a logical shift


@triton.jit
def _race_kernel(probs_ptr, keys_ptr, best_ptr, index_ptr, vocab, stride_row, num_spans,
                 golden, mix1, mix2, BLOCK: tl.constexpr, SPAN: tl.constexpr):
    row = tl.program_id(0)
    span = tl.program_id(1)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    g = golden.to(tl.uint64, bitcast=True)
    m1 = mix1.to(tl.uint64, bitcast=True)
    m2 = mix2.to(tl.uint64, bitcast=True)
    cols = tl.arange(0, BLOCK)
    best = tl.full([], -1.0, tl.float64)
    best_index = tl.full([], -1, tl.int64)
    for start in range(span * SPAN, tl.minimum((span + 1) * SPAN, vocab), BLOCK):
        i = start + cols
        ok = i < vocab
        p = tl.load(probs_ptr + row.to(tl.int64) * stride_row + i, mask=ok, other=0.0).to(tl.float64)
        z = (i + 1).to(tl.uint64) * g + key
        z = (z ^ _shift(z, 30)) * m1
        z = (z ^ _shift(z, 27)) * m2
        z = z ^ _shift(z, 31)
        u = _shift(z, 11).to(tl.float64) * 1.1102230246251565e-16   # 2 ** -53
        race = tl.where(ok, p / -libdevice.log1p(-u), -1.0)
        top = tl.max(race, 0)
        top_index = tl.max(tl.where(race == top, i, -1), 0).to(tl.int64)
        take = top >= best   # ascending chunks: ties go to the later (larger) index
        best = tl.where(take, top, best)
        best_index = tl.where(take, top_index, best_index)
    tl.store(best_ptr + row * num_spans + span, best)
    tl.store(index_ptr + row * num_spans + span, best_index)


def sample(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (FP32 or BF16, zeros outside the allowed set), keys [N] int64 -> token ids [N] int64."""
    rows, vocab = probs.shape
    probs = probs if probs.stride(-1) == 1 else probs.contiguous()
    num_spans = triton.cdiv(vocab, SPAN)
    best = torch.empty((rows, num_spans), dtype=torch.float64, device=probs.device)
    index = torch.empty((rows, num_spans), dtype=torch.int64, device=probs.device)
    if rows == 0:
        return index[:, 0] if num_spans else torch.empty(0, dtype=torch.int64, device=probs.device)
    _race_kernel[(rows, num_spans)](probs, keys.contiguous(), best, index, vocab, probs.stride(0), num_spans,
                                    _signed(GOLDEN), _signed(MIX1), _signed(MIX2),
                                    BLOCK=BLOCK, SPAN=SPAN, num_warps=NUM_WARPS)
    # the spans' winners in ascending order, ties to the larger span (hence the larger index)
    last = num_spans - 1 - torch.argmax(best.flip(-1), dim=-1)
    return index.gather(-1, last[:, None])[:, 0]
