"""linear: y = x W^T + b, accumulated in FP32.

consistent (CPU): the GEMM runs on fixed [row_chunk, K] pieces. torch's CPU GEMM picks a kernel
by M (M = 1, 2..15, >= 16 give a row different bits), so one fixed M per launch is what makes a
row's bits independent of the batch, of its position in it, and of the phase.
baseline: one F.linear over all rows (the library's M-dependent choice).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import row_chunks


def reference(x, weight, bias=None):
    return F.linear(x, weight, bias)


def consistent(x, weight, bias=None, rows: int = 16):
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if bias is None:
        out = row_chunks(lambda c: F.linear(c, weight), rows, x2)
    else:
        out = row_chunks(lambda c: F.linear(c, weight, bias), rows, x2)
    return out.reshape(*shape[:-1], weight.shape[0])


def linear(spec: ExecutionSpec, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           op: str = "linear") -> torch.Tensor:
    if spec.mode == "consistent":
        rows = spec.op(op).row_chunk
        kernel = (lambda x, w: consistent(x, w, rows=rows)) if bias is None else \
            (lambda x, w, b: consistent(x, w, b, rows=rows))
    else:
        kernel = reference
    inputs = (x, weight) if bias is None else (x, weight, bias)
    return apply_kernel(kernel, reference, *inputs)
