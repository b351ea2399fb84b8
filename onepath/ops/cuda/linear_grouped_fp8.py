"""linear_grouped_fp8: block-FP8 W8A8 y[rows of group g] = a[rows of g] W[g]^T in one launch; the MoE experts.

Operands are linear_fp8.py's, one weight per group: activation codes [M, K] float8_e4m3fn with FP32 scales
per row and 128-wide K group [M, ceil(K/128)] (ops/cuda/quant.quantize_fp8, either scale layout); weight
codes [G, N, K] with FP32 scales per 128x128 block [G, ceil(N/128), ceil(K/128)]. Rows are packed by group
(groups may be empty): the trainer's contiguous layout, and the engine's masked layout, which is the same
packing with each group's rows rounded up to whole chunks (models/moe.py): one kernel, one row map.

The contract: every output row has the bits linear_fp8.py's Triton kernel gives that row alone against
W[g], so a token's expert output depends neither on the layout nor on the other tokens. What keeps it:
the dense kernel's chain per output element, unchanged: K blocks kb of BLOCK_K = 128 = the scale group in
ascending order, partial = tl.dot(a_kb, w_kb^T) fresh in FP32, acc = fma(partial, sa[m, kb] *
sw[g, n // 128, kb], acc), one rounding to out_dtype; the K tail zero-filled (masked loads, or TMA's
out-of-bounds zeros); no split-K, no atomics; the tiles are the dense kernel's (TILES_FP8), whose chain
is the same in every one. A tile never stores past its group: its rows past the group's end and its
columns past N (the next group's weight rows, under TMA) are computed and dropped, which cannot move a
stored element, whose products use its own row and column only.

Two kernels keep that chain: this file's Triton kernel and linear_grouped_fp8_ws.py's, linear_fp8_ws.py's
warp-specialized Gluon kernel over the groups' tiles (Hopper only). pick_grouped_kernel takes the Gluon one
where the rows fill its 128-row tiles (GROUPED_WS_MIN_ROWS_PER_GROUP rows a group on average) and TMA reads the
rows without a copy; the Triton tiles elsewhere (decode's few rows an expert, the interpreter). Neither can
move a row's bits (tests/ops/test_linear_grouped_fp8_gpu.py: torch.equal between them).

The group sizes are read as linear_grouped.py reads them: once per program, a list uploaded or the MoE
dispatch's tensor read in place (no host sync), the group, first row and end row of an M tile found from
their prefix sums. With tensor sizes the tile config and the grid follow M and G only, never the sizes:
a CUDA graph holds the launch and replays it under other sizes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.numerics.quant import FP8Tensor
from onepath.ops.cuda import interpreting, sm_count
from onepath.ops.cuda.linear import TileConfig, tma_ok
from onepath.ops.cuda.linear_fp8 import BLOCK_K, TILES_FP8, WS_CONFIG, is_hopper
from onepath.ops.cuda.linear_fp8_ws import OUT_DTYPES, TMA_ALIGN, WSConfig
from onepath.ops.cuda.linear_grouped import group_tables, group_tile, grouped_programs
from onepath.ops.cuda.linear_grouped_fp8_ws import linear_grouped_fp8_ws
from onepath.ops.host import to_device

# The warp-specialized kernel's grouped layout: the dense training layout (128x128, 5 stages, persistent, wait1),
# taken once the groups average GROUPED_WS_MIN_ROWS_PER_GROUP rows, enough to fill its 128-row M tiles; below
# (a decode step's ~16 rows an expert), the Triton kernel's 64-row tiles, faster there (the timings:
# docs/ops/linear.md, the warp-specialized grouped kernel). Both give the same bits.
GROUPED_WS_CONFIG = WS_CONFIG
GROUPED_WS_MIN_ROWS_PER_GROUP = 128
# False keeps the Triton kernel everywhere (a WSConfig passed as `config` still forces the warp-specialized one).
GROUPED_WS_BY_DEFAULT = True


def pick_grouped_fp8_config(counts: list[int], n: int, num_sms: int) -> TileConfig:
    """The largest of the dense kernel's tiles that gives every SM a tile over all groups' tiles; the
    smallest when none does. Integer arithmetic only (it runs at every MoE layer's launch)."""
    for c in TILES_FP8:
        if sum(-(-m // c.block_m) for m in counts) * -(-n // c.block_n) >= num_sms:
            return c
    return TILES_FP8[-1]


def pick_grouped_kernel(m: int, groups: int, k: int, out_dtype: torch.dtype, device: torch.device) -> WSConfig | None:
    """GROUPED_WS_CONFIG where the warp-specialized kernel runs without a copy (on Hopper, not interpreted, the
    codes' rows 16-byte multiples) and the rows average GROUPED_WS_MIN_ROWS_PER_GROUP a group; else None (the
    Triton kernel); None everywhere with GROUPED_WS_BY_DEFAULT off. M and G only, never the sizes: a CUDA
    graph's launch stays valid under any routing."""
    if (GROUPED_WS_BY_DEFAULT and k % TMA_ALIGN == 0 and out_dtype in OUT_DTYPES
            and m >= GROUPED_WS_MIN_ROWS_PER_GROUP * groups and not interpreting() and is_hopper(device)):
        return GROUPED_WS_CONFIG
    return None


@triton.jit(do_not_specialize=["NUM_PROGRAMS"])
def _linear_grouped_fp8_kernel(
    a_ptr, sa_ptr, w_ptr, sw_ptr, w_desc, out_ptr, counts_ptr,
    G, N, K, NUM_PROGRAMS,
    stride_am, stride_sam, stride_sak, stride_we, stride_wn, stride_swe, stride_swn,
    stride_om,
    W_TMA: tl.constexpr, W_BLOCK_N: tl.constexpr, G_PAD: tl.constexpr,
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
        w_group = w_ptr + group.to(tl.int64) * stride_we
        sw_blocks = sw_ptr + group.to(tl.int64) * stride_swe + (cols // W_BLOCK_N) * stride_swn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # linear_fp8.py's chain: ascending K blocks, a fresh dot each, promoted by one FMA in FP32
        for ki in range(k_tiles):
            k_left = K - ki * BLOCK_K
            # rows past the group's end are masked: no memory request for them
            a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + (ki * BLOCK_K + offs_k)[None, :],
                        mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            if W_TMA:
                # weight viewed [G * N, K]: columns past N read the next group's rows, never stored
                b = w_desc.load([group * N + pid_n * BLOCK_N, ki * BLOCK_K]).T
            else:
                b = tl.load(w_group + cols[None, :].to(tl.int64) * stride_wn + (ki * BLOCK_K + offs_k)[:, None],
                            mask=offs_k[:, None] < k_left, other=0.0)
            partial = tl.dot(a, b, out_dtype=tl.float32)
            sa = tl.load(sa_ptr + rows.to(tl.int64) * stride_sam + ki * stride_sak, mask=row_ok, other=1.0)
            sw = tl.load(sw_blocks + ki)
            acc = tl.fma(partial, sa[:, None] * sw[None, :], acc)

        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


def linear_grouped_fp8(qa: FP8Tensor, qw: FP8Tensor, counts: list[int] | torch.Tensor,
                       out_dtype: torch.dtype = torch.bfloat16, config: TileConfig | WSConfig | None = None,
                       programs: int | None = None) -> torch.Tensor:
    """qa: codes [M, K] with (1, 128) groups, its rows packed by group (counts[g] rows of group g, in
    order); qw: codes [G, N, K] with (r, 128) blocks, scales [G, ceil(N/r), ceil(K/128)] -> [M, N] in
    out_dtype, row r of group g = linear_fp8(qa[r], qw[g])'s bits. counts: a list, or an integer tensor
    on the codes' device, read there (no host sync: the caller vouches that they are >= 0 and sum to at
    most M; rows past them are left unwritten). `config` forces a kernel: a TileConfig the Triton kernel's tile
    (its `tma`: the weight's tiles by TMA), a WSConfig the warp-specialized one (Hopper); `programs` the number
    of programs (tests, benchmarks: none can move a row's bits). By default pick_grouped_kernel's."""
    a, w = qa.codes, qw.codes
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[2]:
        raise ValueError(f"linear_grouped_fp8: codes {tuple(a.shape)} and {tuple(w.shape)} do not match "
                         "(expected activations [M, K], weights [G, N, K])")
    groups, n, k = w.shape
    w_rows = -(-n // qw.block[0]) if qw.block[0] else 0
    if qa.block != (1, BLOCK_K) or qw.block[1] != BLOCK_K or qw.scales.shape != (groups, w_rows, -(-k // BLOCK_K)):
        raise ValueError(f"linear_grouped_fp8: scale blocks {qa.block} x {qw.block} (weight scales "
                         f"{tuple(qw.scales.shape)}) must be (1, {BLOCK_K}) x (r, {BLOCK_K}) with weight scales "
                         f"[G, ceil(N/r), ceil(K/{BLOCK_K})]: quantise each expert's [N, K] weight and stack them")
    on_device = isinstance(counts, torch.Tensor)
    if on_device and (counts.shape != (groups,) or counts.device != a.device or counts.dtype.is_floating_point):
        raise ValueError(f"linear_grouped_fp8: group sizes {counts.dtype} {tuple(counts.shape)} on {counts.device} "
                         f"must be integers [{groups}] on the codes' device {a.device}")
    if not on_device and (len(counts) != groups or sum(counts) != a.shape[0] or min(counts, default=0) < 0):
        raise ValueError(f"linear_grouped_fp8: group sizes (sum {sum(counts)}, {len(counts)} groups) do not pack "
                         f"the activations' {a.shape[0]} rows over the weights' {groups} groups")
    m = a.shape[0]
    out = torch.empty((m, n), device=a.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if max(a.numel(), n * k, groups * n) >= 2 ** 31:
        raise ValueError(f"linear_grouped_fp8: activations {tuple(a.shape)}, one group's weight [{n}, {k}] or the "
                         f"weights' {groups * n} rows reach 2^31 (32-bit offsets); split the rows or groups into "
                         "several calls")
    config = config or pick_grouped_kernel(m, groups, k, out_dtype, a.device)
    if isinstance(config, WSConfig):
        return linear_grouped_fp8_ws(qa, qw, counts, out, config, programs)
    a, w, sw = a.contiguous(), w.contiguous(), qw.scales.contiguous()
    sa = qa.scales.reshape(m, -1)  # either layout (by row, or quant_rows.scales_by_column's): read by its strides
    num_sms = sm_count(a.device)
    # device sizes are not read here: the config and the grid (speed only) assume groups of even size
    # and bound the M tiles (each group ends at most one partial tile)
    sizes = [-(-m // groups)] * groups if on_device else counts
    config = config or pick_grouped_fp8_config(sizes, n, num_sms)
    if on_device:
        m_tiles = -(-m // config.block_m) + min(groups, m)
    else:
        m_tiles = sum(-(-c // config.block_m) for c in counts)
        counts = to_device(counts, torch.int32, a.device)
    w_tma = config.tma and tma_ok(a, w)
    w_desc = None
    if w_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        w_desc = TensorDescriptor.from_tensor(w.view(groups * n, k), [config.block_n, BLOCK_K])
    programs = programs or grouped_programs(m_tiles, n, config, num_sms)
    _linear_grouped_fp8_kernel[(programs,)](
        a, sa, w, sw, w_desc, out, counts,
        groups, n, k, programs,
        a.stride(0), sa.stride(0), sa.stride(1), w.stride(0), w.stride(1), sw.stride(0), sw.stride(1),
        out.stride(0),
        W_TMA=w_tma, W_BLOCK_N=qw.block[0], G_PAD=triton.next_power_of_2(groups),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=BLOCK_K, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
