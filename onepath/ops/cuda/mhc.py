"""mhc on Hopper: DeepSeek-V4's hyper-connections (hc_pre, hc_post, hc_head) in three kernels, batch-invariant.

hc_pre and hc_head, two launches:
- `_mix_partials_kernel`, grid (block of BLOCK_T tokens, split of K): the flattened streams [T, K = N D] against
  fn [J, K], K cut into a FIXED split of SPLIT_K columns (the stock kernels pick a split count from the batch;
  here the count is a function of K alone). A program walks its split in ascending BLOCK_K steps, one tl.dot
  chain in IEEE FP32 into its accumulator and the row's squares by explicit FMAs column by column, summed at the
  end by pinned.tree_sum (an explicit tree, not the layout's); it writes its split's partial mix and sum of
  squares. No row's sum touches another's: a token's partials do not depend on the block it sits in, the number
  of tokens or the phase.
- `_hc_mix_kernel`, one program per (token, block of channels): the splits' partials added in split order, the
  mix scaled by the row's 1 / sqrt_rn(mean square + eps) (DeepSeek's order: the GEMM on the raw streams, then
  the norm's factor; the CPU normalises first, so a mix differs from the CPU's by the GEMM's own rounding), then
  the epilogue on registers in mhc.consistent_pre's order: sigmoid(z) = div_rn(1, 1 + exp(-z)), the softmax's
  sum over a row as pinned.tree_sum's tree, Sinkhorn columns first then (iters - 1) x (rows, columns), each sum
  over the streams in stream order, the collapse sum_n pre_n x_n in stream order, rounded once. Every program of
  a token recomputes the epilogue (a few hundred flops); the first one writes post and comb.
`_hc_post_kernel`, one program per (token, block of channels): post_k * out + sum_j comb_jk x_j, the sum in stream
order, rounded once: mhc.consistent_post's arithmetic exactly.

Launched with enable_fp_fusion=False (every product rounds before its add, as torch's do), IEEE division. Given
the same mix and exp, the epilogue is the CPU's step for step but for the sigmoid's formula (torch's CPU sigmoid
rounds one ulp apart in a few percent of cases): tests/ops/test_mhc_interpret.py gives both sides inputs whose
GEMM is exact and gets mhc.consistent's bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.ops.cuda import unit_stride
from onepath.ops.cuda.pinned import pick, pow2, tree_sum

SPLIT_K = 1024   # the fixed split of K: columns of the flattened streams one program sums
BLOCK_K = 64     # K step of the dot inside a split
BLOCK_T = 16     # tokens a program of the mixing GEMM holds (tl.dot's smallest M); rows never meet
BLOCK_D = 512    # channels a program of the collapse / expansion writes
NUM_WARPS = 4


@triton.jit(do_not_specialize=["T", "K", "J", "x_st", "mix_ss", "sq_ss"])
def _mix_partials_kernel(x_ptr, fn_ptr, mix_ptr, sq_ptr, T, K, J, x_st, mix_ss, sq_ss, SPLIT_K: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, J_PAD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    j = tl.arange(0, J_PAD)
    row_ok, j_ok = rows < T, j < J
    acc = tl.zeros([BLOCK_T, J_PAD], dtype=tl.float32)
    squares = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    end = tl.minimum(split * SPLIT_K + SPLIT_K, K)
    for start in range(split * SPLIT_K, end, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_ok = k < end
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_st + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        f = tl.load(fn_ptr + j[None, :] * K + k[:, None], mask=k_ok[:, None] & j_ok[None, :], other=0.0)
        acc = tl.dot(x, f, acc, input_precision="ieee")
        squares = tl.fma(x, x, squares)
    tl.store(mix_ptr + split * mix_ss + rows[:, None] * J + j[None, :], acc, mask=row_ok[:, None] & j_ok[None, :])
    tl.store(sq_ptr + split * sq_ss + rows, tree_sum(squares), mask=row_ok)


@triton.jit
def _sigmoid(z):
    return tl.math.div_rn(1.0, 1.0 + tl.exp(-z))


@triton.jit
def _stream_sum(x, n, N, AXIS: tl.constexpr):
    """mhc.stream_sum of a [N_PAD, N_PAD] block over AXIS: index 0, then 1, ... N - 1 added in order."""
    acc = pick(x, n, 0, AXIS)
    for i in range(1, N):
        acc = acc + pick(x, n, i, AXIS)
    return acc


@triton.jit(do_not_specialize=["T", "N", "D", "K", "splits", "J", "mix_ss", "sq_ss", "x_st", "o_st", "iters"])
def _hc_mix_kernel(x_ptr, mix_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr, T, N, D, K, splits, J,
                   mix_ss, sq_ss, x_st, o_st, norm_eps, hc_eps, iters, N_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                   HEAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, N_PAD)
    n_ok = n < N
    pair_ok = n_ok[:, None] & n_ok[None, :]
    row = mix_ptr + t * J
    pre_w = tl.load(row + n, mask=n_ok, other=0.0)
    post_w = tl.load(row + N + n, mask=n_ok & (not HEAD), other=0.0)
    comb_w = tl.load(row + 2 * N + n[:, None] * N + n[None, :], mask=pair_ok & (not HEAD), other=0.0)
    sq = tl.load(sq_ptr + t)
    for s in range(1, splits):  # the fixed split's partials, in split order
        row = mix_ptr + s * mix_ss + t * J
        pre_w += tl.load(row + n, mask=n_ok, other=0.0)
        sq += tl.load(sq_ptr + s * sq_ss + t)
        if not HEAD:
            post_w += tl.load(row + N + n, mask=n_ok, other=0.0)
            comb_w += tl.load(row + 2 * N + n[:, None] * N + n[None, :], mask=pair_ok, other=0.0)
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(sq, K * 1.0) + norm_eps))
    pre = _sigmoid(pre_w * inv * tl.load(scale_ptr) + tl.load(base_ptr + n, mask=n_ok, other=0.0)) + hc_eps
    if not HEAD:
        if tl.program_id(1) == 0:
            post = 2.0 * _sigmoid(post_w * inv * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + n, mask=n_ok,
                                                                                  other=0.0))
            z = comb_w * inv * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + n[:, None] * N + n[None, :],
                                                                mask=pair_ok, other=0.0)
            z = tl.where(pair_ok, z, float("-inf"))
            ex = tl.exp(z - tl.where(n_ok, tl.max(z, axis=1), 0.0)[:, None])
            total = tl.where(n_ok, tree_sum(ex), 1.0)  # the padded rows' 0 / 0 left out
            comb = tl.where(pair_ok, tl.math.div_rn(ex, total[:, None]) + hc_eps, 0.0)
            comb = tl.math.div_rn(comb, _stream_sum(comb, n, N, 0)[None, :] + hc_eps)
            for _ in range(1, iters):
                comb = tl.math.div_rn(comb, _stream_sum(comb, n, N, 1)[:, None] + hc_eps)
                comb = tl.math.div_rn(comb, _stream_sum(comb, n, N, 0)[None, :] + hc_eps)
            tl.store(post_ptr + t * N + n, post, mask=n_ok)
            tl.store(comb_ptr + t * N * N + n[:, None] * N + n[None, :], comb, mask=pair_ok)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    x_row = x_ptr + t * x_st
    acc = tl.sum(tl.where(n == 0, pre, 0.0)) * tl.load(x_row + d, mask=d_ok, other=0.0).to(tl.float32)
    for i in range(1, N):
        acc = acc + tl.sum(tl.where(n == i, pre, 0.0)) * tl.load(x_row + i * D + d, mask=d_ok, other=0.0).to(
            tl.float32)
    tl.store(out_ptr + t * o_st + d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit(do_not_specialize=["N", "D", "o_st", "x_st", "x_sn", "y_st", "y_sn"])
def _hc_post_kernel(out_ptr, x_ptr, post_ptr, comb_ptr, y_ptr, N, D, o_st, x_st, x_sn, y_st, y_sn,
                    N_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, N_PAD)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    k_ok, d_ok = k < N, d < D
    comb_row = comb_ptr + t * N * N
    x_row = x_ptr + t * x_st
    mixed = tl.load(comb_row + k, mask=k_ok, other=0.0)[:, None] * tl.load(x_row + d, mask=d_ok, other=0.0).to(
        tl.float32)[None, :]
    for j in range(1, N):  # sum_j comb_jk x_j in stream order
        mixed = mixed + tl.load(comb_row + j * N + k, mask=k_ok, other=0.0)[:, None] * tl.load(
            x_row + j * x_sn + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    post = tl.load(post_ptr + t * N + k, mask=k_ok, other=0.0)
    out = tl.load(out_ptr + t * o_st + d, mask=d_ok, other=0.0).to(tl.float32)
    y = post[:, None] * out[None, :] + mixed
    tl.store(y_ptr + t * y_st + k[:, None] * y_sn + d[None, :], y.to(y_ptr.dtype.element_ty),
             mask=k_ok[:, None] & d_ok[None, :])


def _collapse(x, fn, base, scale, norm_eps, hc_eps, iters, head, split_k):
    t, n, d = x.shape
    x = x.detach().contiguous()
    fn, base, scale = (unit_stride(v.detach().float()).contiguous() for v in (fn, base, scale))
    j, k = fn.shape
    splits = triton.cdiv(k, split_k)
    mix = torch.empty(splits, t, j, dtype=torch.float32, device=x.device)
    sq = torch.empty(splits, t, dtype=torch.float32, device=x.device)
    post = torch.empty(t, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=x.device)
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if t == 0:
        return post, comb, out
    _mix_partials_kernel[(triton.cdiv(t, BLOCK_T), splits)](
        x, fn, mix, sq, t, k, j, x.stride(0), mix.stride(0), sq.stride(0), SPLIT_K=split_k, BLOCK_T=BLOCK_T,
        BLOCK_K=BLOCK_K, J_PAD=max(16, triton.next_power_of_2(j)), num_warps=NUM_WARPS, enable_fp_fusion=False)
    block_d = min(BLOCK_D, triton.next_power_of_2(d))
    _hc_mix_kernel[(t, triton.cdiv(d, block_d))](
        x, mix, sq, base, scale, post, comb, out, t, n, d, k, splits, j, mix.stride(0), sq.stride(0), x.stride(0),
        out.stride(0), norm_eps, hc_eps, iters, N_PAD=pow2(n), BLOCK_D=block_d, HEAD=head, num_warps=NUM_WARPS,
        enable_fp_fusion=False)
    return post, comb, out


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           hc_eps: float, iters: int, split_k: int = SPLIT_K):
    """x [T, N, D]; fn [(2 + N) N, N D]; base [(2 + N) N]; scale [3] -> post [T, N], comb [T, N, N] FP32, the
    collapsed streams [T, D] in x's dtype."""
    return _collapse(x, fn, base, scale, norm_eps, hc_eps, iters, False, split_k)


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float, split_k: int = SPLIT_K) -> torch.Tensor:
    """x [T, N, D]; fn [N, N D]; base [N]; scale [1] -> the collapsed streams [T, D] in x's dtype."""
    return _collapse(x, fn, base, scale, norm_eps, hc_eps, 1, True, split_k)[2]


def hc_post(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out [T, D]; x [T, N, D]; post [T, N], comb [T, N, N] FP32 -> the new streams [T, N, D] in x's dtype."""
    t, n, d = x.shape
    out, x = unit_stride(out.detach()), unit_stride(x.detach())
    post, comb = post.detach().float().contiguous(), comb.detach().float().contiguous()
    y = torch.empty(t, n, d, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    block_d = min(BLOCK_D, triton.next_power_of_2(d))
    _hc_post_kernel[(t, triton.cdiv(d, block_d))](
        out, x, post, comb, y, n, d, out.stride(0), x.stride(0), x.stride(1), y.stride(0), y.stride(1),
        N_PAD=pow2(n), BLOCK_D=block_d, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return y
