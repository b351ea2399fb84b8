"""The fixed-order sums of ops/pinned.py inside a Triton program, so a kernel can follow the consistent CPU path's
arithmetic step for step.

`tree_sum` is pinned.tree_sum: the halving tree (element i plus element i + w / 2, then again on the first half)
over a last dim whose width is a power of two, written as explicit adds on halves (reshape, permute, split), not
tl.sum, whose tree is the layout's. Padding a row with zeros to a wider power of two changes no bit (its first
levels add exact zeros), so a kernel may pad where the CPU pads less. `pick` reads one index of a small dim
exactly (the others masked to zero), so a kernel can walk the streams in index order as mhc.stream_sum does.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tree_sum(x):
    """x [R, W] (W a power of two) -> [R]: pinned.tree_sum's halving tree over the last dim."""
    R: tl.constexpr = x.shape[0]
    W: tl.constexpr = x.shape[1]
    for level in tl.static_range(W.value.bit_length() - 1):
        lo, hi = tl.split(tl.permute(tl.reshape(x, [R, 2, W >> (level + 1)]), (0, 2, 1)))
        x = lo + hi
    return tl.reshape(x, [R])


@triton.jit
def pick(x, index, i, AXIS: tl.constexpr):
    """x's slice at index i along AXIS of a 2-D block (`index` the aranged indices of that axis): exact, the other
    entries add as zeros."""
    if AXIS == 0:
        return tl.sum(tl.where(index[:, None] == i, x, 0.0), axis=0)
    return tl.sum(tl.where(index[None, :] == i, x, 0.0), axis=1)


def pow2(n: int) -> int:
    """The tree's width for n entries: the next power of two (pinned.tree_sum's), at least 1."""
    return triton.next_power_of_2(max(n, 1))
