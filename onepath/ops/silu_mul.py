"""silu_mul: SwiGLU's silu(gate) * up in FP32, rounded once to the input dtype.

consistent: silu runs on fixed-shape pieces (its SIMD body and scalar tail differ in the last
bit). baseline: the stock F.silu over the whole tensor. On CUDA both modes run the fused Triton
kernel: a speed-up that is not about consistency goes to both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import pinned_unary
from onepath.ops.quant_linear import attach_quantized, fused_act_rule


def reference(gate, up):
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def consistent(gate, up):
    return (pinned_unary(F.silu, gate.float()) * up.float()).to(gate.dtype)


def silu_mul(spec: ExecutionSpec, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    kernel = consistent if spec.mode == "consistent" else reference
    if spec.device == "cuda":
        from onepath.ops.cuda.elementwise import BLOCK_I
        from onepath.ops.cuda.elementwise import silu_mul as triton_silu_mul
        act = fused_act_rule(spec, BLOCK_I)
        kernel = triton_silu_mul if act is None else lambda g, u: attach_quantized(*triton_silu_mul(g, u, act))
    return apply_kernel(kernel, reference, gate, up)
