"""rope: rotary position embedding (neox / Hugging Face `rotate_half` layout).

Elementwise products with a cos/sin table indexed by absolute position: exact and
position-free on every backend, so one implementation serves both modes (the fused Triton kernel on CUDA).
"""
from __future__ import annotations

import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel, capturing


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
    if spec.device == "cuda":
        from onepath.ops.cuda.elementwise import rope as triton_rope
        kernel = lambda x: triton_rope(x, positions, cos_table, sin_table)
    else:
        kernel = lambda x: reference(x, cos_table[positions], sin_table[positions])
    return apply_kernel(kernel, lambda x: reference(x, cos_table[positions], sin_table[positions]), x)
