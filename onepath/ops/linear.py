"""linear: y = x W^T + b, accumulated in FP32; the dense layers, the LM head, the MoE router and experts.

Backends, from KERNELS by (mode, device):
- consistent CPU: the GEMM on fixed [row_chunk, K] pieces (torch's CPU GEMM picks a kernel by M, so one fixed M
  per launch keeps a row's bits independent of its batch, its position and the phase);
- consistent CUDA: the persistent GEMM of ops/cuda/linear.py (one ascending MMA chain over K, no split-K);
- baseline: one F.linear over all rows (the library's M-dependent choice; cuBLAS on the GPU).
The LM head returns FP32 logits: the consistent GEMM rounds its FP32 accumulator to FP32 once; the baseline
rounds to the weights' dtype first, as the stock engines do. A quantised op (its weight/act QuantSpecs set)
runs ops/linear_quant.py's forward on both sides instead. Backward: `reference` on the unquantised operands
(straight-through). grouped_linear (the MoE experts, rows packed by expert) picks from GROUPED: our grouped
kernel on consistent CUDA (each row the dense kernel's bits), torch._grouped_mm on baseline CUDA BF16, else
linear() per group; quantised experts take linear_quant.grouped_quant_linear (each row quant_linear's bits). Design notes and measurements: docs/ops/linear.md.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.grouped_mm import stock_grouped, stock_grouped_fits
from onepath.ops.linear_quant import grouped_quant_linear, is_quantised, quant_linear
from onepath.ops.pinned import row_chunks


def reference(x, weight, bias=None):
    return F.linear(x, weight, bias)


def consistent(x, weight, bias=None, rows: int = 16):
    shape = x.shape
    out = row_chunks(lambda c: F.linear(c, weight, bias), rows, x.reshape(-1, shape[-1]))
    return out.reshape(*shape[:-1], weight.shape[0])


def cpu_consistent(spec: ExecutionSpec, op: str, out_dtype: torch.dtype) -> Callable:
    rows = spec.op(op).row_chunk
    return lambda x, w, b=None: consistent(x, w, b, rows=rows).to(out_dtype)


def cuda_consistent(spec: ExecutionSpec, op: str, out_dtype: torch.dtype) -> Callable:
    from onepath.ops.cuda import linear as cuda

    def kernel(x, w, b=None):
        return cuda.linear(x.reshape(-1, x.shape[-1]), w, b, out_dtype=out_dtype).reshape(*x.shape[:-1], w.shape[0])
    return kernel


def library(spec: ExecutionSpec, op: str, out_dtype: torch.dtype) -> Callable:
    return lambda x, w, b=None: reference(x, w, b).to(out_dtype)


def quantised(spec: ExecutionSpec, op: str, out_dtype: torch.dtype) -> Callable:
    return lambda x, w, b=None: quant_linear(spec, x, w, b, out_dtype, op)


# (mode, device) -> kernel factory (spec, op, out_dtype) -> kernel(x, w, b=None); a quantised op takes `quantised`
KERNELS = {
    ("consistent", "cpu"): cpu_consistent,
    ("consistent", "cuda"): cuda_consistent,
    ("baseline", "cpu"): library,
    ("baseline", "cuda"): library,
}


def linear(spec: ExecutionSpec, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           op: str = "linear", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out_dtype: FP32 for the LM head by default, else x's dtype; one rounding of the FP32 accumulator."""
    out_dtype = out_dtype or (torch.float32 if op == "lm_head" else x.dtype)
    make = quantised if is_quantised(spec.op(op)) else KERNELS[spec.mode, spec.device]
    kernel = make(spec, op, out_dtype)
    inputs = (x, weight) if bias is None else (x, weight, bias)
    return apply_kernel(kernel, lambda *t: reference(*t).to(out_dtype), *inputs)


def can_stack(spec: ExecutionSpec, sizes: list[int], op: str = "linear") -> bool:
    """Whether layers sharing an input (output sizes `sizes`) may run as one GEMM over their stacked weights with
    each layer's bits: on CUDA, unquantised, or block-FP8 weights whose blocks each lie within one layer (every
    size a multiple of the block's rows), so the stacked codes and scales are the layers' own and each token's
    activation codes do not depend on N. Not NVFP4: its global scale is the whole tensor's amax."""
    linear_op = spec.op(op)
    if spec.device != "cuda":
        return False
    if linear_op.weight is None:
        return linear_op.act is None
    w = linear_op.weight
    return (w.format == "fp8_e4m3" and w.scale_domain == "per_block" and all(n % w.block[0] == 0 for n in sizes)
            and (linear_op.act is None or linear_op.act.format == "fp8_e4m3"))


def host_counts(counts: list[int] | torch.Tensor) -> list[int]:
    """Group sizes as a list (from a device tensor: a host sync, where a loop over the groups needs one)."""
    return counts.tolist() if isinstance(counts, torch.Tensor) else counts


def per_group(fn: Callable, x: torch.Tensor, counts: list[int] | torch.Tensor, n: int, dtype: torch.dtype):
    """fn(rows, g) -> [rows, n] over each group's rows of x, packed by group (counts[g] rows each, read on
    the host); rows past the counts' sum (a fixed-size buffer's unused tail) come out zero."""
    counts = host_counts(counts)
    tail = x.shape[0] - sum(counts)
    parts = [fn(part, g) for g, part in enumerate(x.split([*counts, tail])[:-1]) if part.shape[0]]
    return torch.cat([*parts, x.new_zeros(tail, n, dtype=dtype)])


def grouped_reference(x, weight, counts: list[int] | torch.Tensor):
    return per_group(lambda part, g: F.linear(part, weight[g]), x, counts, weight.shape[1], x.dtype)


def grouped_kernel(spec: ExecutionSpec, op: str = "linear") -> bool:
    """True where grouped_linear is one grouped-GEMM launch rather than a GEMM per group: our kernels on
    consistent CUDA (quantised too), torch._grouped_mm (where this torch has it) on baseline CUDA BF16
    (quantised: on the dequantised operands)."""
    linear_op = spec.op(op)
    if spec.device != "cuda":
        return False
    if spec.mode == "consistent":
        return True
    return linear_op.dtype == "bfloat16" and hasattr(torch, "_grouped_mm")


def grouped_experts(spec: ExecutionSpec, op: str = "linear") -> bool:
    """True where the MoE experts run through grouped_linear rather than a linear() per expert: where it is
    one launch, and for quantised experts on every backend (their stacked weights quantised once per
    version, the groups looped over where no grouped kernel runs)."""
    return grouped_kernel(spec, op) or is_quantised(spec.op(op))


def grouped_on_device(spec: ExecutionSpec, weight: torch.Tensor, op: str = "linear") -> bool:
    """True where grouped_linear over `weight` [G, N, K] reads tensor counts on the device only (no host
    sync, shapes fixed by x's: a CUDA graph can hold it): our kernel, or torch._grouped_mm where it takes
    the shapes, from SM90 on (below, its fallback reads the offsets on the host)."""
    if not grouped_kernel(spec, op):
        return False
    if spec.mode == "consistent":
        return True
    hopper = weight.device.type != "cuda" or torch.cuda.get_device_capability(weight.device) >= (9, 0)
    return hopper and stock_grouped_fits(weight.new_empty(1, weight.shape[2]), weight)


def grouped_linear(spec: ExecutionSpec, x: torch.Tensor, weight: torch.Tensor, counts: list[int] | torch.Tensor,
                   op: str = "linear", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K], rows packed by group (counts[g] rows each), weight [G, N, K] -> [M, N]: each group's
    rows through linear() against weight[g], bit for bit, whatever the backend (baseline: close).
    counts may be a tensor on x's device (the MoE dispatch's): the grouped launches read it there, with
    no host sync; the per-group loop reads it on the host. Such counts may sum to less than M (a fixed-size
    buffer): the rows past them are left unwritten by the grouped launches, zero by the loop."""
    out_dtype = out_dtype or x.dtype
    reference = lambda x, w: grouped_reference(x, w, counts).to(out_dtype)
    if is_quantised(spec.op(op)):
        return apply_kernel(lambda x, w: grouped_quant_linear(spec, x, w, counts, out_dtype, op), reference, x, weight)
    make = GROUPED.get((spec.mode, spec.device)) if grouped_kernel(spec, op) else None
    if make is None or (make is stock_grouped_kernel and not stock_grouped_fits(x, weight)):
        return per_group(lambda part, g: linear(spec, part, weight[g], op=op, out_dtype=out_dtype),
                         x, counts, weight.shape[1], out_dtype)
    return apply_kernel(make(counts, out_dtype), reference, x, weight)


def grouped_cuda_kernel(counts, out_dtype: torch.dtype) -> Callable:
    from onepath.ops.cuda.linear_grouped import linear_grouped

    return lambda x, w: linear_grouped(x, w, counts, out_dtype=out_dtype)


def stock_grouped_kernel(counts, out_dtype: torch.dtype) -> Callable:
    # BF16 out, then cast: the rounding the baseline's linear() per group gives the FP32 down projection
    return lambda x, w: stock_grouped(x, w, counts).to(out_dtype)


# (mode, device) -> grouped kernel factory (counts, out_dtype) -> kernel(x, w); elsewhere linear() per group
GROUPED = {
    ("consistent", "cuda"): grouped_cuda_kernel,
    ("baseline", "cuda"): stock_grouped_kernel,
}
