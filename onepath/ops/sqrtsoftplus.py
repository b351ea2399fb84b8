"""sqrtsoftplus in FP32: sqrt(softplus(x)), DeepSeek-V4's router score.

consistent: on fixed-shape pieces (pinned_unary: a CPU SIMD body and scalar tail differ in the last bit);
baseline: the stock ops over the whole tensor. The same torch code on both devices (KERNELS by (mode, device)).
Backward: `reference`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import pinned_unary


def reference(x):
    return F.softplus(x.float()).sqrt()


def consistent(x):
    return pinned_unary(lambda t: F.softplus(t).sqrt(), x.float())


# (mode, device) -> kernel(x)
KERNELS = {
    ("consistent", "cpu"): consistent,
    ("consistent", "cuda"): consistent,
    ("baseline", "cpu"): reference,
    ("baseline", "cuda"): reference,
}


def sqrtsoftplus(spec: ExecutionSpec, x: torch.Tensor) -> torch.Tensor:
    return apply_kernel(KERNELS[spec.mode, spec.device], reference, x)
