"""Triton kernels for CUDA (Hopper): the consistent backend on the GPU, one module per operator.

This file holds the launch facts every kernel module asks for: whether the interpreter runs the kernels,
how many SMs a persistent launch spreads over, and the row layouts a kernel reads."""
import functools
import os

import torch

# Programs of an interpreted (CPU) launch: small, so a persistent loop walks several tiles.
INTERPRET_NUM_SMS = 3
# The recurrent ops' per-sequence tensors (ops/spans.SpanTensors) sit at offsets of one staging copy that follow the
# batch size: their kernels do not specialise on those pointers' alignment, so every batch runs one binary.
SPAN_POINTERS = ["cu_ptr", "start_ptr", "slot_ptr", "row_seq_ptr"]


def interpreting() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1): no inline asm, no Gluon."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The SMs a persistent launch spreads its programs over (INTERPRET_NUM_SMS off CUDA)."""
    if device.type != "cuda":
        return INTERPRET_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x, or a contiguous copy where its last dim is strided (the kernels read rows of unit stride)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, n] with unit inner stride, a 16-byte aligned start and a row stride of whole 16-byte
    units, else a copy with rows padded to 16 bytes. The reduction kernels promise the compiler
    that alignment instead of specialising on the caller's strides, so every batch a row can sit
    in runs the same binary."""
    vec = 16 // x.element_size()
    if x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and (x.shape[0] <= 1 or x.stride(0) % vec == 0):
        return x
    padded = x.new_empty(x.shape[0], -(-x.shape[1] // vec) * vec)[:, :x.shape[1]]
    return padded.copy_(x)


def row_stride(x: torch.Tensor) -> int:
    # A single row's stride multiplies row 0 only; 0 keeps the alignment hint true for any layout.
    return x.stride(0) if x.shape[0] > 1 else 0
