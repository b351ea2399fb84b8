"""linear: y = x W^T (+ b) on Hopper, batch-invariant and deterministic; every linear layer and the LM head.

The contract: a row's output bits depend only on that row, the weight and the bias; never on M, on
the other rows or on the row's position. What keeps it:
- one program computes a whole output tile, walking K in ascending BLOCK_K steps with one FP32
  accumulator (`tl.dot(a, b, acc)`): no split-K, no atomics, no cross-program reduction;
- each tl.dot is a chain of 16-deep MMA instructions into that accumulator, in ascending K, so an
  output element's sums are the same chain whatever the step: a 128- or 256-deep BLOCK_K issues the
  64-deep step's instructions, fewer times round the loop (the walk's dependent steps are what a
  skinny decode GEMM waits on), and the K tail's zeros add nothing;
- the tile config (rows, columns, K step, warps; wgmma or, for 16- and 32-row tiles, mma.sync; the operands
  swapped, SWAP_TILES, back on wgmma, at decode M) may follow M
  (small tiles fill the 132 SMs at decode, large ones reach the tensor-core peak at prefill) only
  because each output element's MMA chain over K is the same in every one; tests/ops/test_linear_gpu.py
  proves the candidates give equal bits, and a split-K sum does not;
- where M is not a multiple of the row tile, the last row tile is moved back to end at M: its first rows
  are computed by two programs, to the same bits, and stored twice (from one whole tile up, no TMA box
  reaches past M; below one the box runs past M, which costs: see DEEP_RING_M's comment);
- no autotuning: it picks by timing and could pick a different config on the other side;
- `input_precision="ieee"`: tl.dot would run fp32 inputs as TF32 otherwise;
- the bias is added in FP32 to the accumulator, then one rounding to out_dtype.

The kernel is the persistent matmul of the Triton tutorial: grid = min(#SMs, #tiles), each program
walks tiles with stride #SMs, grouped along M for L2 reuse. Loads are pointer loads, or TMA
descriptors with `TileConfig.tma` (same values, same dot; a config flag, so the bench can compare).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from onepath.ops.cuda import sm_count

# The K step of a config unless it says otherwise (the grouped kernel's only one).
BLOCK_K = 64
# Where M is at least a row tile but not a multiple of it, the last row tile ends at M (see tile_offsets):
# no TMA box or masked load reaches past M. Off: the last tile runs past M (the benchmark's comparison).
LAST_ROWS_BACK = True


@dataclass(frozen=True)
class TileConfig:
    """An output tile of block_m rows (tokens) x block_n columns (output features), walked over K in block_k
    steps. swap: the MMA takes the weight tile as its A operand and the tokens as its N (acc is [block_n,
    block_m], transposed once before the store), so a tile of few tokens still runs wgmma's m64 over 64 or more
    features, as cuBLAS's decode kernels do (docs/ops/linear.md)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False
    block_k: int = BLOCK_K
    swap: bool = False

    def tiles(self, m: int, n: int) -> int:
        return triton.cdiv(m, self.block_m) * triton.cdiv(n, self.block_n)

    def pipeline_bytes(self) -> int:
        """Shared memory of the 16-bit operand tiles in flight: every stage's x and weight tiles."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * 2


# 16-bit inputs, largest tile first. BLOCK_M stays >= 64 so every config runs Hopper's wgmma
# (an m64 instruction per warpgroup); 64-row and 32-column tiles fill the SMs at decode, where the
# weight read is the cost and the wasted MMA rows are free.
TILES_16BIT = (
    TileConfig(128, 256, num_warps=8, num_stages=3),
    TileConfig(128, 128, num_warps=8, num_stages=3),
    TileConfig(64, 128, num_warps=4, num_stages=4),
    TileConfig(64, 64, num_warps=4, num_stages=4),
    TileConfig(64, 32, num_warps=4, num_stages=5),
)
# The dense GEMM's ladder: TMA loads throughout; 128-row tiles (see dense_candidates), 64-row ones with deep K steps
# (the decode GEMM waits on its K walk). Chosen by CUDA-graph sweeps (docs/ops/linear.md); every config the same bits.
DENSE_TILES = (
    TileConfig(128, 256, num_warps=8, num_stages=3, tma=True),
    TileConfig(128, 128, num_warps=4, num_stages=4, tma=True),
    TileConfig(64, 128, num_warps=4, num_stages=4, tma=True, block_k=128),
    TileConfig(64, 64, num_warps=4, num_stages=6, tma=True, block_k=128),
    TileConfig(64, 32, num_warps=4, num_stages=4, tma=True, block_k=256),
)
# pick_config's model of a dense tile's time: the rounds of tiles the SMs run (the last one partly idle) times
# a tile's outputs over its speed per output, relative to 128x256; fitted to sweeps (docs/ops/linear.md).
DENSE_SPEED = {(128, 256): 1.0, (128, 128): 0.85, (64, 128): 0.8, (64, 64): 0.5, (64, 32): 0.3}
# A row tile whose TMA box of x reaches past M pays for the rows past M: from one tile up the last row tile ends at
# M (LAST_ROWS_BACK); below one, 128-row tiles are candidates once M fills three quarters of one. 128x128 tiles keep
# a fifth K step in flight up to DEEP_RING_M rows. Every depth gives the same bits (docs/ops/linear.md).
DEEP_RING_M = 1024
DEEP_RING_STAGES = 5
# Up to SMALL_M rows (decode of a few sequences) the weight stream is all the work: the tiles take the operands
# swapped (TileConfig.swap), 16 tokens by 128 or 64 weight rows, the weight rows as wgmma's M; at M = 17..32 a 32x128
# tile where it gives half the SMs a tile. Every tile gives the same bits (tests/ops/test_linear_gpu.py;
# the sweeps in docs/ops/linear.md).
SWAP_TILES = (
    TileConfig(16, 128, num_warps=4, num_stages=4, tma=True, block_k=128, swap=True),
    TileConfig(16, 64, num_warps=4, num_stages=4, tma=True, block_k=256, swap=True),
)
SKINNY_M = 16
SKINNY_TILES = SWAP_TILES
SMALL_M = 32
SMALL_TILES = (TileConfig(32, 128, num_warps=4, num_stages=4, tma=True, block_k=128), *SWAP_TILES)
# An fp32 output tile is staged through shared memory on its way out; 128x256 with its 3 pipeline
# stages would need 272 KiB, over the H200's 227 KiB per block (see the sm_90 compile test).
MAX_TILE_FP32_OUT = 128 * 128
# fp32 inputs run the FMA path (ieee): one config for every M, so nothing to prove.
TILE_FP32 = TileConfig(64, 64, num_warps=4, num_stages=2)


def stages_output(config: TileConfig, out_dtype: torch.dtype | None) -> bool:
    """Whether the config's output tile fits the shared memory it is staged through (MAX_TILE_FP32_OUT)."""
    return out_dtype != torch.float32 or config.block_m * config.block_n <= MAX_TILE_FP32_OUT


def dense_candidates(m: int, out_dtype: torch.dtype | None = None) -> list[TileConfig]:
    """The DENSE_TILES configs an M-row launch may take: 128-row tiles once M fills three quarters of one,
    128x128 ones with DEEP_RING_STAGES up to DEEP_RING_M rows (see the comment above DEEP_RING_M)."""
    tiles = []
    for c in DENSE_TILES:
        if c.block_m > 64 and 4 * m < 3 * c.block_m:
            continue
        if (c.block_m, c.block_n) == (128, 128) and m <= DEEP_RING_M:
            c = replace(c, num_stages=DEEP_RING_STAGES)
        if stages_output(c, out_dtype):
            tiles.append(c)
    return tiles


def pick_config(m: int, n: int, dtype: torch.dtype, num_sms: int, out_dtype: torch.dtype | None = None) -> TileConfig:
    """Up to SKINNY_M rows the first SKINNY_TILES config that gives half the SMs a tile, else its last; up to
    SMALL_M the same among SMALL_TILES; else the dense_candidates config of least modelled time (dense_pick)."""
    if dtype == torch.float32:
        return TILE_FP32
    half = max(1, num_sms // 2)
    if m <= SKINNY_M:
        return first_filling([c for c in SKINNY_TILES if stages_output(c, out_dtype)], m, n, half)
    if m <= SMALL_M:
        return first_filling([c for c in SMALL_TILES if stages_output(c, out_dtype)], m, n, half)
    return dense_pick(m, n, num_sms, out_dtype)


def dense_pick(m: int, n: int, num_sms: int, out_dtype: torch.dtype | None = None,
               candidates: list[TileConfig] | None = None) -> TileConfig:
    """The config of least modelled time among candidates (default dense_candidates): rounds of tiles on
    the SMs times a tile's outputs over its DENSE_SPEED (ties to the larger tile)."""
    def modelled(c: TileConfig) -> tuple[float, int]:
        rounds = -(-c.tiles(m, n) // num_sms)
        return rounds * c.block_m * c.block_n / DENSE_SPEED[c.block_m, c.block_n], -c.block_m * c.block_n

    return min(candidates or dense_candidates(m, out_dtype), key=modelled)


def first_filling(configs, m: int, n: int, num_sms: int) -> TileConfig:
    """The first (largest) config that gives every SM a tile, 128-row tiles only once M fills them;
    the last (smallest) when none does."""
    for config in configs:
        if config.block_m <= max(64, m) and config.tiles(m, n) >= num_sms:
            return config
    return configs[-1]


@triton.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def tile_offsets(tile_id, M, N, num_pid_m, num_pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  GROUP_M: tl.constexpr, EVEN_M: tl.constexpr, LAST_ROWS_BACK: tl.constexpr):
    """A tile's first row and column, its rows and columns, and the rows and columns to read.
    LAST_ROWS_BACK: where M is at least a tile but not a multiple of it, the last row tile starts at
    M - BLOCK_M instead of running past M, so every tile is whole. Its first rows are the previous tile's
    last ones, computed again to the same bits (a row's bits do not depend on its tile) and stored again."""
    pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
    row0 = pid_m * BLOCK_M
    if LAST_ROWS_BACK and not EVEN_M:
        row0 = tl.maximum(tl.minimum(row0, M - BLOCK_M), 0)
    col0 = pid_n * BLOCK_N
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    # Rows past M are masked (no memory request): reading row 0 in their place made every
    # program hammer one L2 line at decode. Columns past N read column 0; their results are never stored.
    rows = tl.where(offs_m < M, offs_m, 0)
    # EVEN_M (every tile full) drops the row mask: a row's values, so its bits, are the same either way.
    row_ok = (offs_m < M) | EVEN_M
    cols = tl.where(offs_n < N, offs_n, 0)
    return row0, col0, offs_m, offs_n, rows, row_ok, cols


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr, w_ptr, x_desc, w_desc, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, TMA: tl.constexpr, EVEN_M: tl.constexpr, LAST_ROWS_BACK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, SWAP: tl.constexpr,
):
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)

    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=True):
        row0, col0, offs_m, offs_n, rows, row_ok, cols = tile_offsets(
            tile_id, M, N, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M, EVEN_M, LAST_ROWS_BACK)

        # SWAP: the transposed tile, the weight rows as the MMA's M (see TileConfig.swap)
        acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        # One ascending walk over K per tile, one accumulator: the reduction order of a row.
        for ki in range(k_tiles):
            if TMA:
                a = x_desc.load([row0, ki * BLOCK_K])
                b = w_desc.load([col0, ki * BLOCK_K]).T
            else:
                k_left = K - ki * BLOCK_K
                a = tl.load(x_ptr + rows[:, None] * stride_xm + (ki * BLOCK_K + offs_k)[None, :],
                            mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
                b = tl.load(w_ptr + cols[None, :] * stride_wn + (ki * BLOCK_K + offs_k)[:, None],
                            mask=offs_k[:, None] < k_left, other=0.0)
            # ieee: fp32 inputs stay fp32 (the default would be TF32); 16-bit inputs ignore it.
            if SWAP:
                acc = tl.dot(b.T, a.T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc, input_precision="ieee")
        if SWAP:
            acc = acc.T

        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        # int64: M x N logits (e.g. 16k tokens x 152k vocab) pass 2^31 elements.
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def tma_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and row strides."""
    row_bytes = x.shape[1] * x.element_size()
    return row_bytes % 16 == 0 and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, config: TileConfig | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N]) with FP32 accumulation, rounded once to out_dtype
    (default x.dtype). `config` forces a tile config (tests and benchmarks); by default it follows
    M, which cannot move a row's bits."""
    if x.dtype != weight.dtype:
        raise TypeError(f"linear: x is {x.dtype} but weight is {weight.dtype}; cast one so they match")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"linear: dtype {x.dtype} unsupported; use bfloat16, float16 or float32")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match "
                         "(expected x [..., K], weight [N, K])")
    n, k = weight.shape
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"linear: bias {tuple(bias.shape)} does not match weight rows N={n}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    weight = weight.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    if k == 0:
        out.zero_()
        if bias is not None:
            out += bias
        return out.reshape(*lead, n)

    if max(x2.numel(), weight.numel()) >= 2 ** 31:
        raise ValueError(f"linear: x {tuple(x2.shape)} or weight {tuple(weight.shape)} has >= 2^31 elements "
                         "(32-bit load offsets); split the rows into several calls")
    num_sms = sm_count(x.device)
    config = config or pick_config(m, n, x.dtype, num_sms, out.dtype)
    tma = config.tma and tma_ok(x2, weight)
    x_desc = w_desc = None
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        x_desc = TensorDescriptor.from_tensor(x2, [config.block_m, config.block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
    launch(x2, weight, bias, out, m, config, x_desc, w_desc)
    return out.reshape(*lead, n)


def launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, m: int,
           config: TileConfig, x_desc=None, w_desc=None, last_rows_back: bool | None = None) -> None:
    """One launch of the kernel: out[:m] = x2[:m] weight^T (+ bias), TMA loads where descriptors are given.
    linear() calls it; bench/kernels_linear.py --past-m also launches over descriptors of other rows than m."""
    n, k = weight.shape
    num_sms = sm_count(x2.device)
    _linear_kernel[(min(num_sms, config.tiles(m, n)),)](
        x2, weight, x_desc, w_desc, bias.contiguous() if bias is not None else None, out,
        m, n, k,
        x2.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, TMA=x_desc is not None, EVEN_M=m % config.block_m == 0,
        LAST_ROWS_BACK=LAST_ROWS_BACK if last_rows_back is None else last_rows_back,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, NUM_SMS=num_sms, SWAP=config.swap,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
