"""grouped_matmul: y[rows of group g] = x[rows of g] @ weight[g]^T in one launch; the MoE experts.

The contract: every output row has the bits ops/cuda/matmul.py's dense kernel gives that row alone
against weight[g]. So a token's expert output depends neither on the layout (contiguous, masked) nor
on how many tokens its expert got. What keeps it: the dense kernel's K walk, unchanged:
- one program computes a whole output tile, walking K in ascending BLOCK_K = matmul.BLOCK_K steps
  with one FP32 accumulator (`tl.dot(a, b, acc)`), the K tail masked to zero as there: no split-K,
  no atomics, no cross-program reduction;
- the tile config (TILES_16BIT, FP32: TILE_FP32) is one the dense kernel may pick: each output
  element's MMA chain over K is the same in every one (tests/gpu/test_matmul.py);
- a tile never straddles two groups: rows past the group's end are masked and never stored.

Rows are packed by group (groups may be empty). The grid is persistent: min(#SMs, #tiles) programs
walk the (M-tile, N-tile) tiles with stride #SMs, grouped along M for L2 reuse of a weight tile. The
M-tiles of all groups are listed as the (group, first row, end row) of each, behind their number, in
one int32 tensor the kernel reads: from host group sizes (a list), or from group sizes on the device
(a tensor, as the MoE dispatch counts them), computed there without a host sync, padded to an upper
bound of the tile count. The same groups give the same tiles either way, so the same bits. With tensor
sizes, every shape, the tile config and the grid follow M and G only, never the sizes: a CUDA graph
holds the launch and replays it under other sizes (the MoE decode steps).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.ops.host import to_device
from onepath.ops.cuda.matmul import BLOCK_K, MAX_TILE_FP32_OUT, TILE_FP32, TILES_16BIT, TileConfig, _num_sms, \
    _tile_coords


def pick_grouped_config(counts: list[int], n: int, dtype: torch.dtype, num_sms: int,
                        out_dtype: torch.dtype | None = None) -> TileConfig:
    """matmul.first_filling's rule over all groups' tiles: the largest tile that gives every SM a
    tile, 128-row tiles only once the largest group fills them; the smallest when none does."""
    if dtype == torch.float32:
        return TILE_FP32
    wide_out = out_dtype == torch.float32
    configs = [c for c in TILES_16BIT if not (wide_out and c.block_m * c.block_n > MAX_TILE_FP32_OUT)]
    largest = max(counts, default=0)
    for c in configs:
        tiles = sum(triton.cdiv(m, c.block_m) for m in counts) * triton.cdiv(n, c.block_n)
        if c.block_m <= max(64, largest) and tiles >= num_sms:
            return c
    return configs[-1]


def m_tiles(counts: list[int], block_m: int) -> list[list[int]]:
    """[groups, first rows, end rows] of every M tile, group by group: none for an empty group."""
    groups, starts, ends = [], [], []
    start = 0
    for g, m in enumerate(counts):
        for first in range(start, start + m, block_m):
            groups.append(g)
            starts.append(first)
            ends.append(start + m)
        start += m
    return [groups, starts, ends]


def m_tiles_device(counts: torch.Tensor, block_m: int, max_tiles: int) -> torch.Tensor:
    """m_tiles of group sizes on the device, with no host sync: int32 [1 + 3 * max_tiles], the number of
    tiles, then max_tiles groups, first rows and end rows (entries past the number are never read)."""
    counts = counts.to(torch.int64)
    per_group = (counts + block_m - 1) // block_m
    tile_end, row_end = torch.cumsum(per_group, 0), torch.cumsum(counts, 0)
    i = torch.arange(max_tiles, device=counts.device)
    group = torch.searchsorted(tile_end, i, right=True).clamp_(max=counts.numel() - 1)
    first = (row_end - counts)[group] + (i - (tile_end - per_group)[group]) * block_m
    return torch.cat([tile_end[-1:], group, first, row_end[group]]).to(torch.int32)


@triton.jit(do_not_specialize=["max_m_tiles"])
def _grouped_matmul_kernel(
    x_ptr, w_ptr, out_ptr, tiles_ptr,
    max_m_tiles, N, K,
    stride_xm, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
):
    start_pid = tl.program_id(axis=0)
    num_m_tiles = tl.load(tiles_ptr)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m_tiles * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)

    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_m_tiles, num_pid_n, GROUP_M)
        group = tl.load(tiles_ptr + 1 + pid_m)
        first = tl.load(tiles_ptr + 1 + max_m_tiles + pid_m)
        end = tl.load(tiles_ptr + 1 + 2 * max_m_tiles + pid_m)
        offs_m = first + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows past the group's end are masked (no memory request), as the dense kernel's past M;
        # columns past N read column 0, never stored.
        row_ok = offs_m < end
        rows = tl.where(row_ok, offs_m, 0)
        cols = tl.where(offs_n < N, offs_n, 0)
        w_group = w_ptr + group.to(tl.int64) * stride_we

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The dense kernel's walk: ascending BLOCK_K steps, one accumulator, the tail zero-filled.
        for ki in range(k_tiles):
            k_left = K - ki * BLOCK_K
            a = tl.load(x_ptr + rows[:, None] * stride_xm + (ki * BLOCK_K + offs_k)[None, :],
                        mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(w_group + cols[None, :] * stride_wn + (ki * BLOCK_K + offs_k)[:, None],
                        mask=offs_k[:, None] < k_left, other=0.0)
            acc = tl.dot(a, b, acc, input_precision="ieee")

        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: list[int] | torch.Tensor,
                   out_dtype: torch.dtype | None = None, config: TileConfig | None = None) -> torch.Tensor:
    """x [M, K], its rows packed by group (counts[g] rows of group g, in order), weight [G, N, K]:
    [M, N], row r of group g = x[r] @ weight[g]^T with FP32 accumulation, rounded once to out_dtype
    (default x.dtype). counts: a list, or an integer tensor on x's device, read there (no host sync:
    the caller vouches that they are >= 0 and sum to at most M; rows past them are left unwritten).
    `config` forces a tile config (tests, benchmarks)."""
    if x.dtype != weight.dtype:
        raise TypeError(f"grouped_matmul: x is {x.dtype} but weight is {weight.dtype}; cast one so they match")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"grouped_matmul: dtype {x.dtype} unsupported; use bfloat16, float16 or float32")
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped_matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match "
                         "(expected x [M, K], weight [G, N, K])")
    on_device = isinstance(counts, torch.Tensor)
    if on_device and (counts.shape != (weight.shape[0],) or counts.device != x.device
                      or counts.dtype.is_floating_point):
        raise ValueError(f"grouped_matmul: group sizes {counts.dtype} {tuple(counts.shape)} on {counts.device} must "
                         f"be integers [{weight.shape[0]}] on x's device {x.device}")
    if not on_device and (len(counts) != weight.shape[0] or sum(counts) != x.shape[0] or min(counts, default=0) < 0):
        raise ValueError(f"grouped_matmul: group sizes (sum {sum(counts)}, {len(counts)} groups) do not pack "
                         f"x's {x.shape[0]} rows over weight's {weight.shape[0]} groups")
    _, n, k = weight.shape
    x, weight = x.contiguous(), weight.contiguous()
    m = x.shape[0]
    out = torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if x.numel() >= 2 ** 31 or n * k >= 2 ** 31:
        raise ValueError(f"grouped_matmul: x {tuple(x.shape)} or one group's weight [{n}, {k}] has >= 2^31 "
                         "elements (32-bit load offsets); split the rows into several calls")
    num_sms = _num_sms(x.device)
    groups = weight.shape[0]
    # device sizes are not read here: the config (speed only) assumes groups of even size
    sizes = [triton.cdiv(m, groups)] * groups if on_device else counts
    config = config or pick_grouped_config(sizes, n, x.dtype, num_sms, out.dtype)
    if on_device:
        max_m_tiles = triton.cdiv(m, config.block_m) + groups  # each group ends at most one partial tile
        tiles = m_tiles_device(counts, config.block_m, max_m_tiles)
    else:
        listed = m_tiles(counts, config.block_m)
        max_m_tiles = len(listed[0])
        tiles = to_device([max_m_tiles, *listed[0], *listed[1], *listed[2]], torch.int32, x.device)
    grid = (min(num_sms, max_m_tiles * triton.cdiv(n, config.block_n)),)
    _grouped_matmul_kernel[grid](
        x, weight, out, tiles,
        max_m_tiles, n, k,
        x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=BLOCK_K,
        GROUP_M=config.group_m, NUM_SMS=num_sms,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
