"""silu_mul: SwiGLU's silu(gate) * up in FP32, rounded once to the input dtype.

Backends, from KERNELS by (mode, device): consistent CPU: silu on fixed-shape pieces (its SIMD body and scalar
tail differ in the last bit); baseline CPU: the stock F.silu over the whole tensor; CUDA, both modes: the fused
Triton kernel of ops/cuda/silu_mul.py (a speed-up that is not about consistency goes to both). Backward: `reference`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import pinned_unary
from onepath.ops.linear_quant import attach_quantized, fused_act_rule


def reference(gate, up):
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def consistent(gate, up):
    return (pinned_unary(F.silu, gate.float()) * up.float()).to(gate.dtype)


def cuda(spec: ExecutionSpec):
    from onepath.ops.cuda.silu_mul import BLOCK_I
    from onepath.ops.cuda.silu_mul import silu_mul as triton_silu_mul
    act = fused_act_rule(spec, BLOCK_I)  # here, not in the kernel: autograd's forward runs with grad off
    return triton_silu_mul if act is None else lambda g, u: attach_quantized(*triton_silu_mul(g, u, act))


# (mode, device) -> kernel factory (spec) -> kernel(gate, up)
KERNELS = {
    ("consistent", "cpu"): lambda spec: consistent,
    ("baseline", "cpu"): lambda spec: reference,
    ("consistent", "cuda"): cuda,
    ("baseline", "cuda"): cuda,
}


def silu_mul(spec: ExecutionSpec, gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with `limit` (DeepSeek-V4's swiglu_limit) gate is clamped to <= limit and up to
    [-limit, limit] first: exact, before every backend's kernel, and differentiable as a clamp is."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return apply_kernel(KERNELS[spec.mode, spec.device](spec), reference, gate, up)
