"""linear_grouped_fp8_ws: ops/cuda/linear_grouped_fp8.py's grouped block-FP8 GEMM by linear_fp8_ws.py's
warp-specialized Gluon kernel (Hopper), with the Triton grouped kernel's bits.

The kernel is the dense one, its partitions and K chain unchanged (GROUPED switches the tile walk and the
epilogue only), so every output element has linear_fp8's chain: ascending 128-wide K blocks, a fresh FP32
wgmma partial each, acc = fma(partial, sa[m, kb] * sw[g, n // 128, kb], acc), one rounding. What changes:
  tile walk   the M tiles of every group (tile_map: group, first row, the group's first and end rows, from
              prefix sums on the device) times the N tiles, walked persistently in the dense kernel's grouped
              order; producer and consumers read the same map and the same count, so they walk the same tiles
              (every mbarrier wait has its arrive);
  alignment   TMA faults (an illegal instruction) where a box's innermost coordinate is not 16 bytes into the
              row: the A scales' box starts at [kb, first row] in FP32, so a tile's first row is a multiple of
              4 (SCALE_ROWS). A group starting elsewhere has its first tile start up to 3 rows early, in the
              previous group's rows (computed, never stored), and ceil((count + those rows) / BLOCK_M) tiles;
  operands    A by TMA at [first row, kb * 128] and its scales' box at [kb, first row] (rows outside the
              group: the neighbours' rows or TMA's zeros, computed and never stored); W viewed [G * N, K], the
              box at [g * N + pid_n * BLOCK_N, kb * 128] (columns past N: the next group's rows, never
              stored); sw from the group's [ceil(N / 128), K blocks] scales;
  epilogue    the tile is rounded into the staging tile as the TMA store's, read back in a coalesced layout
              and written by gl.store masked to the group's rows and to N: a TMA store would write the
              neighbours' rows. So rows past sum(counts) are never written.
The tile map is torch ops on the counts (no host sync; a list is uploaded first), so a CUDA graph holds the
whole launch and replays it under other counts; its size bounds the tiles from M and G only.
tests/ops/test_linear_grouped_fp8_ws.py builds it for sm_90 and checks the map on the CPU;
tests/ops/test_linear_grouped_fp8_gpu.py holds its rows to the Triton grouped kernel's with torch.equal.
"""
from __future__ import annotations

from itertools import accumulate

import torch
import triton

from onepath.numerics.quant import FP8Tensor
from onepath.ops.cuda import sm_count
from onepath.ops.cuda.linear_fp8_ws import (OUT_DTYPES, TMA_ALIGN, WSConfig, grouped_fp8_gemm_ws_kernel,
                                            config_consts, operand_descs)
from onepath.ops.host import to_device


SCALE_ROWS = TMA_ALIGN // 4  # a tile's first row is a multiple of this: the FP32 scales' box starts 16-byte aligned
ENTRY = 4  # ints a tile: group, first row, the group's first row, the group's end row


def max_m_tiles(m: int, groups: int, block_m: int) -> int:
    """A bound on the M tiles of any counts summing to at most m over `groups` groups. Only a non-empty group has
    tiles (at most min(groups, m) of them), ceil((count + s) / block_m) with s < SCALE_ROWS rows of alignment:
    summed, at most ceil((m + (SCALE_ROWS - 1) * nonempty) / block_m) + nonempty."""
    nonempty = min(groups, m)
    return -(-(m + (SCALE_ROWS - 1) * nonempty) // block_m) + nonempty


def _listed_tiles(counts: list[int], block_m: int) -> int:
    """tile_map's count of real tiles for counts on the host (no read back of the uploaded list)."""
    return sum(-(-(c + start % SCALE_ROWS) // block_m) for c, start in zip(counts, accumulate(counts, initial=0)) if c)


def tile_map(counts: list[int] | torch.Tensor, m: int, block_m: int, device=None) -> torch.Tensor:
    """The grouped kernel's M tiles, int32 [1 + ENTRY T] on the counts' device (a list: uploaded to `device`): the
    number of real tiles, then per tile t < T (group, first row, the group's first row, the group's end row).
    The groups' tiles are numbered group by group (an empty group has none); group g, its rows [start, end),
    begins its tiles at start rounded down to SCALE_ROWS (the scales' TMA box; the rows before start are
    computed, never stored) and has ceil((end - that row) / block_m) of them, block_m apart. T is max_m_tiles for
    device counts (their sum unknown on the host), the exact count for a list; entries from the count on are
    (-1, 0, 0, 0), never walked. Torch ops only: no host read of device counts, capturable in a CUDA graph."""
    on_device = isinstance(counts, torch.Tensor)
    sizes = counts.to(torch.int32) if on_device else to_device(counts, torch.int32, device)
    row_end = sizes.cumsum(0, dtype=torch.int32)
    start = row_end - sizes
    base = start - start % SCALE_ROWS
    tiles = torch.where(sizes > 0, (row_end - base + (block_m - 1)) // block_m, 0).to(torch.int32)
    tile_end = tiles.cumsum(0, dtype=torch.int32)
    t = max_m_tiles(m, len(counts), block_m) if on_device else _listed_tiles(counts, block_m)
    ids = torch.arange(t, dtype=torch.int32, device=sizes.device)
    group = torch.searchsorted(tile_end, ids, right=True, out_int32=True)  # groups whose tiles end at or before t
    real = group < sizes.shape[0]
    g = group.clamp(max=sizes.shape[0] - 1)
    first = base[g] + (ids - tile_end[g] + tiles[g]) * block_m
    entries = torch.stack([group, first, start[g], row_end[g]], 1).masked_fill_(~real[:, None], 0)
    entries[:, 0].masked_fill_(~real, -1)
    return torch.cat([tile_end[-1:], entries.flatten()])


def launch_args(qa: FP8Tensor, qw: FP8Tensor, tiles: torch.Tensor, out: torch.Tensor, config: WSConfig,
                programs: int | None = None):
    """(grid, positional arguments, constexpr keywords) of grouped_fp8_gemm_ws_kernel, grouped, for out[rows of g] =
    qa[rows of g] qw[g]^T over the tile map `tiles` (tile_map with config.block_m); out [M, N], any row stride.
    Persistent: #SMs programs; else one per tile of the map's bound (those past the real tiles walk none)."""
    config.check()
    if out.dtype not in OUT_DTYPES:
        raise ValueError(f"linear_grouped_fp8_ws: out dtype {out.dtype} is not one of {list(OUT_DTYPES)}: use the "
                         "Triton kernel (a TileConfig) or one of those")
    groups, n, k = qw.codes.shape
    m = qa.codes.shape[0]
    # W viewed [G * N, K]: group g's box at row g * N + pid_n * BLOCK_N
    a_desc, w_desc, sa_desc = operand_descs(qa.codes, qw.codes.reshape(groups * n, k), qa.scales.reshape(m, -1),
                                            config)
    sw = qw.scales.contiguous()
    bound = max(1, (tiles.shape[0] - 1) // ENTRY * triton.cdiv(n, config.block_n))
    programs = programs or (min(sm_count(qa.codes.device), bound) if config.persistent else bound)
    args = (a_desc, w_desc, sa_desc, out, tiles, sw, m, n, k, sw.stride(0), sw.stride(1), out.stride(0), programs)
    consts = config_consts(config, qw.block[0])
    return (programs,), args, consts


def linear_grouped_fp8_ws(qa: FP8Tensor, qw: FP8Tensor, counts: list[int] | torch.Tensor, out: torch.Tensor,
                          config: WSConfig, programs: int | None = None) -> torch.Tensor:
    """linear_grouped_fp8 by the warp-specialized kernel into out [M, N] (operands and counts as it checks them,
    M, N, K > 0); the rows of out from sum(counts) on are left as they were."""
    tiles = tile_map(counts, qa.codes.shape[0], config.block_m, qa.codes.device)
    grid, args, consts = launch_args(qa, qw, tiles, out, config, programs)
    grouped_fp8_gemm_ws_kernel[grid](*args, **consts, num_warps=4)
    return out
