"""relu2: relu(x)^2 in FP32, rounded once to the input dtype (Nemotron-H's MLP and expert activation).

Both steps are exact per element (max with 0, one IEEE product), so a value cannot depend on the launch, the
phase or its neighbours: one implementation serves every (mode, device) (KERNELS). Backward: `reference`.
"""
from __future__ import annotations

import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel


def reference(x):
    r = torch.relu(x.float())
    return (r * r).to(x.dtype)


# (mode, device) -> kernel(x)
KERNELS = dict.fromkeys([("consistent", "cpu"), ("consistent", "cuda"), ("baseline", "cpu"), ("baseline", "cuda")],
                        reference)


def relu2(spec: ExecutionSpec, x: torch.Tensor) -> torch.Tensor:
    return apply_kernel(KERNELS[spec.mode, spec.device], reference, x)
