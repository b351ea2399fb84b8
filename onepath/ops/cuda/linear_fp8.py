"""linear_fp8: block-FP8 W8A8 y = (a W^T) (+ b) on Hopper, batch-invariant and deterministic.

Operands are ops/linear_quant.py's: activation codes [M, K] float8_e4m3fn with FP32 scales per row
and 128-wide K group [M, ceil(K/128)]; weight codes [N, K] with FP32 scales per 128x128 block
[ceil(N/128), ceil(K/128)]. Per output element, K blocks kb in ascending order:
    partial = tl.dot(a_kb, w_kb^T)                    a fresh FP32 tensor-core partial of one block
    acc     = fma(partial, sa[m, kb] * sw[n // 128, kb], acc)
    y       = round(acc + bias)                       bias in FP32, one rounding to out_dtype
What keeps a row's bits its own (linear.py's rules): BLOCK_K = 128 = the scale group, for every
tile config, so a row's chain of MMAs and FMAs is a function of K alone; no split-K, no atomics;
rows past M masked; one program per output tile.
The promotion is done by hand (one dot per K block, then the FMA): Triton on SM90 would otherwise
keep the whole K loop in the FP8 MMA's imprecise accumulator (max_num_imprecise_acc = 2^30).

Two kernels keep that chain: this file's Triton kernel and linear_fp8_ws.py's warp-specialized Gluon
kernel (Hopper only; the faster one: docs/ops/linear.md). The pick follows M like the tile
ladder (pick_kernel): on Hopper the Gluon kernel where its TMA rows fit (its training layout from WS_MIN_ROWS
rows on, its decode layout below), the Triton tiles elsewhere. That cannot move a row's bits, because each
output element's MMA and FMA chain over K is the same in every kernel and tile;
tests/ops/test_linear_fp8_gpu.py proves the candidates give equal bits.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from onepath.numerics.quant import FP8Tensor
from onepath.ops.cuda import interpreting, sm_count
from onepath.ops.cuda.linear import TileConfig, first_filling, tile_offsets
from onepath.ops.cuda.linear_fp8_ws import OUT_DTYPES, TMA_ALIGN, WSConfig, linear_fp8_ws

# One K step = one scale group: the partial a scale multiplies is exactly one tl.dot.
BLOCK_K = 128
# fp8 tiles, largest first (BLOCK_M >= 64: Hopper's wgmma); the pick follows M like linear.py's,
# which cannot move a row's bits (each element's MMA chain over K is the same in every tile). No 128-row tiles:
# with a fresh dot per K block the MMA waits for its result every block (the variants timed: docs/ops/linear.md).
TILES_FP8 = (
    TileConfig(64, 128, num_warps=4, num_stages=3),
    TileConfig(64, 64, num_warps=4, num_stages=4),
)
# The warp-specialized kernel's training layout: 128x128, 5 stages (the deepest ring that fits with the A-scale
# stages), persistent, wait1 (each consumer promotes block kb-1 while kb's MMA runs); from WS_MIN_ROWS rows on.
WS_CONFIG = WSConfig(block_n=128, num_stages=5, persistent=True, wait1=True)
WS_MIN_ROWS = 512
# Below WS_MIN_ROWS (decode), the same kernel with its consumers splitting a 64-row tile's columns (split "n"),
# eight stages for a GEMM bound by its weight read, and wait1. Both layouts give the Triton kernel's bits; how
# they were chosen: docs/ops/linear.md.
DECODE_WS_CONFIG = WSConfig(block_n=128, num_stages=8, persistent=True, wait1=True, split="n")


@triton.jit(do_not_specialize=["M", "NUM_PROGRAMS"])
def _linear_fp8_kernel(
    a_ptr, sa_ptr, w_ptr, sw_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_am, stride_sam, stride_wn, stride_swn, stride_om,
    W_BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS,
):
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)

    for tile_id in tl.range(start_pid, num_tiles, NUM_PROGRAMS, flatten=True):
        _, _, offs_m, offs_n, rows, row_ok, cols = tile_offsets(
            tile_id, M, N, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M, False, False)
        w_blocks = cols // W_BLOCK_N

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k_left = K - ki * BLOCK_K
            a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + (ki * BLOCK_K + offs_k)[None, :],
                        mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + (ki * BLOCK_K + offs_k)[:, None],
                        mask=offs_k[:, None] < k_left, other=0.0)
            # fresh accumulator per K block: the partial the scales multiply, then promoted in FP32
            partial = tl.dot(a, b, out_dtype=tl.float32)
            sa = tl.load(sa_ptr + rows * stride_sam + ki, mask=row_ok, other=1.0)
            sw = tl.load(sw_ptr + w_blocks * stride_swn + ki)
            acc = tl.fma(partial, sa[:, None] * sw[None, :], acc)

        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def pick_config(m: int, n: int, num_sms: int) -> TileConfig:
    return first_filling(TILES_FP8, m, n, num_sms)


@functools.lru_cache(maxsize=None)
def is_hopper(device: torch.device) -> bool:
    """Compute capability 9.0 exactly: wgmma, setmaxnreg and the TMA the Gluon kernel is built on are
    sm_90a's (Blackwell has none of the first two)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def pick_kernel(m: int, n: int, k: int, out_dtype: torch.dtype, device: torch.device) -> TileConfig | WSConfig:
    """Where the warp-specialized kernel runs without a copy (on Hopper, not interpreted; rows of the codes
    and the output in 16-byte multiples, else its launcher pads them): WS_CONFIG from WS_MIN_ROWS rows on,
    DECODE_WS_CONFIG below; the Triton tile ladder otherwise. Each gives the same bits."""
    rows_aligned = k % TMA_ALIGN == 0 and out_dtype in OUT_DTYPES and n * out_dtype.itemsize % TMA_ALIGN == 0
    if rows_aligned and not interpreting() and is_hopper(device):
        return WS_CONFIG if m >= WS_MIN_ROWS else DECODE_WS_CONFIG
    return pick_config(m, n, sm_count(device))


def linear_fp8(qa: FP8Tensor, qw: FP8Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16, config: TileConfig | WSConfig | None = None) -> torch.Tensor:
    """qa: codes [M, K] with (1, 128) groups; qw: codes [N, K] with (r, 128) blocks -> [M, N] in out_dtype.
    `config` forces a kernel (tests and benchmarks): a TileConfig the Triton kernel, a WSConfig the
    warp-specialized one; by default pick_kernel's, which follows M and cannot move a row's bits."""
    a, w = qa.codes, qw.codes
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"linear_fp8: codes {tuple(a.shape)} and {tuple(w.shape)} do not match (expected [M, K], [N, K])")
    if qa.block != (1, BLOCK_K) or qw.block[1] != BLOCK_K:
        raise ValueError(f"linear_fp8: scale blocks {qa.block} x {qw.block} must be (1, {BLOCK_K}) x (r, {BLOCK_K}): "
                         "one scale per operand per K step")
    (m, k), n = a.shape, w.shape[0]
    if m == 0 or n == 0 or k == 0:
        out = torch.zeros((m, n), device=a.device, dtype=out_dtype)
        return out if bias is None else out.copy_(bias.expand(m, n))
    config = config or pick_kernel(m, n, k, out_dtype, a.device)
    if isinstance(config, WSConfig):
        return linear_fp8_ws(qa, qw, bias, out_dtype, config)
    out = torch.empty((m, n), device=a.device, dtype=out_dtype)
    a, w = a.contiguous(), w.contiguous()
    sa, sw = qa.scales.reshape(m, -1).contiguous(), qw.scales.contiguous()
    # one program per tile: the persistent walk (grid = #SMs) was slower here (docs/ops/linear.md)
    grid = (config.tiles(m, n),)
    _linear_fp8_kernel[grid](
        a, sa, w, sw, bias.contiguous() if bias is not None else None, out,
        m, n, k,
        a.stride(0), sa.stride(0), w.stride(0), sw.stride(0), out.stride(0),
        W_BLOCK_N=qw.block[0], HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=BLOCK_K,
        GROUP_M=config.group_m, NUM_PROGRAMS=grid[0],
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
