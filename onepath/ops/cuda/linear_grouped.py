"""linear_grouped: y[rows of group g] = x[rows of g] @ weight[g]^T in one launch; the MoE experts.

The contract: every output row has the bits ops/cuda/linear.py's dense kernel gives that row alone
against weight[g]. So a token's expert output depends neither on the layout (contiguous, masked) nor
on how many tokens its expert got. What keeps it: the dense kernel's K walk, unchanged:
- one program computes a whole output tile, walking K in ascending BLOCK_K = linear.BLOCK_K steps
  with one FP32 accumulator (`tl.dot(a, b, acc)`), the K tail zero-filled as there (masked pointer
  loads, or TMA's out-of-bounds zeros): no split-K, no atomics, no cross-program reduction;
- the tile config is one of GROUPED_TILES (the dense kernel's ladder before its deeper K steps, which
  this kernel's sweeps measured; fp32 inputs TILE_FP32): each output element's MMA chain over K is
  the same in every one and in each of the dense kernel's (tests/ops/test_linear_gpu.py);
- a tile never stores past its group: its rows past the group's end (the next group's rows, or zeros
  past M, under TMA) and its columns past N (the next group's weight rows) are computed and dropped,
  which cannot move a stored element, whose products use its own row and column only.

Rows are packed by group (groups may be empty). Each program reads the group sizes once (a list
uploaded, or the MoE dispatch's tensor read in place: no host sync, no tile-list kernels before the
launch) and finds the group, first row and end row of an M tile from their prefix sums: the groups'
M tiles are numbered group by group, and the tile space is those M tiles by the N tiles, walked by
`programs` programs with that stride, grouped along M (linear.tile_coords). Decode shapes (~16 rows
per expert, 128 experts) read every routed expert's weight once: an HBM stream, for which the weight
tiles come by TMA, x's 64-row tiles by masked pointer loads (x_by_tma), and no program visits an
empty tile. With tensor sizes the tile config and the grid follow M and G only, never the sizes: a
CUDA graph holds the launch and replays it under other sizes (the MoE decode steps).
lab/grouped_variants.py times the alternatives (tiles, pointer loads, x by TMA, one program per
tile, the tile-list kernel this one replaced) and checks their bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.ops.cuda import sm_count
from onepath.ops.cuda.linear import BLOCK_K, TILE_FP32, TileConfig, stages_output, tile_coords, tma_ok
from onepath.ops.host import to_device

# TMA weight tiles, 64-deep K steps (BLOCK_K): 128-row tiles once the largest group fills them, 64-row ones
# at decode (the variants timed: docs/ops/linear.md).
GROUPED_TILES = (
    TileConfig(128, 256, num_warps=8, num_stages=3, tma=True),
    TileConfig(128, 128, num_warps=4, num_stages=4, tma=True),
    TileConfig(64, 128, num_warps=4, num_stages=4, tma=True),
    TileConfig(64, 64, num_warps=4, num_stages=4, tma=True),
)


def pick_grouped_config(counts: list[int], n: int, dtype: torch.dtype, num_sms: int,
                        out_dtype: torch.dtype | None = None) -> TileConfig:
    """linear.first_filling's rule over all groups' tiles, on the dense kernel's tiles: the largest
    that gives every SM a tile, 128-row tiles only once the largest group fills them; the smallest
    when none does. Integer arithmetic only: it runs at every MoE layer's launch, where triton.cdiv's
    host cost adds up over 128 groups (docs/ops/linear.md)."""
    if dtype == torch.float32:
        return TILE_FP32
    configs = [c for c in GROUPED_TILES if stages_output(c, out_dtype)]
    largest = max(counts, default=0)
    for c in configs:
        tiles = sum(-(-m // c.block_m) for m in counts) * -(-n // c.block_n)
        if c.block_m <= max(64, largest) and tiles >= num_sms:
            return c
    return configs[-1]


def grouped_programs(m_tiles: int, n: int, config: TileConfig, num_sms: int) -> int:
    """The launch's program count: persistent, one program per SM, each walking tiles with stride #SMs
    (the dense kernel's walk), or fewer when there are fewer tiles. m_tiles bounds the M tiles."""
    return max(1, min(num_sms, m_tiles * -(-n // config.block_n)))


def x_by_tma(config: TileConfig) -> bool:
    """Whether x's tiles come by TMA (where the weight's do): with 128-row tiles, picked once the
    groups fill them. A 64-row tile (decode: a few rows of its group) loads by pointers, its rows
    past the group's end masked: by TMA they would be read too (the next groups' rows, in bounds),
    re-read from L2 for every N tile, up to half again the weights' traffic."""
    return config.block_m >= 128


@triton.jit
def group_tables(counts_ptr, G, BLOCK_M: tl.constexpr, G_PAD: tl.constexpr):
    """Per group (padded to G_PAD with empty groups): its first M tile, one past its last, its first
    row, one past its last; and the number of M tiles of all groups."""
    g = tl.arange(0, G_PAD)
    rows = tl.load(counts_ptr + g, mask=g < G, other=0).to(tl.int32)
    tiles = (rows + BLOCK_M - 1) // BLOCK_M
    tile_end, row_end = tl.cumsum(tiles, 0), tl.cumsum(rows, 0)
    return tile_end - tiles, tile_end, row_end - rows, row_end, tl.sum(tiles, 0)


@triton.jit
def m_tile(pid_m, tile_start, tile_end, row_start, row_end, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(group, first row, end row) of M tile pid_m: its group is the number of groups whose tiles
    end at or before it (an empty group ends where the one before it does: it is passed over)."""
    group = tl.sum((tile_end <= pid_m).to(tl.int32), 0)
    here = tl.arange(0, G_PAD) == group
    first = tl.sum(tl.where(here, row_start + (pid_m - tile_start) * BLOCK_M, 0), 0)
    return group, first, tl.sum(tl.where(here, row_end, 0), 0)


@triton.jit
def group_tile(tile_id, num_m_tiles, num_pid_n, tile_start, tile_end, row_start, row_end, N,
               G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Output tile tile_id: (group, its first row, pid_n, offs_m, offs_n, the rows inside the group, those rows
    and the columns clamped in range for the loads)."""
    pid_m, pid_n = tile_coords(tile_id, num_m_tiles, num_pid_n, GROUP_M)
    group, first, end = m_tile(pid_m, tile_start, tile_end, row_start, row_end, G_PAD, BLOCK_M)
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < end
    return group, first, pid_n, offs_m, offs_n, row_ok, tl.where(row_ok, offs_m, 0), tl.where(offs_n < N, offs_n, 0)


@triton.jit(do_not_specialize=["NUM_PROGRAMS"])
def _linear_grouped_kernel(
    x_ptr, w_ptr, x_desc, w_desc, out_ptr, counts_ptr,
    G, N, K, NUM_PROGRAMS,
    stride_xm, stride_we, stride_wn, stride_om,
    X_TMA: tl.constexpr, W_TMA: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    tile_start, tile_end, row_start, row_end, num_m_tiles = group_tables(counts_ptr, G, BLOCK_M, G_PAD)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)

    for tile_id in tl.range(tl.program_id(axis=0), num_m_tiles * num_pid_n, NUM_PROGRAMS, flatten=True):
        group, first, pid_n, offs_m, offs_n, row_ok, rows, cols = group_tile(
            tile_id, num_m_tiles, num_pid_n, tile_start, tile_end, row_start, row_end, N, G_PAD, BLOCK_M, BLOCK_N,
            GROUP_M)

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The dense kernel's walk: ascending BLOCK_K steps, one accumulator, the tail zero-filled.
        for ki in range(k_tiles):
            k_left = K - ki * BLOCK_K
            if X_TMA:
                # the tile's rows past the group's end are the next groups' (or zeros past M): never stored
                a = x_desc.load([first, ki * BLOCK_K])
            else:
                # rows past the group's end are masked: no memory request for them
                a = tl.load(x_ptr + rows[:, None] * stride_xm + (ki * BLOCK_K + offs_k)[None, :],
                            mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            if W_TMA:
                # weight viewed [G * N, K]: columns past N read the next group's rows, never stored
                b = w_desc.load([group * N + pid_n * BLOCK_N, ki * BLOCK_K]).T
            else:
                b = tl.load(w_ptr + group.to(tl.int64) * stride_we + cols[None, :] * stride_wn
                            + (ki * BLOCK_K + offs_k)[:, None], mask=offs_k[:, None] < k_left, other=0.0)
            acc = tl.dot(a, b, acc, input_precision="ieee")

        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


def linear_grouped(x: torch.Tensor, weight: torch.Tensor, counts: list[int] | torch.Tensor,
                   out_dtype: torch.dtype | None = None, config: TileConfig | None = None,
                   programs: int | None = None, x_tma: bool | None = None) -> torch.Tensor:
    """x [M, K], its rows packed by group (counts[g] rows of group g, in order), weight [G, N, K]:
    [M, N], row r of group g = x[r] @ weight[g]^T with FP32 accumulation, rounded once to out_dtype
    (default x.dtype). counts: a list, or an integer tensor on x's device, read there (no host sync:
    the caller vouches that they are >= 0 and sum to at most M; rows past them are left unwritten).
    `config` forces a tile config, `programs` the number of programs, `x_tma` whether x's tiles come
    by TMA (where the config's weight tiles do) (tests, benchmarks: none can move a row's bits)."""
    if x.dtype != weight.dtype:
        raise TypeError(f"linear_grouped: x is {x.dtype} but weight is {weight.dtype}; cast one so they match")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"linear_grouped: dtype {x.dtype} unsupported; use bfloat16, float16 or float32")
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"linear_grouped: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match "
                         "(expected x [M, K], weight [G, N, K])")
    on_device = isinstance(counts, torch.Tensor)
    if on_device and (counts.shape != (weight.shape[0],) or counts.device != x.device
                      or counts.dtype.is_floating_point):
        raise ValueError(f"linear_grouped: group sizes {counts.dtype} {tuple(counts.shape)} on {counts.device} must "
                         f"be integers [{weight.shape[0]}] on x's device {x.device}")
    if not on_device and (len(counts) != weight.shape[0] or sum(counts) != x.shape[0] or min(counts, default=0) < 0):
        raise ValueError(f"linear_grouped: group sizes (sum {sum(counts)}, {len(counts)} groups) do not pack "
                         f"x's {x.shape[0]} rows over weight's {weight.shape[0]} groups")
    groups, n, k = weight.shape
    x, weight = x.contiguous(), weight.contiguous()
    m = x.shape[0]
    out = torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if max(x.numel(), n * k, groups * n) >= 2 ** 31:
        raise ValueError(f"linear_grouped: x {tuple(x.shape)}, one group's weight [{n}, {k}] or the weights' "
                         f"{groups * n} rows reach 2^31 (32-bit offsets); split the rows or groups into several calls")
    num_sms = sm_count(x.device)
    # device sizes are not read here: the config and the grid (speed only) assume groups of even size
    # and bound the M tiles (each group ends at most one partial tile)
    sizes = [-(-m // groups)] * groups if on_device else counts
    config = config or pick_grouped_config(sizes, n, x.dtype, num_sms, out.dtype)
    if on_device:
        m_tiles = -(-m // config.block_m) + min(groups, m)
    else:
        m_tiles = sum(-(-c // config.block_m) for c in counts)
        counts = to_device(counts, torch.int32, x.device)
    w_tma = config.tma and tma_ok(x, weight)
    x_tma = w_tma and (x_tma if x_tma is not None else x_by_tma(config))
    x_desc = w_desc = None
    if w_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        w_desc = TensorDescriptor.from_tensor(weight.view(groups * n, k), [config.block_n, BLOCK_K])
        if x_tma:
            x_desc = TensorDescriptor.from_tensor(x, [config.block_m, BLOCK_K])
    programs = programs or grouped_programs(m_tiles, n, config, num_sms)
    _linear_grouped_kernel[(programs,)](
        x, weight, x_desc, w_desc, out, counts,
        groups, n, k, programs,
        x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        X_TMA=x_tma, W_TMA=w_tma, G_PAD=triton.next_power_of_2(groups),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=BLOCK_K, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
