"""rmsnorm on Hopper: Hugging Face's formula, one program per row, batch-invariant and deterministic.

    xf = x.float(); inv = 1 / sqrt_rn(sum(xf^2) / H + eps); out = round(w * round(xf * inv, x.dtype))

with the optional fused residual add `s = round(x + residual, x.dtype)` (what a model's
`x = x + r` stores) normalised in place of x. A row's bits depend on that row alone:
- the sum of squares walks H in fixed BLOCK_H chunks in ascending order into one FP32 vector,
  reduced once by tl.sum at the end: the order is a function of H only; no atomics; the number
  of rows is never passed to the kernel, so nothing can dispatch on it;
- every launch compiles to one binary per (H, dtypes): row strides are not specialised on and
  carry an explicit 16-byte alignment hint, and every vector-loaded pointer (the weight included:
  the engine's copy may sit elsewhere than the trainer's) is 16-byte aligned by `aligned_rows`,
  because a different binary could lay the vector out differently and so sum it in another tree;
- 1 / sqrt is IEEE (`sqrt_rn`, `div_rn`), not the approximate rsqrt, so the formula is portable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# The chunk of H summed per step: it fixes the reduction order of a row.
BLOCK_H = 1024
NUM_WARPS = 4


def aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, n] with unit inner stride, a 16-byte aligned start and a row stride of whole 16-byte
    units, else a copy with rows padded to 16 bytes. The reduction kernels promise the compiler
    that alignment instead of specialising on the caller's strides, so every batch a row can sit
    in runs the same binary."""
    vec = 16 // x.element_size()
    if x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and (x.shape[0] <= 1 or x.stride(0) % vec == 0):
        return x
    padded = x.new_empty(x.shape[0], triton.cdiv(x.shape[1], vec) * vec)[:, :x.shape[1]]
    return padded.copy_(x)


def row_stride(x: torch.Tensor) -> int:
    # A single row's stride multiplies row 0 only; 0 keeps the alignment hint true for any layout.
    return x.stride(0) if x.shape[0] > 1 else 0


@triton.jit
def _summed_row(x_row, r_row, offs, mask, HAS_RESIDUAL: tl.constexpr):
    """The row the norm sees, in FP32: x, or x + residual rounded to x's dtype."""
    v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
        v = (v + r).to(x_row.dtype.element_ty).to(tl.float32)
    return v


@triton.jit(do_not_specialize=["x_stride", "r_stride", "out_stride", "res_stride"])
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, x_stride, r_stride, out_stride, res_stride, H, eps,
                    HAS_RESIDUAL: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + tl.multiple_of(row * x_stride, VEC)
    r_row = r_ptr + tl.multiple_of(row * r_stride, VEC)
    cols = tl.arange(0, BLOCK)

    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, H, BLOCK):
        offs = start + cols
        mask = offs < H
        v = _summed_row(x_row, r_row, offs, mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(res_ptr + tl.multiple_of(row * res_stride, VEC) + offs, v.to(res_ptr.dtype.element_ty), mask=mask)
        acc += v * v
    var = tl.math.div_rn(tl.sum(acc, axis=0), H * 1.0)
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))

    for start in range(0, H, BLOCK):
        offs = start + cols
        mask = offs < H
        v = _summed_row(x_row, r_row, offs, mask, HAS_RESIDUAL)
        y = (v * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + tl.multiple_of(row * out_stride, VEC) + offs, (w * y).to(out_ptr.dtype.element_ty),
                 mask=mask)


def _launch(x, residual, weight, eps):
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rmsnorm: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match "
                         "(expected x [..., H], weight [H])")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rmsnorm: residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    lead, h = x.shape[:-1], x.shape[-1]
    x2 = aligned_rows(x.reshape(-1, h))
    r2 = aligned_rows(residual.reshape(-1, h)) if residual is not None else x2
    m = x2.shape[0]
    # Fresh outputs: contiguous and 16-byte aligned; rows padded so the hint holds for any H.
    vec = 16 // x.element_size()
    out = aligned_rows(torch.empty((m, h), device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype)))
    res = aligned_rows(torch.empty_like(x2)) if residual is not None else out
    if m and h:
        _rmsnorm_kernel[(m,)](x2, r2, aligned_rows(weight[None])[0], out, res, row_stride(x2), row_stride(r2),
                              row_stride(out), row_stride(res), h, eps, HAS_RESIDUAL=residual is not None,
                              VEC=min(vec, 16 // out.element_size()), BLOCK=BLOCK_H, num_warps=NUM_WARPS)
    return out.reshape(*lead, h), res.reshape(*lead, h)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H] in promote(x.dtype, weight.dtype) (x.dtype for a model's BF16 weights)."""
    return _launch(x, None, weight, eps)[0]


def rmsnorm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(s), s) with s = x + residual rounded to x.dtype, in one pass over memory."""
    return _launch(x, residual, weight, eps)
