"""rope: rotary position embedding (neox / Hugging Face `rotate_half` layout).

Elementwise products with a cos/sin table indexed by absolute position: exact and position-free on every
backend, so one implementation serves both modes; KERNELS by (mode, device): `reference` on the CPU, the fused
Triton kernel of ops/cuda/rope.py on CUDA (the reference's bits). `qk_norm_rope` is Qwen3's QK-norm then RoPE over
q's and k's heads side by side: rmsnorm() then rope() on each, on CUDA in one launch with their bits
(ops/cuda/rmsnorm.qk_norm_rope). Backward: `reference`.
"""
from __future__ import annotations

import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops import rmsnorm as _rmsnorm
from onepath.ops.autograd import apply_kernel
from onepath.ops.host import capturing


def reference(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rope(spec: ExecutionSpec, x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
         sin_table: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; tables: [max_positions, head_dim // 2] FP32."""
    if positions.numel() and not capturing(positions) and int(positions.max()) >= cos_table.shape[0]:
        raise ValueError(f"position {int(positions.max())} >= the RoPE table's {cos_table.shape[0]} positions: "
                         "raise max_model_len / max_position_embeddings")
    kernel = KERNELS[spec.mode, spec.device](positions, cos_table, sin_table)
    return apply_kernel(kernel, lambda x: reference(x, cos_table[positions], sin_table[positions]), x)


def cuda(positions, cos_table, sin_table):
    from onepath.ops.cuda.rope import rope as triton_rope
    return lambda x: triton_rope(x, positions, cos_table, sin_table)


def cpu(positions, cos_table, sin_table):
    return lambda x: reference(x, cos_table[positions], sin_table[positions])


# (mode, device) -> kernel factory (positions, cos_table, sin_table) -> kernel(x)
KERNELS = {
    ("consistent", "cpu"): cpu,
    ("baseline", "cpu"): cpu,
    ("consistent", "cuda"): cuda,
    ("baseline", "cuda"): cuda,
}


def qk_norm_rope(spec: ExecutionSpec, x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_heads: int,
                 eps: float, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], q's heads then k's (Qwen3's QK-norm): each part RMS-normalised by its weight, then
    RoPE -> [T, heads, D]: the bits of rmsnorm() then rope() on each part, on CUDA in one launch."""
    unfused = by_part(q_heads, lambda part, w: _rmsnorm.reference(part, w, eps),
                      lambda part: reference(part, cos_table[positions], sin_table[positions]))
    kernel = QK_NORM_ROPE_KERNELS[spec.mode, spec.device](spec, q_heads, eps, positions, cos_table, sin_table)
    return apply_kernel(kernel, unfused, x, q_weight, k_weight)


def by_part(q_heads: int, norm, rotate):
    """(x, wq, wk) -> rotate(norm(part, w)) of q's heads and of k's, side by side."""
    return lambda x, wq, wk: torch.cat([rotate(norm(part, w)) for part, w in
                                        ((x[:, :q_heads], wq), (x[:, q_heads:], wk))], dim=1)


def qk_norm_rope_cuda(spec, q_heads, eps, positions, cos_table, sin_table):
    from onepath.ops.cuda.rmsnorm import qk_norm_rope as triton_qk_norm_rope
    return lambda x, wq, wk: triton_qk_norm_rope(x, wq, wk, q_heads, eps, positions, cos_table, sin_table)


def qk_norm_rope_cpu(spec, q_heads, eps, positions, cos_table, sin_table):
    return by_part(q_heads, lambda part, w: _rmsnorm.rmsnorm(spec, part, w, eps),
                   lambda part: rope(spec, part, positions, cos_table, sin_table))


# (mode, device) -> kernel factory -> kernel(x, q_weight, k_weight): one launch on CUDA, the two ops elsewhere
QK_NORM_ROPE_KERNELS = {
    ("consistent", "cpu"): qk_norm_rope_cpu,
    ("baseline", "cpu"): qk_norm_rope_cpu,
    ("consistent", "cuda"): qk_norm_rope_cuda,
    ("baseline", "cuda"): qk_norm_rope_cuda,
}


def interleaved_reference(x, cos, sin):
    """DeepSeek-V4's partial RoPE: the trailing 2 * cos.shape[-1] channels of x rotated in adjacent pairs
    (2i, 2i+1), the leading ones left as they are. The pairs are the halves `reference` rotates, so the
    arithmetic is reference's (x_a * c - x_b * s, x_b * c + x_a * s in FP32, one rounding)."""
    rotated = 2 * cos.shape[-1]
    if rotated == 0:
        return x
    pairs = x[..., x.shape[-1] - rotated:].unflatten(-1, (-1, 2))
    out = reference(torch.cat([pairs[..., 0], pairs[..., 1]], dim=-1), cos, sin)
    out = torch.stack(out.chunk(2, dim=-1), dim=-1).flatten(-2)
    return torch.cat([x[..., :x.shape[-1] - rotated], out], dim=-1)


def rope_interleaved(spec: ExecutionSpec, x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                     sin_table: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; tables: [max_positions, rotated // 2] FP32: rotate the trailing `rotated`
    channels of each head in adjacent pairs (interleaved_reference); inverse: by -sin, which undoes it."""
    if positions.numel() and not capturing(positions) and int(positions.max()) >= cos_table.shape[0]:
        raise ValueError(f"position {int(positions.max())} >= the RoPE table's {cos_table.shape[0]} positions: "
                         "raise max_model_len / max_position_embeddings")
    sign = -1.0 if inverse else 1.0
    kernel = INTERLEAVED_KERNELS[spec.mode, spec.device](positions, cos_table, sin_table, sign)
    return apply_kernel(kernel, lambda x: interleaved_reference(x, cos_table[positions], sign * sin_table[positions]),
                        x)


def interleaved_torch(positions, cos_table, sin_table, sign):
    return lambda x: interleaved_reference(x, cos_table[positions], sign * sin_table[positions])


# (mode, device) -> kernel factory (positions, cos_table, sin_table, sign) -> kernel(x): elementwise products, exact on
# both devices, so the torch code serves every backend until a fused kernel lands
INTERLEAVED_KERNELS = dict.fromkeys([("consistent", "cpu"), ("baseline", "cpu"), ("consistent", "cuda"),
                                     ("baseline", "cuda")], interleaved_torch)
