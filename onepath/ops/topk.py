"""topk with a fixed tie rule: the larger position wins, indices emitted in descending key order.

consistent: each score becomes one 64-bit key, order-preserving float bits in the high half and
the position in the low half, so no two keys tie and the selection is a pure function of the row.
baseline: torch.topk (ties broken however the library does it). The same torch code on both devices
(KERNELS and SORTS by (mode, device)).

index_topk is the sparse-attention selection (DeepSeek-V4's lightning indexer): the k best valid entries
of a row by the same 64-bit key, the position being the entry's index within its request (never a batch
row), emitted sorted by descending position with -1 for the slots no valid entry fills, since that order
fixes the attention's accumulation order. baseline: torch.topk's indices in its own order (INDEX_KERNELS). On
consistent CUDA a radix select and a walk from the row's end in one Triton launch (ops/cuda/topk.py), the same
positions bit for bit.
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


INVALID_KEY = torch.iinfo(torch.int64).min  # below every valid entry's key


def index_topk(spec: ExecutionSpec, scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """scores [..., L] (an entry's index along the last dim is its position in the request), valid [..., L]
    -> [..., k] int64: the k best valid positions by (score, position), larger position first on a tie,
    sorted by descending position; -1 where fewer than k are valid."""
    if k < 1:
        raise ValueError(f"index_topk k = {k} must be >= 1 (the config's index_topk)")
    if scores.shape != valid.shape:
        raise ValueError(f"index_topk: scores {tuple(scores.shape)} and valid {tuple(valid.shape)} differ")
    picked = INDEX_KERNELS[spec.mode, spec.device](scores, valid, min(k, scores.shape[-1]))
    if picked.shape[-1] < k:
        picked = torch.cat([picked, picked.new_full((*picked.shape[:-1], k - picked.shape[-1]), -1)], dim=-1)
    return picked


def keyed_index_topk(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    keys = torch.where(valid, order_key(scores), INVALID_KEY)
    top = torch.topk(keys, k, dim=-1).values
    positions = torch.where(top == INVALID_KEY, -1, key_position(top))
    return torch.sort(positions, dim=-1, descending=True).values


def library_index_topk(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    picked = torch.topk(scores.masked_fill(~valid, float("-inf")), k, dim=-1).indices
    return torch.where(valid.gather(-1, picked), picked, -1)


# (mode, device) -> topk(x, k) -> (values, indices); SORTS: sort_descending(x) -> indices; INDEX_KERNELS:
# index_topk(scores, valid, k) -> positions
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
def cuda_index_topk(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    from onepath.ops.cuda.topk import index_topk as triton_index_topk
    return triton_index_topk(scores, valid, k)


INDEX_KERNELS = {
    ("consistent", "cpu"): keyed_index_topk,
    ("consistent", "cuda"): cuda_index_topk,
    ("baseline", "cpu"): library_index_topk,
    ("baseline", "cuda"): library_index_topk,
}
