"""torch._grouped_mm, the stock grouped GEMM the baseline runs for MoE experts (ops/linear.py's BF16 experts,
ops/linear_quant.py's quantised ones on their dequantised operands): one launch, the group offsets read on the
device from SM90 on, no row guarantee."""
from __future__ import annotations

import torch

from onepath.ops.host import to_device


def stock_grouped_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these operands: BF16 both, contiguous, rows present, and K and N
    whole multiples of 16 bytes (it reads weight[g] transposed, whose row stride is K, and writes rows of N)."""
    align = 16 // x.element_size()
    return (x.dtype == weight.dtype == torch.bfloat16 and x.is_contiguous() and weight.is_contiguous()
            and x.shape[0] > 0 and x.shape[-1] % align == 0 and weight.shape[1] % align == 0)


def stock_grouped(x: torch.Tensor, weight: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
    """x [M, K] BF16 packed by group, weight [G, N, K] -> [M, N] BF16 by one torch._grouped_mm."""
    if not isinstance(counts, torch.Tensor):
        counts = to_device(counts, torch.int64, x.device)
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=torch.cumsum(counts, 0).to(torch.int32))
