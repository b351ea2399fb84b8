"""sigmoid in FP32 (Qwen2-MoE's shared-expert gate).

consistent: on fixed-shape pieces (pinned_unary: a CPU SIMD body and scalar tail differ in the last bit);
baseline: torch.sigmoid over the whole tensor. The same torch code on both devices (KERNELS by (mode, device)).
Backward: `reference`.
"""
from __future__ import annotations

import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import pinned_unary


def reference(x):
    return torch.sigmoid(x.float())


def consistent(x):
    return pinned_unary(torch.sigmoid, x.float())


# (mode, device) -> kernel(x)
KERNELS = {
    ("consistent", "cpu"): consistent,
    ("consistent", "cuda"): consistent,
    ("baseline", "cpu"): reference,
    ("baseline", "cuda"): reference,
}


def sigmoid(spec: ExecutionSpec, x: torch.Tensor) -> torch.Tensor:
    return apply_kernel(KERNELS[spec.mode, spec.device], reference, x)
