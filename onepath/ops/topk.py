"""topk with a fixed tie rule: the larger position wins, indices emitted in descending key order.

consistent: each score becomes one 64-bit key, order-preserving float bits in the high half and
the position in the low half, so no two keys tie and the selection is a pure function of the row.
baseline: torch.topk (ties broken however the library does it). The same torch code on both devices
(KERNELS and SORTS by (mode, device)).
"""
from __future__ import annotations

import torch

from onepath.numerics.spec import ExecutionSpec


def order_key(x: torch.Tensor) -> torch.Tensor:
    # + 0.0 turns -0.0 into +0.0: equal values must tie, and ties go to the larger position
    bits = (x.float() + 0.0).contiguous().view(torch.int32).to(torch.int64)
    monotone = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    position = torch.arange(x.shape[-1], dtype=torch.int64, device=x.device)
    return (monotone << 32) | position


def key_position(key: torch.Tensor) -> torch.Tensor:
    return key & 0xFFFFFFFF


def topk(spec: ExecutionSpec, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not 1 <= k <= x.shape[-1]:
        raise ValueError(f"top-k k = {k} must be in [1, {x.shape[-1]}]")
    return KERNELS[spec.mode, spec.device](x, k)


def keyed_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    indices = key_position(torch.topk(order_key(x), k, dim=-1).values)
    return x.gather(-1, indices), indices


def library_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.topk(x, k, dim=-1)


def sort_descending(spec: ExecutionSpec, x: torch.Tensor) -> torch.Tensor:
    """Indices of x's last dim from largest to smallest, ties by the larger position first (consistent)."""
    return SORTS[spec.mode, spec.device](x)


def keyed_sort(x: torch.Tensor) -> torch.Tensor:
    return key_position(torch.sort(order_key(x), dim=-1, descending=True).values)


def library_sort(x: torch.Tensor) -> torch.Tensor:
    return torch.sort(x, dim=-1, descending=True).indices


# (mode, device) -> topk(x, k) -> (values, indices); SORTS: sort_descending(x) -> indices
KERNELS = {
    ("consistent", "cpu"): keyed_topk,
    ("consistent", "cuda"): keyed_topk,
    ("baseline", "cpu"): library_topk,
    ("baseline", "cuda"): library_topk,
}
SORTS = {
    ("consistent", "cpu"): keyed_sort,
    ("consistent", "cuda"): keyed_sort,
    ("baseline", "cpu"): library_sort,
    ("baseline", "cuda"): library_sort,
}
