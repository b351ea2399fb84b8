"""Fixed-shape building blocks of the consistent CPU backend.

Every reduction here has an order that is a function of the row's own length and a fixed tile:
elementwise torch ops only (exact and position-free), trees of fixed width inside a tile,
tiles added in ascending order. Library kernels whose arithmetic can depend on the shape of the
launch (GEMM, transcendental functions with a SIMD body and a scalar tail) run on fixed-shape
pieces only, so a row's bits never depend on its neighbours, their number, or its position.
"""
from __future__ import annotations

from typing import Callable

import torch

# torch's CPU elementwise kernels run a SIMD body and a scalar tail, and split work across
# threads above 32768 elements; pieces of 16384 elements (a multiple of every SIMD width)
# keep every element in the SIMD body of a single-threaded launch.
PIECE = 16384


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """A fresh copy padded with zero rows: a fresh allocation is 64-byte aligned, and a CPU GEMM's
    bits can depend on its operand's alignment (seen: a 1-row GEMM at 24- vs 64-byte offsets)."""
    pad = (-x.shape[0]) % multiple
    return torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])


def row_chunks(fn: Callable[..., torch.Tensor], rows: int, *xs: torch.Tensor) -> torch.Tensor:
    """fn applied to fixed [rows, ...] chunks of the row-aligned inputs (the last chunk zero-padded)."""
    m = xs[0].shape[0]
    if m == 0:
        return fn(*(pad_rows(x, rows) for x in xs))[:0]
    padded = [pad_rows(x, rows) for x in xs]
    outs = [fn(*(x[i:i + rows] for x in padded)) for i in range(0, padded[0].shape[0], rows)]
    return torch.cat(outs)[:m]


def pinned_unary(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """An elementwise fn whose result for each element does not depend on where it sits in x.
    On CUDA every element runs the same scalar code whatever the launch (no SIMD tail), so fn runs once."""
    if x.is_cuda:
        return fn(x)
    flat = x.contiguous().reshape(-1)
    n = flat.numel()
    pad = (-n) % 64
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    out = torch.cat([fn(piece) for piece in flat.split(PIECE)]) if flat.numel() else fn(flat)
    return out[:n].reshape(x.shape)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as a fixed binary tree over its length rounded up to a power of two."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.cat([x, x.new_zeros((*x.shape[:-1], width - n))], dim=-1)
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def tiled_sum(x: torch.Tensor, tile: int, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` in tiles of absolute index [i*tile, (i+1)*tile), tree inside a tile, tiles in
    ascending order. Zeros appended past the end change nothing (x + 0 == x), so a row summed at
    length 40 or padded to 64 gives the same bits: this is what keeps prefill and decode equal."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    pad = (-n) % tile
    if pad:
        x = torch.cat([x, x.new_zeros((*x.shape[:-1], pad))], dim=-1)
    tiles = x.reshape(*x.shape[:-1], -1, tile)
    partial = tree_sum(tiles)
    acc = partial[..., 0]
    for i in range(1, partial.shape[-1]):
        acc = acc + partial[..., i]
    return acc
