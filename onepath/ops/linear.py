"""linear: y = x W^T + b, accumulated in FP32.

consistent (CPU): the GEMM runs on fixed [row_chunk, K] pieces. torch's CPU GEMM picks a kernel
by M (M = 1, 2..15, >= 16 give a row different bits), so one fixed M per launch is what makes a
row's bits independent of the batch, of its position in it, and of the phase.
consistent (CUDA): the Triton persistent GEMM of ops/cuda/matmul.py (fixed BLOCK_K, no split-K).
baseline: one F.linear over all rows (the library's M-dependent choice; cuBLAS on the GPU).
The LM head returns FP32 logits: the consistent GEMM rounds its FP32 accumulator to FP32 once;
the baseline rounds to the weights' dtype first, as the stock engines do.
Quantised (the op's weight/act QuantSpecs set): ops/quant_linear.py's forward, on both sides; the
backward stays this file's reference on the unquantised operands (straight-through).
grouped_linear (the MoE experts, rows packed by expert): on consistent CUDA, unquantised, one launch
of ops/cuda/grouped_matmul.py, whose rows have the dense kernel's bits; elsewhere linear() per group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import row_chunks
from onepath.ops.quant_linear import quant_linear


def reference(x, weight, bias=None):
    return F.linear(x, weight, bias)


def consistent(x, weight, bias=None, rows: int = 16):
    shape = x.shape
    out = row_chunks(lambda c: F.linear(c, weight, bias), rows, x.reshape(-1, shape[-1]))
    return out.reshape(*shape[:-1], weight.shape[0])


def linear(spec: ExecutionSpec, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           op: str = "linear", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out_dtype: FP32 for the LM head by default, else x's dtype; one rounding of the FP32 accumulator."""
    out_dtype = out_dtype or (torch.float32 if op == "lm_head" else x.dtype)
    if spec.op(op).weight is not None or spec.op(op).act is not None:
        def kernel(x, w, b=None):
            return quant_linear(spec, x, w, b, out_dtype, op)
    elif spec.mode == "consistent" and spec.device == "cuda":
        from onepath.ops.cuda.matmul import matmul

        def kernel(x, w, b=None):
            return matmul(x.reshape(-1, x.shape[-1]), w, b, out_dtype=out_dtype).reshape(*x.shape[:-1], w.shape[0])
    elif spec.mode == "consistent":
        rows = spec.op(op).row_chunk

        def kernel(x, w, b=None):
            return consistent(x, w, b, rows=rows).to(out_dtype)
    else:
        def kernel(x, w, b=None):
            return reference(x, w, b).to(out_dtype)
    inputs = (x, weight) if bias is None else (x, weight, bias)
    return apply_kernel(kernel, lambda *t: reference(*t).to(out_dtype), *inputs)


def grouped_reference(x, weight, counts: list[int]):
    parts = [F.linear(part, weight[g]) for g, part in enumerate(x.split(counts)) if part.shape[0]]
    return torch.cat(parts) if parts else x.new_empty(0, weight.shape[1])


def grouped_kernel(spec: ExecutionSpec, op: str = "linear") -> bool:
    """True where grouped_linear is one grouped-GEMM launch rather than a linear() per group."""
    quantised = spec.op(op).weight is not None or spec.op(op).act is not None
    return spec.mode == "consistent" and spec.device == "cuda" and not quantised


def grouped_linear(spec: ExecutionSpec, x: torch.Tensor, weight: torch.Tensor, counts: list[int],
                   op: str = "linear", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K], rows packed by group (counts[g] rows each), weight [G, N, K] -> [M, N]: each group's
    rows through linear() against weight[g], bit for bit, whatever the backend."""
    out_dtype = out_dtype or x.dtype
    if not grouped_kernel(spec, op):
        parts = [linear(spec, part, weight[g], op=op, out_dtype=out_dtype)
                 for g, part in enumerate(x.split(counts)) if part.shape[0]]
        return torch.cat(parts) if parts else x.new_empty(0, weight.shape[1], dtype=out_dtype)
    from onepath.ops.cuda.grouped_matmul import grouped_matmul

    return apply_kernel(lambda x, w: grouped_matmul(x, w, counts, out_dtype=out_dtype),
                        lambda x, w: grouped_reference(x, w, counts).to(out_dtype), x, weight)
