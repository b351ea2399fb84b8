"""softmax over the last dim in FP32: the MoE router's expert probabilities, and the recipe the log-probs share.

consistent: exp on fixed-shape pieces, the sum as a fixed tree (consistent_softmax_parts; ops/logprobs.py
builds its log-probs and probabilities from the same parts); baseline: torch.softmax. The same torch code on
both devices (KERNELS by (mode, device)). Backward: `reference`.
"""
from __future__ import annotations

import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import pinned_unary, tree_sum


def reference(x):
    return torch.softmax(x.float(), dim=-1)


def consistent_softmax_parts(x):
    """(x - max, sum of exp, exp) of each row, by the fixed-order recipe."""
    shifted = x - x.amax(dim=-1, keepdim=True)
    e = pinned_unary(torch.exp, shifted)
    return shifted, tree_sum(e), e


def consistent(x):
    _, total, e = consistent_softmax_parts(x.float())
    return e / total.unsqueeze(-1)


# (mode, device) -> kernel(x)
KERNELS = {
    ("consistent", "cpu"): consistent,
    ("consistent", "cuda"): consistent,
    ("baseline", "cpu"): reference,
    ("baseline", "cuda"): reference,
}


def softmax(spec: ExecutionSpec, x: torch.Tensor) -> torch.Tensor:
    return apply_kernel(KERNELS[spec.mode, spec.device], reference, x)
