"""rmsnorm: y = w * x / sqrt(mean(x^2) + eps), in FP32, rounded once to the input dtype.

Backends, from KERNELS by (mode, device): consistent CPU: the sum of squares is a fixed tree over the hidden size
(elementwise adds only), rsqrt on fixed-shape pieces; baseline CPU: the stock `x.pow(2).mean(-1)` reduction; CUDA,
both modes: the fused Triton kernel of ops/cuda/rmsnorm.py (a speed-up that is not about consistency goes to both).
The order of the final products follows Hugging Face's Llama (normalise, cast, then scale by w); `cast_last`
gives DeepSeek-V4's (normalise, scale by w in FP32, one rounding to the input's dtype: its norm weights stay FP32 in
a BF16 model, the output is in the input's dtype). Backward: `reference`.

gated_rmsnorm (Mamba-2's norm before out_proj, Nemotron-H's RMSNormGated with norm_before_gate False): the input
times silu(gate), normalised over groups of `group_size` channels, in FP32; scaled by w in FP32 and rounded once to
w's dtype. Consistent: silu and rsqrt on fixed-shape pieces, each group's sum of squares a fixed tree (CPU), the
Triton kernel of ops/cuda/rmsnorm.py (CUDA: one program per row and group, the squares in a fixed order); baseline:
the stock mean and functions over the whole tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import pinned_unary, tree_sum
from onepath.ops.linear_quant import attach_quantized, fused_act_rule


def scaled(x, normed, weight, cast_last):
    """Llama's w * round(normed), or DeepSeek-V4's round(w * normed) (cast_last), normed FP32."""
    return (weight.float() * normed).to(x.dtype) if cast_last else weight * normed.to(x.dtype)


def reference(x, weight, eps, cast_last=False):
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return scaled(x, xf * torch.rsqrt(var + eps), weight, cast_last)


def consistent(x, weight, eps, cast_last=False):
    xf = x.float()
    var = tree_sum(xf * xf) / xf.shape[-1]
    inv = pinned_unary(torch.rsqrt, var + eps)
    return scaled(x, xf * inv.unsqueeze(-1), weight, cast_last)


def cuda(spec: ExecutionSpec, eps: float, cast_last: bool = False):
    from onepath.ops.cuda.rmsnorm import BLOCK_H
    from onepath.ops.cuda.rmsnorm import rmsnorm as triton_rmsnorm
    act = fused_act_rule(spec, BLOCK_H)  # here, not in the kernel: autograd's forward runs with grad off

    def kernel(x, w):
        out = triton_rmsnorm(x, w, eps, act, cast_last)
        return out if act is None else attach_quantized(*out)
    return kernel


def cuda_residual(spec: ExecutionSpec, eps: float):
    from onepath.ops.cuda.rmsnorm import BLOCK_H, rmsnorm_residual
    act = fused_act_rule(spec, BLOCK_H)

    def kernel(x, r, w):
        if act is None:
            return rmsnorm_residual(x, r, w, eps)
        normed, s, quantized = rmsnorm_residual(x, r, w, eps, act)
        return attach_quantized(normed, quantized), s
    return kernel


def cpu_residual(spec: ExecutionSpec, eps: float):
    def kernel(x, r, w):
        s = x + r
        return rmsnorm(spec, s, w, eps), s
    return kernel


# (mode, device) -> kernel factory (spec, eps, cast_last) -> kernel(x, w); ADD_KERNELS: (spec, eps) -> kernel(x, r, w)
KERNELS = {
    ("consistent", "cpu"): lambda spec, eps, cast_last=False: lambda x, w: consistent(x, w, eps, cast_last),
    ("baseline", "cpu"): lambda spec, eps, cast_last=False: lambda x, w: reference(x, w, eps, cast_last),
    ("consistent", "cuda"): cuda,
    ("baseline", "cuda"): cuda,
}
ADD_KERNELS = {
    ("consistent", "cpu"): cpu_residual,
    ("baseline", "cpu"): cpu_residual,
    ("consistent", "cuda"): cuda_residual,
    ("baseline", "cuda"): cuda_residual,
}


def gated_reference(x, gate, weight, eps, group_size):
    h = x.float() * F.silu(gate.float())
    g = h.view(*h.shape[:-1], -1, group_size)
    normed = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view(h.shape)
    return (weight.float() * normed).to(weight.dtype)


def gated_consistent(x, gate, weight, eps, group_size):
    h = x.float() * pinned_unary(F.silu, gate.float())
    g = h.view(*h.shape[:-1], -1, group_size)
    inv = pinned_unary(torch.rsqrt, tree_sum(g * g) / group_size + eps)
    return (weight.float() * (g * inv.unsqueeze(-1)).view(h.shape)).to(weight.dtype)


def gated_cuda(x, gate, weight, eps, group_size):
    from onepath.ops.cuda.rmsnorm import gated_rmsnorm as triton_gated_rmsnorm
    return triton_gated_rmsnorm(x.detach(), gate.detach(), weight.detach(), eps, group_size)


# (mode, device) -> gated_rmsnorm's kernel(x, gate, weight, eps, group_size)
GATED_KERNELS = {
    ("consistent", "cpu"): gated_consistent,
    ("consistent", "cuda"): gated_cuda,
    ("baseline", "cpu"): gated_reference,
    ("baseline", "cuda"): gated_reference,
}


def gated_rmsnorm(spec: ExecutionSpec, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                  group_size: int) -> torch.Tensor:
    """x [..., I] (FP32, the scan's output), gate [..., I], weight [I] -> [..., I] in weight's dtype."""
    if x.shape[-1] % group_size or x.shape != gate.shape:
        raise ValueError(f"gated_rmsnorm: x {tuple(x.shape)} and gate {tuple(gate.shape)} must match and split into "
                         f"groups of {group_size}")
    kernel = GATED_KERNELS[spec.mode, spec.device]
    return apply_kernel(lambda x, z, w: kernel(x, z, w, eps, group_size),
                        lambda x, z, w: gated_reference(x, z, w, eps, group_size), x, gate, weight)


def rmsnorm(spec: ExecutionSpec, x: torch.Tensor, weight: torch.Tensor, eps: float,
            cast_last: bool = False) -> torch.Tensor:
    """x [..., H], weight [H]; cast_last: DeepSeek-V4's order (the module docstring), the output in x's dtype."""
    kernel = KERNELS[spec.mode, spec.device](spec, eps, cast_last)
    return apply_kernel(kernel, lambda x, w: reference(x, w, eps, cast_last), x, weight)


def add_rmsnorm(spec: ExecutionSpec, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(s), s) with s = x + residual in x's dtype: a decoder layer's residual add and the norm after it.
    The bits of `x + residual` then rmsnorm (both round the FP32 sum once to x's dtype); on CUDA one launch
    (ops/cuda/rmsnorm.rmsnorm_residual) instead of two."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"add_rmsnorm: x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
                         f"{residual.dtype} must match")

    def reference_pair(x, r, w):
        s = x + r
        return reference(s, w, eps), s

    return apply_kernel(ADD_KERNELS[spec.mode, spec.device](spec, eps), reference_pair, x, residual, weight)
