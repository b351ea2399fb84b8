"""compress: DeepSeek-V4's gated pooling of a window of token rows into one compressed entry, in FP32.

An entry pools S slots (the m tokens of its window; CSA: the previous window's m tokens too), channel by
channel, with softmax weights over the slots of the gate plus a learned per-slot bias:
    entry_c = sum_s kv_sc * softmax_s(gate_sc + bias_sc)
Invalid slots (CSA's first window has no previous one) weigh exactly zero. The entry is then normalised and
rotated by the model (ops.rmsnorm, ops.rope_interleaved).

consistent: exp on fixed-shape pieces, the two sums over the slots as a fixed tree; every entry is computed
alone from its own slots, so its bits do not depend on how many windows close in the same launch or in which
phase. consistent CUDA: the Triton kernel of ops/cuda/compressor.py, this recipe step for step (one program per
entry and block of channels; its exp is the GPU's). baseline: torch.softmax and a sum over the slots, as the stock
module runs it. The result is rounded once to kv's dtype. Backward: `reference`.
"""
from __future__ import annotations

import math

import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import pinned_unary, tree_sum


def reference(kv, gate, bias, valid):
    g = torch.where(valid[..., None], gate.float() + bias.float(), -math.inf)
    weights = torch.softmax(g, dim=1)
    return (torch.where(valid[..., None], kv.float(), 0.0) * weights).sum(dim=1).to(kv.dtype)


def consistent(kv, gate, bias, valid):
    g = torch.where(valid[..., None], gate.float() + bias.float(), -math.inf)           # [E, S, C]
    e = pinned_unary(torch.exp, g - g.amax(dim=1, keepdim=True))
    weights = e / tree_sum(e.movedim(1, -1)).unsqueeze(1)
    pooled = tree_sum((torch.where(valid[..., None], kv.float(), 0.0) * weights).movedim(1, -1))
    return pooled.to(kv.dtype)


def cuda_consistent(kv, gate, bias, valid):
    from onepath.ops.cuda.compressor import compress as triton_compress
    return triton_compress(kv, gate, bias, valid)


# (mode, device) -> kernel(kv, gate, bias, valid)
KERNELS = {
    ("consistent", "cpu"): consistent,
    ("consistent", "cuda"): cuda_consistent,
    ("baseline", "cpu"): reference,
    ("baseline", "cuda"): reference,
}


def compress(spec: ExecutionSpec, kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor,
             valid: torch.Tensor) -> torch.Tensor:
    """kv, gate [E, S, C] (E windows of S slots); bias [S, C] FP32; valid [E, S] bool -> entries [E, C]."""
    if kv.shape != gate.shape or kv.shape[1:] != bias.shape or kv.shape[:2] != valid.shape:
        raise ValueError(f"compress: kv {tuple(kv.shape)}, gate {tuple(gate.shape)}, bias {tuple(bias.shape)} and "
                         f"valid {tuple(valid.shape)} must be [E, S, C], [E, S, C], [S, C] and [E, S]")
    kernel = KERNELS[spec.mode, spec.device]
    return apply_kernel(lambda k, g, b: kernel(k, g, b, valid), lambda k, g, b: reference(k, g, b, valid),
                        kv, gate, bias)
