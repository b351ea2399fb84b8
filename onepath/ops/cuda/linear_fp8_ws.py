"""linear_fp8_ws: ops/cuda/linear_fp8.py's block-FP8 GEMM as a warp-specialized Gluon kernel for Hopper,
with the Triton kernel's bits.

The contract per output element is linear_fp8's: for K blocks kb = 0, 1, ... (128 wide, ascending) a
fresh FP32 wgmma partial of that block (four chained m64nNk32 steps, the first from zero), then
acc = fma(partial, sa[m, kb] * sw[n // 128, kb], acc), then one rounding of acc (+ bias in FP32) to
out_dtype. No split-K, no atomics, one program per output tile at a time: a row's bits depend on K
alone, never on M, the tile or the kernel, which is why linear_fp8 may pick this kernel or the Triton
one by M (tests/ops/test_linear_fp8_gpu.py: torch.equal between them).

Why warp specialization: Triton waits for every wgmma whose result feeds an FMA, so its tensor core
idles during each block's promotion. Here a CTA (128 rows x BLOCK_N, split "m") runs three partitions:
  producer      1 warp, 40 registers: TMA loads of the A [128, 128] and W [BLOCK_N, 128] tiles of each
                K block, and of the A rows' scales sa[:, kb] ([1, 128], sa stored by column), into a ring of
                NUM_STAGES shared-memory stages (ready/empty mbarriers)
  consumer 0/1  one warpgroup each, 232 registers, rows 0-63 / 64-127: wgmma over the block into a fresh
                partial, wait, release the stage, FMA-promote. Neither waits for the other, so one's
                promotion runs under the other's MMA while the producer keeps the ring full; the
                output goes out through shared memory by TMA stores.
The A scales come from the stage, not from global memory: a consumer warp's load of its rows' sa[m, kb] touched
eight sectors (rows K/128 floats apart), and those L1 wavefronts held the kernel back (docs/ops/linear.md: the
profile, the probes and the shipped config's timings).
Every config gives the Triton kernel's bits, with no spills (lab/fp8_gluon.py checks each).
Switches (WSConfig): BLOCK_N 128 or 256 (two n128 chains per block, promoted one after the other in one
register block: a 64x256 partial and its accumulator would need 256 registers a thread); WAIT1 (BLOCK_N
128): issue block kb's wgmma, `wgmma.wait_group 1`, promote kb-1 under it; persistent (#SMs programs
walking the tiles in grouped order) or one program per tile; pingpong (split "m", opt-in): the
consumers take turns at the tensor core, chain by chain, through a pair of turn mbarriers, so that one's
promotion runs under the other's chain rather than both chains running, then both promotions (the turn
passes once a chain is "issued" or "done"; each element's chain and order are unchanged). Rows past M,
columns past N and the ragged last K block are TMA's zero fill: the zero codes the Triton kernel's masked
loads give the MMA (and scale 0 for rows past M, whose outputs are never stored).
Split "n", for decode (M <= 256): the tile is 64 rows x BLOCK_N 64, 128 or 256, and the consumers split its
columns (consumer i: [i * BLOCK_N/2, (i+1) * BLOCK_N/2), one n32, n64 or n128 chain, a W row range inside
one 128-row scale block); half the rows of "m" doubles the tiles where M leaves the SMs empty, and the
smaller stage (A [64, 128] + W [BLOCK_N, 128]) lets the ring hold 8 (BLOCK_N 128) or 12 (BLOCK_N 64) blocks
of weights in flight. Same chain per element: the Triton 64x64 and 64x128 tiles already give equal bits
with n64 and n128 wgmma (lab/fp8_gluon.py --decode checks every variant against them).
tests/ops/test_linear_fp8_ws.py builds it for sm_90 without a GPU (Gluon is not interpreted).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from onepath.numerics.quant import FP8Tensor
from onepath.ops.cuda import sm90, sm_count
from onepath.ops.cuda.quant_rows import scale_column_stride, scales_by_column

BLOCK_K = 128  # one scale group: the partial a scale multiplies is one wgmma chain over 128 K values
WG_M = 64  # wgmma's rows: a consumer warpgroup's share of the tile's rows
MMA_N = 128  # split "m": one partial's wgmma is m64n128k32, the Triton kernel's 64x128 tile's instruction
TMA_ALIGN = 16  # bytes: TMA wants 16-byte aligned rows
LAUNCH_REGS = 168  # registers a thread at launch: 3 warpgroups x 128 threads x 168 = 64512 of the SM's 65536
EPI_BYTES = 256  # bytes of a row of the epilogue's staging tile: 128 bf16 or 64 fp32 columns
OUT_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


@gluon.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // num_pid_in_group) * GROUP_M
    group_size_m = gl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@gluon.jit
def _num_m_tiles(tiles_ptr, M, BM: gl.constexpr, GROUPED: gl.constexpr):
    """The M tiles the programs walk: ceil(M / BM), or (grouped) the tile map's count of its groups' tiles."""
    if GROUPED:
        num_pid_m = gl.load(tiles_ptr)
    else:
        num_pid_m = gl.cdiv(M, BM)
    return num_pid_m


@gluon.jit
def _tile(tile_id, num_pid_m, num_pid_n, tiles_ptr, M, BM: gl.constexpr, GROUP_M: gl.constexpr,
          GROUPED: gl.constexpr):
    """(group, first row, the rows it stores [begin, end), pid_n) of output tile tile_id. Grouped, M tile pid_m is
    the tile map's entry (linear_grouped_fp8_ws.tile_map: int32 count, then (group, first row, group's first row,
    group's end row) per tile); its rows outside the group are the neighbours', computed and never stored."""
    pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
    if GROUPED:
        entry = tiles_ptr + 1 + 4 * pid_m
        group = gl.load(entry)
        first = gl.load(entry + 1)
        begin = gl.load(entry + 2)
        end = gl.load(entry + 3)
    else:
        group = 0
        first = pid_m * BM
        begin = 0
        end = M
    return group, first, begin, end, pid_n


@gluon.jit
def _load_partition(a_desc, w_desc, sa_desc, a_bufs, w_bufs, sa_bufs, ready, empty, tiles_ptr, M, N, K,
                    NUM_PROGRAMS, GROUP_M: gl.constexpr, GROUPED: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    num_pid_m = _num_m_tiles(tiles_ptr, M, BM, GROUPED)
    num_pid_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    it = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
        group, first, _, _, pid_n = _tile(tile_id, num_pid_m, num_pid_n, tiles_ptr, M, BM, GROUP_M, GROUPED)
        # grouped: W viewed [G * N, K], the group's rows from group * N (columns past N: the next group's rows)
        w_row = group * N + pid_n * BN if GROUPED else pid_n * BN
        for kb in range(k_tiles):
            s = it % STAGES
            # a fresh mbarrier counts as having completed the phase before 0: the first lap does not wait
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + w_desc.block_type.nbytes
                            + sa_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [first, kb * BK], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [w_row, kb * BK], ready.index(s), w_bufs.index(s))
            # the A rows' scales of the block, a [1, BM] column of sa by column (rows past M: TMA's zeros); its
            # innermost coordinate `first` 16 bytes into the column (a multiple of 4 rows), or TMA faults
            tma.async_copy_global_to_shared(sa_desc, [kb, first], ready.index(s), sa_bufs.index(s))
            it += 1


@gluon.jit
def _scale(sa_bufs, it, A_PART: gl.constexpr, sw_ptr, off_n, N, kb, stride_swn, W_BLOCK_N: gl.constexpr,
           layout: gl.constexpr):
    """sa[m, kb] * sw[n // W_BLOCK_N, kb] for the consumer's 64 rows and the MMA_N columns from off_n, in FP32:
    the FMA's multiplier. sa is read from the it-th block's stage, so after its ready wait and before its
    release; sw (one address a warp) from global memory."""
    MMA_N: gl.constexpr = layout.instr_shape[1]
    WG_M: gl.constexpr = layout.warps_per_cta[0] * 16
    STAGES: gl.constexpr = sa_bufs.shape[0]
    BM: gl.constexpr = sa_bufs.shape[2]
    # the stage's [1, BM] box (unswizzled) read as the BM rows it holds
    rows = sa_bufs.index(it % STAGES)._reinterpret(gl.float32, [BM], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    sa = rows.slice(A_PART * WG_M, WG_M).load(gl.SliceLayout(1, layout))
    if W_BLOCK_N % MMA_N == 0:
        # the partial's columns share one weight block: one scalar gives every column the same sa * sw
        sw = gl.load(sw_ptr + (gl.minimum(off_n, N - 1) // W_BLOCK_N) * stride_swn + kb)
        return gl.expand_dims(sa * sw, 1)
    else:
        cols = off_n + gl.arange(0, MMA_N, layout=gl.SliceLayout(0, layout))
        sw = gl.load(sw_ptr + (gl.where(cols < N, cols, 0) // W_BLOCK_N) * stride_swn + kb)
        return gl.expand_dims(sa, 1) * gl.expand_dims(sw, 0)


@gluon.jit
def _promote(partial, scale, acc):
    scale, partial = gl.broadcast(scale, partial)
    return gl.fma(partial, scale, acc)


@gluon.jit
def _wait_ready(ready, it):
    """Wait until the it-th K block's stage is loaded."""
    STAGES: gl.constexpr = ready.shape[0]
    mbarrier.wait(ready.index(it % STAGES), (it // STAGES) & 1)


@gluon.jit
def _issue(a_bufs, w_bufs, ready, it, into, A_PART: gl.constexpr, PART: gl.constexpr, WAIT: gl.constexpr):
    """Wait for the stage of the it-th K block loaded (WAIT), issue its wgmma into a fresh partial (async):
    rows A_PART*64.. of A against the PART-th MMA_N columns of W, four chained k32 steps from zero
    (use_acc=False: `into` only names the registers, its values are not read)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    WG_M: gl.constexpr = into.shape[0]
    MMA_N: gl.constexpr = into.shape[1]
    s = it % STAGES
    if WAIT:  # a second part reads the stage the first waited for
        _wait_ready(ready, it)
    a = a_bufs.index(s).slice(A_PART * WG_M, WG_M)
    w = w_bufs.index(s).slice(PART * MMA_N, MMA_N)
    return warpgroup_mma(a, w.permute((1, 0)), into, use_acc=False, is_async=True)


@gluon.jit
def _chain(a_bufs, w_bufs, ready, it, into, A_PART: gl.constexpr, PART: gl.constexpr, WAIT: gl.constexpr, turn,
           chain, PASS_DONE: gl.constexpr):
    """_issue's partial, waited for. With a turn (pingpong, split "m"), this consumer's chain-th chain waits for
    its turn and passes it to the other consumer once issued, or once done (PASS_DONE). Strict alternation:
    consumer 0's chain c follows consumer 1's chain c-1 (its first passes: a fresh mbarrier counts as having
    completed the phase before 0), consumer 1's follows consumer 0's chain c; both run the same chains (same
    tiles, same K blocks), so every wait has its arrive and no arrive can run a phase ahead of its wait."""
    if turn is not None:
        mbarrier.wait(turn.index(A_PART), (chain + 1 - A_PART) & 1)
    partial = _issue(a_bufs, w_bufs, ready, it, into, A_PART, PART, WAIT)
    if turn is not None and not PASS_DONE:
        mbarrier.arrive(turn.index(1 - A_PART))
    partial = warpgroup_mma_wait(0, deps=[partial])
    if turn is not None and PASS_DONE:
        mbarrier.arrive(turn.index(1 - A_PART))
    return partial


@gluon.jit
def _issue_scaled(a_bufs, w_bufs, sa_bufs, ready, it, into, A_PART: gl.constexpr, PART: gl.constexpr, sw_ptr, off_n,
                  N, kb, stride_swn, W_BLOCK_N: gl.constexpr, layout: gl.constexpr, SCALE_AFTER: gl.constexpr):
    """wait1: the it-th K block's partial issued (as _issue) and its scale (_scale), once its stage is loaded.
    The scale is read before the issue (split "m": after it, its registers and a second partial in flight
    outgrow the consumer's 232 and ptxas spills), or after it (split "n", whose n64 partials leave room: at
    M = 1 each K block's chain then no longer waits for the scale's read; docs/ops/linear.md)."""
    _wait_ready(ready, it)
    if SCALE_AFTER:
        partial = _issue(a_bufs, w_bufs, ready, it, into, A_PART, PART, False)
        scale = _scale(sa_bufs, it, A_PART, sw_ptr, off_n, N, kb, stride_swn, W_BLOCK_N, layout)
    else:
        scale = _scale(sa_bufs, it, A_PART, sw_ptr, off_n, N, kb, stride_swn, W_BLOCK_N, layout)
        partial = _issue(a_bufs, w_bufs, ready, it, into, A_PART, PART, False)
    return partial, scale


@gluon.jit
def _pinned(x):
    """x, through an empty volatile asm: the compiler must finish x before any later wgmma (also volatile),
    not sink its FMAs below it, which would keep two partials live."""
    return gl.inline_asm_elementwise("", "=f,0", [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _release(empty, it):
    STAGES: gl.constexpr = empty.shape[0]
    mbarrier.arrive(empty.index(it % STAGES))


@gluon.jit
def _store(piece, c_smem, out_desc, out_ptr, stride_om, bias_ptr, row0, col0, row_begin, row_end, N,
           HAS_BIAS: gl.constexpr, GROUPED: gl.constexpr):
    """piece (+ bias in FP32), one rounding to the output dtype, stored at (row0, col0) through c_smem: by TMA
    (rows past M and columns past N are clipped), or (grouped) read back in a coalesced layout and stored by
    gl.store masked to the rows in [row_begin, row_end) and the columns before N (a TMA store would write the
    neighbouring groups' rows)."""
    if HAS_BIAS:
        cols = col0 + gl.arange(0, piece.shape[1], layout=gl.SliceLayout(0, piece.type.layout))
        piece += gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
    if GROUPED:
        c_smem.store(piece.to(c_smem.dtype))
        ROWS: gl.constexpr = c_smem.shape[0]
        COLS: gl.constexpr = c_smem.shape[1]
        VEC: gl.constexpr = 128 // c_smem.dtype.primitive_bitwidth  # 16 bytes a thread
        LANES_N: gl.constexpr = COLS // VEC
        layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // LANES_N, LANES_N], [4, 1], [1, 0])
        values = c_smem.load(layout)
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        offsets = gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims((rows >= row_begin) & (rows < row_end), 1) & gl.expand_dims(cols < N, 0)
        gl.store(out_ptr + offsets, values, mask=mask)
    else:
        tma.store_wait(0)  # the previous store out of c_smem has read it
        c_smem.store(piece.to(out_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [row0, col0], c_smem)


@gluon.jit
def _epilogue(acc, c_smem, out_desc, out_ptr, stride_om, bias_ptr, row0, off_n, row_begin, row_end, N,
              HAS_BIAS: gl.constexpr, GROUPED: gl.constexpr):
    EPI_N: gl.constexpr = c_smem.shape[1]
    if EPI_N == acc.shape[1]:
        _store(acc, c_smem, out_desc, out_ptr, stride_om, bias_ptr, row0, off_n, row_begin, row_end, N, HAS_BIAS,
               GROUPED)
    else:  # 4-byte outputs: two 64-column pieces, half the staging memory
        lo, hi = acc.reshape([acc.shape[0], 2, EPI_N]).permute(0, 2, 1).split()
        _store(lo, c_smem, out_desc, out_ptr, stride_om, bias_ptr, row0, off_n, row_begin, row_end, N, HAS_BIAS,
               GROUPED)
        _store(hi, c_smem, out_desc, out_ptr, stride_om, bias_ptr, row0, off_n + EPI_N, row_begin, row_end, N,
               HAS_BIAS, GROUPED)


@gluon.jit
def _mma_partition(a_bufs, w_bufs, sa_bufs, ready, empty, turn, c_smem, out_desc, out_ptr, stride_om, tiles_ptr,
                   sw_base, bias_ptr, M, N, K, stride_swe, stride_swn, NUM_PROGRAMS, WG: gl.constexpr,
                   W_BLOCK_N: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, WAIT1: gl.constexpr,
                   SPLIT_N: gl.constexpr, MMA_N: gl.constexpr, PINGPONG: gl.constexpr, PASS_DONE: gl.constexpr,
                   GROUPED: gl.constexpr):
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = w_bufs.type.shape[1]
    WG_M: gl.constexpr = 64
    # the consumer's share of the tile: rows WG*64.. (split "m") or columns WG*MMA_N.. (split "n")
    A_PART: gl.constexpr = 0 if SPLIT_N else WG
    W_PART: gl.constexpr = WG if SPLIT_N else 0
    TWO: gl.constexpr = BN == 2 * MMA_N and not SPLIT_N
    CHAINS: gl.constexpr = 2 if TWO else 1  # wgmma chains a K block
    if not PINGPONG:
        turn = None
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, MMA_N, 32])
    num_pid_m = _num_m_tiles(tiles_ptr, M, BM, GROUPED)
    num_pid_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    zero = gl.zeros((WG_M, MMA_N), gl.float32, layout)
    it = 0  # K blocks this program has consumed: the ring position, as the producer counts them
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
        group, first, row_begin, row_end, pid_n = _tile(tile_id, num_pid_m, num_pid_n, tiles_ptr, M, BM, GROUP_M,
                                                        GROUPED)
        row0 = first + A_PART * WG_M
        off_n = pid_n * BN + W_PART * MMA_N
        # the group's weight scales [ceil(N / W_BLOCK_N), K blocks]
        sw_ptr = sw_base + group * stride_swe if GROUPED else sw_base
        acc0 = gl.zeros((WG_M, MMA_N), gl.float32, layout)
        acc1 = gl.zeros((WG_M, MMA_N), gl.float32, layout)
        if WAIT1:
            # Two partials in fixed registers, even and odd K blocks: block kb's wgmma runs while kb-1 is
            # promoted (`wgmma.wait_group 1`). Unrolled by two so that no register copy of an in-flight
            # partial is needed (ptxas serializes every wgmma if one is read before its wait).
            p_e, scale_e = _issue_scaled(a_bufs, w_bufs, sa_bufs, ready, it, zero, A_PART, W_PART, sw_ptr, off_n, N, 0,
                                         stride_swn, W_BLOCK_N, layout, SPLIT_N)
            for kb in range(1, k_tiles - 1, 2):
                p_o, scale_o = _issue_scaled(a_bufs, w_bufs, sa_bufs, ready, it + 1, zero, A_PART, W_PART, sw_ptr,
                                             off_n, N, kb, stride_swn, W_BLOCK_N, layout, SPLIT_N)
                partial = warpgroup_mma_wait(1, deps=[p_e])
                _release(empty, it)
                acc0 = _promote(partial, scale_e, acc0)
                p_e, scale_e = _issue_scaled(a_bufs, w_bufs, sa_bufs, ready, it + 2, zero, A_PART, W_PART, sw_ptr,
                                             off_n, N, kb + 1, stride_swn, W_BLOCK_N, layout, SPLIT_N)
                partial = warpgroup_mma_wait(1, deps=[p_o])
                _release(empty, it + 1)
                acc0 = _promote(partial, scale_o, acc0)
                it += 2
            if k_tiles % 2 == 0:  # the last block is odd: issue it, then promote the last two
                p_o, scale_o = _issue_scaled(a_bufs, w_bufs, sa_bufs, ready, it + 1, zero, A_PART, W_PART, sw_ptr,
                                             off_n, N, k_tiles - 1, stride_swn, W_BLOCK_N, layout, SPLIT_N)
                partial = warpgroup_mma_wait(1, deps=[p_e])
                _release(empty, it)
                acc0 = _promote(partial, scale_e, acc0)
                partial = warpgroup_mma_wait(0, deps=[p_o])
                _release(empty, it + 1)
                acc0 = _promote(partial, scale_o, acc0)
                it += 2
            else:
                partial = warpgroup_mma_wait(0, deps=[p_e])
                _release(empty, it)
                acc0 = _promote(partial, scale_e, acc0)
                it += 1
        else:
            for kb in range(k_tiles):
                partial = _chain(a_bufs, w_bufs, ready, it, zero, A_PART, W_PART, True, turn, CHAINS * it, PASS_DONE)
                # (read from the stage before it is released)
                acc0 = _promote(partial, _scale(sa_bufs, it, A_PART, sw_ptr, off_n, N, kb, stride_swn, W_BLOCK_N,
                                                layout), acc0)
                if not TWO:
                    _release(empty, it)
                if TWO:
                    # the second half reuses the first's registers (a 64x256 partial and its accumulator
                    # would not fit): the first's FMAs pinned before it, its partial named as the target
                    acc0 = _pinned(acc0)
                    partial = _chain(a_bufs, w_bufs, ready, it, partial, A_PART, 1, False, turn, 2 * it + 1, PASS_DONE)
                    scale1 = _scale(sa_bufs, it, A_PART, sw_ptr, off_n + MMA_N, N, kb, stride_swn, W_BLOCK_N, layout)
                    _release(empty, it)
                    acc1 = _promote(partial, scale1, acc1)
                it += 1
        _epilogue(acc0, c_smem, out_desc, out_ptr, stride_om, bias_ptr, row0, off_n, row_begin, row_end, N, HAS_BIAS,
                  GROUPED)
        if TWO:
            _epilogue(acc1, c_smem, out_desc, out_ptr, stride_om, bias_ptr, row0, off_n + MMA_N, row_begin, row_end, N,
                      HAS_BIAS, GROUPED)
    if not GROUPED:
        tma.store_wait(0)


@gluon.jit
def _fp8_gemm_ws(a_desc, w_desc, sa_desc, out_desc, out_ptr, tiles_ptr, sw_ptr, bias_ptr, M, N, K, stride_swe,
                 stride_swn, stride_om, NUM_PROGRAMS, W_BLOCK_N: gl.constexpr, HAS_BIAS: gl.constexpr,
                 GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, WAIT1: gl.constexpr, SPLIT_N: gl.constexpr,
                 MMA_N: gl.constexpr, PINGPONG: gl.constexpr, PASS_DONE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                 PRODUCER_REGS: gl.constexpr, GROUPED: gl.constexpr):
    """The kernels' body. Dense: out_desc the output's TMA descriptor (out_ptr, tiles_ptr None). Grouped: out_ptr
    the output, stored by masked gl.store (out_desc None), tiles_ptr the tile map, w_desc over the weights viewed
    [G * N, K], sw_ptr the groups' weight scales stride_swe apart."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES] + w_desc.block_type.shape, w_desc.layout)
    sa_bufs = gl.allocate_shared_memory(sa_desc.dtype, [NUM_STAGES] + sa_desc.block_type.shape, sa_desc.layout)
    if GROUPED:  # the epilogue's staging tiles as the TMA store's (64 rows of EPI_BYTES), read back by the consumers
        OUT: gl.constexpr = out_ptr.dtype.element_ty
        EPI_N: gl.constexpr = min(MMA_N, 2048 // OUT.primitive_bitwidth)
        epi_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=OUT.primitive_bitwidth,
                                                        rank=2)
        c_smem0 = gl.allocate_shared_memory(OUT, [64, EPI_N], epi_layout)
        c_smem1 = gl.allocate_shared_memory(OUT, [64, EPI_N], epi_layout)
    else:
        c_smem0 = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
        c_smem1 = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrive per consumer warpgroup
    turn = ready  # (warp_specialize takes no None: the consumers drop it without PINGPONG)
    if PINGPONG:  # turn.index(i): consumer i may issue its next chain
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
    fence_async_shared()
    # (the constexpr switches are listed per partition: a tuple built here would turn them into tensors)
    gl.warp_specialize([
        (_mma_partition, (a_bufs, w_bufs, sa_bufs, ready, empty, turn, c_smem0, out_desc, out_ptr, stride_om,
                          tiles_ptr, sw_ptr, bias_ptr, M, N, K, stride_swe, stride_swn, NUM_PROGRAMS, 0, W_BLOCK_N,
                          HAS_BIAS, GROUP_M, WAIT1, SPLIT_N, MMA_N, PINGPONG, PASS_DONE, GROUPED)),
        (_mma_partition, (a_bufs, w_bufs, sa_bufs, ready, empty, turn, c_smem1, out_desc, out_ptr, stride_om,
                          tiles_ptr, sw_ptr, bias_ptr, M, N, K, stride_swe, stride_swn, NUM_PROGRAMS, 1, W_BLOCK_N,
                          HAS_BIAS, GROUP_M, WAIT1, SPLIT_N, MMA_N, PINGPONG, PASS_DONE, GROUPED)),
        (_load_partition, (a_desc, w_desc, sa_desc, a_bufs, w_bufs, sa_bufs, ready, empty, tiles_ptr, M, N, K,
                           NUM_PROGRAMS, GROUP_M, GROUPED)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# no integer specialization: nothing here gets faster for N or K multiples of 16 (TMA does the bounds),
# and one build per config, out dtype and bias keeps compile time down (no build per shape in training)
@gluon.jit(do_not_specialize=["M", "N", "K", "stride_swn", "NUM_PROGRAMS"])
def _fp8_gemm_ws_kernel(a_desc, w_desc, sa_desc, out_desc, sw_ptr, bias_ptr, M, N, K, stride_swn,
                        NUM_PROGRAMS, W_BLOCK_N: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
                        NUM_STAGES: gl.constexpr, WAIT1: gl.constexpr, SPLIT_N: gl.constexpr, MMA_N: gl.constexpr,
                        PINGPONG: gl.constexpr, PASS_DONE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr):
    _fp8_gemm_ws(a_desc, w_desc, sa_desc, out_desc, None, None, sw_ptr, bias_ptr, M, N, K, 0, stride_swn, 0,
                 NUM_PROGRAMS, W_BLOCK_N, HAS_BIAS, GROUP_M, NUM_STAGES, WAIT1, SPLIT_N, MMA_N, PINGPONG, PASS_DONE,
                 CONSUMER_REGS, PRODUCER_REGS, False)


# N and the output's row stride specialized (multiples of 16 in practice): the masked epilogue's gl.store
# vectorizes only where the column mask and the row offsets are known constant over 16 bytes
@gluon.jit(do_not_specialize=["M", "K", "stride_swe", "stride_swn", "NUM_PROGRAMS"])
def grouped_fp8_gemm_ws_kernel(a_desc, w_desc, sa_desc, out_ptr, tiles_ptr, sw_ptr, M, N, K, stride_swe,
                                stride_swn, stride_om, NUM_PROGRAMS, W_BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                                NUM_STAGES: gl.constexpr, WAIT1: gl.constexpr, SPLIT_N: gl.constexpr,
                                MMA_N: gl.constexpr, PINGPONG: gl.constexpr, PASS_DONE: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """linear_grouped_fp8_ws's launch: the tile map's tiles of the groups' rows (the map at tiles_ptr)."""
    _fp8_gemm_ws(a_desc, w_desc, sa_desc, None, out_ptr, tiles_ptr, sw_ptr, None, M, N, K, stride_swe, stride_swn,
                 stride_om, NUM_PROGRAMS, W_BLOCK_N, False, GROUP_M, NUM_STAGES, WAIT1, SPLIT_N, MMA_N, PINGPONG,
                 PASS_DONE, CONSUMER_REGS, PRODUCER_REGS, True)


@dataclass(frozen=True)
class WSConfig:
    block_n: int = 256
    num_stages: int = 4
    persistent: bool = True
    # one chain a consumer (all but split "m" at block_n 256): two partials live (at n128, with the accumulator,
    # 192 registers a thread)
    wait1: bool = False
    # launched at 168 registers a thread in 3 warpgroups, setmaxnreg moves them: each consumer warpgroup
    # consumer_regs, the producer's producer_regs (2 * 232 + 40 = 3 * 168)
    consumer_regs: int = 232
    producer_regs: int = 40
    group_m: int = 8
    # what the two consumer warpgroups split: "m", a 128 x block_n tile, 64 rows each (training shapes);
    # "n", a 64 x block_n tile, block_n / 2 columns each (decode: twice the tiles of "m" for small M)
    split: str = "m"
    # split "m": "" off, or the consumers take turns at the tensor core (consumer 0's wgmma chain c, consumer 1's
    # chain c, consumer 0's c+1, ...), so that one's chain runs while the other promotes; the turn passes once
    # a chain is "issued" (FlashAttention-3's and CUTLASS's ping-pong: the chains queue in that order) or
    # "done" (no two chains in flight at once, a hand-over's latency between them)
    pingpong: str = ""

    @property
    def block_m(self) -> int:
        return 2 * WG_M if self.split == "m" else WG_M

    @property
    def mma_n(self) -> int:
        """The N of a consumer's wgmma chain (m64nNk32)."""
        return MMA_N if self.split == "m" else self.block_n // 2

    def __str__(self) -> str:
        flags = [f for f, on in (("splitn", self.split == "n"), ("persistent", self.persistent),
                                 ("wait1", self.wait1), (f"pingpong-{self.pingpong}", self.pingpong),
                                 (f"group{self.group_m}", self.group_m != WSConfig.group_m),
                                 (f"regs{self.consumer_regs}", self.consumer_regs != WSConfig.consumer_regs)) if on]
        return "+".join([f"ws{self.block_m}x{self.block_n}s{self.num_stages}", *flags])

    def check(self) -> None:
        if self.split not in ("m", "n"):
            raise ValueError(f"{self}: split {self.split!r} must be 'm' (consumers take 64 rows each) or 'n' "
                             "(consumers take half the columns each)")
        if self.split == "m" and self.block_n not in (MMA_N, 2 * MMA_N):
            raise ValueError(f"{self}: block_n {self.block_n} must be {MMA_N} or {2 * MMA_N} "
                             f"(the partial is one or two n{MMA_N} wgmma chains)")
        if self.split == "n" and self.block_n not in (64, 128, 256):
            raise ValueError(f"{self}: block_n {self.block_n} must be 64, 128 or 256 with split 'n' (each consumer "
                             "one n32, n64 or n128 wgmma chain, within one 128-row weight scale block)")
        if self.wait1 and self.split == "m" and self.block_n != MMA_N:
            raise ValueError(f"{self}: wait1 keeps two partials live; at block_n {self.block_n} they and the "
                             "accumulator need 256+ registers a thread: use block_n 128")
        if self.pingpong not in ("", "issued", "done"):
            raise ValueError(f"{self}: pingpong {self.pingpong!r} must be '' (off), 'issued' or 'done' (when a "
                             "consumer passes the turn on: its chain issued or completed)")
        if self.pingpong and (self.split != "m" or self.wait1):
            raise ValueError(f"{self}: pingpong takes turns between the two consumers' chains of split 'm' (one "
                             "chain in flight each): use split 'm' without wait1")
        if self.num_stages < 2:
            raise ValueError(f"{self}: num_stages {self.num_stages} < 2 leaves the producer nothing to prefetch")
        if 2 * self.consumer_regs + self.producer_regs > 3 * LAUNCH_REGS or self.producer_regs < 24 \
                or self.consumer_regs > 256 or (self.consumer_regs | self.producer_regs) % 8:
            raise ValueError(f"{self}: setmaxnreg budgets {self.consumer_regs} x 2 + {self.producer_regs} must be "
                             f"multiples of 8 in [24, 256] summing to <= {3 * LAUNCH_REGS}")
        if self.shared_bytes() > sm90.SHARED_BYTES:
            raise ValueError(f"{self}: {self.shared_bytes()} bytes of shared memory > {sm90.SHARED_BYTES} on Hopper: "
                             "use fewer stages")

    def shared_bytes(self) -> int:
        """The ring of A, W and A-scale stages, the two consumers' epilogue tiles (FP32 out, the widest), the
        mbarriers (the compiler adds a few hundred bytes)."""
        epilogue = 2 * WG_M * min(EPI_BYTES, 4 * self.mma_n)
        barriers = 2 * self.num_stages + 2 * bool(self.pingpong)
        stage = (self.block_m + self.block_n) * BLOCK_K + 4 * self.block_m
        return self.num_stages * stage + epilogue + 8 * barriers


def tma_scales(sa: torch.Tensor) -> torch.Tensor:
    """sa [M, G] as the kernel's TMA reads it: stored by column (strides (1, P)), P >= M a multiple of 4 so that
    each column starts 16-byte aligned; a copy unless the quantiser wrote it so (quant_rows.scales_by_column).
    A size-1 dimension's stride is free (torch may set any), so one row or one column is read as (1, P)."""
    m, g = sa.shape
    col = sa.stride(1) if g > 1 else scale_column_stride(m)
    if (sa.stride(0) == 1 or m == 1) and col % 4 == 0 and col >= m and sa.data_ptr() % TMA_ALIGN == 0:
        return sa.as_strided((m, g), (1, col))
    return scales_by_column(m, g, sa.device).copy_(sa)


def _tma_ready(codes: torch.Tensor) -> torch.Tensor:
    """codes [R, K] as TMA reads them: contiguous rows of 16-byte multiples from a 16-byte aligned base.
    A K that is not a multiple of 16 is padded with zero codes (a copy): the zeros the Triton kernel's
    masked loads give the MMA past K, so the partial is unchanged."""
    codes = codes.contiguous()
    pad = -codes.shape[1] % TMA_ALIGN
    if pad or codes.data_ptr() % TMA_ALIGN:
        codes = torch.nn.functional.pad(codes.view(torch.uint8), (0, pad)).view(codes.dtype)
    return codes


def operand_descs(a: torch.Tensor, w: torch.Tensor, sa: torch.Tensor, config: WSConfig):
    """The TMA descriptors of a stage's boxes: activation codes a [M, K] and weight codes w [R, K] (copied by
    _tma_ready where TMA cannot read them) in [BLOCK_M | BLOCK_N, 128] boxes, the A scales sa [M, K blocks] by
    column (tma_scales) in [1, BLOCK_M] boxes."""
    a, w, sa = _tma_ready(a), _tma_ready(w), tma_scales(sa)
    layout = gl.NVMMASharedLayout.get_default_for([config.block_m, BLOCK_K], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a, [config.block_m, BLOCK_K], layout)
    w_desc = TensorDescriptor.from_tensor(w, [config.block_n, BLOCK_K], layout)
    # sa by column as TMA reads it: [K blocks, M], a block's column of rows one [1, BLOCK_M] box
    sa_desc = TensorDescriptor(sa.t(), [sa.shape[1], sa.shape[0]], [sa.stride(1), 1], [1, config.block_m],
                               gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    return a_desc, w_desc, sa_desc


def config_consts(config: WSConfig, w_block_n: int) -> dict:
    """The kernels' constexpr keywords for `config` and weight scale blocks of w_block_n rows."""
    return dict(W_BLOCK_N=w_block_n, GROUP_M=config.group_m, NUM_STAGES=config.num_stages, WAIT1=config.wait1,
                SPLIT_N=config.split == "n", MMA_N=config.mma_n, PINGPONG=bool(config.pingpong),
                PASS_DONE=config.pingpong == "done", CONSUMER_REGS=config.consumer_regs,
                PRODUCER_REGS=config.producer_regs)


def launch_args(qa: FP8Tensor, qw: FP8Tensor, bias: torch.Tensor | None, out: torch.Tensor, config: WSConfig):
    """(grid, positional arguments, constexpr keywords) of _fp8_gemm_ws_kernel for out = qa qw^T (+ bias);
    out [M, N] with 16-byte aligned rows (output() makes one)."""
    config.check()
    (m, k), n = qa.codes.shape, qw.codes.shape[0]
    a_desc, w_desc, sa_desc = operand_descs(qa.codes, qw.codes, qa.scales.reshape(m, -1), config)
    sw = qw.scales.contiguous()
    epi = [WG_M, min(config.mma_n, EPI_BYTES // out.element_size())]
    out_desc = TensorDescriptor(out, [m, n], [out.stride(0), 1], epi,
                                gl.NVMMASharedLayout.get_default_for(epi, OUT_DTYPES[out.dtype]))
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    programs = min(sm_count(qa.codes.device), tiles) if config.persistent else tiles
    args = (a_desc, w_desc, sa_desc, out_desc, sw, bias.contiguous() if bias is not None else None, m, n, k,
            sw.stride(0), programs)
    return (programs,), args, dict(config_consts(config, qw.block[0]), HAS_BIAS=bias is not None)


def output(m: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An [M, N] output whose rows TMA can store: N padded to 16 bytes where it is not (a view then)."""
    per_row = TMA_ALIGN // dtype.itemsize
    return torch.empty((m, -(-n // per_row) * per_row), device=device, dtype=dtype)[:, :n]


def launch(qa: FP8Tensor, qw: FP8Tensor, bias: torch.Tensor | None, out: torch.Tensor, config: WSConfig):
    """out = qa qw^T (+ bias) by the kernel; the compiled kernel (its registers and spills for the bench)."""
    grid, args, consts = launch_args(qa, qw, bias, out, config)
    return _fp8_gemm_ws_kernel[grid](*args, **consts, num_warps=4)


def linear_fp8_ws(qa: FP8Tensor, qw: FP8Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                  config: WSConfig) -> torch.Tensor:
    """linear_fp8 by the warp-specialized kernel: operands as linear_fp8 checks them, M, N, K > 0."""
    (m, _), n = qa.codes.shape, qw.codes.shape[0]
    out = output(m, n, out_dtype, qa.codes.device)
    launch(qa, qw, bias, out, config)
    return out.contiguous()
