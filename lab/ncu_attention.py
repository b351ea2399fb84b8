"""The decode attention kernel, launched a few times for Nsight Compute: batch 256, context 1024, Qwen3-0.6B
heads, a BF16 or FP8 cache (bench/kernels_attention.py's inputs). On the GPU:

    ncu --clock-control none -k regex:_paged_attention_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \\
        python lab/ncu_attention.py fp8 > lab/results/ncu-attention-decode-fp8.txt
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench import kernels_attention  # noqa: E402
from onepath.ops.cuda import attention  # noqa: E402


def main() -> int:
    kv = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    if kv not in ("bf16", "fp8"):
        print(f"ncu_attention: cache {kv!r} must be bf16 or fp8", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("ncu_attention: no CUDA device; nothing to profile")
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k_cache, v_cache, positions, seqs, tables, _, _ = kernels_attention._inputs(256, 1024, 1, gen, kv)
    for _ in range(3):
        attention.paged_attention(q, k_cache, v_cache, positions, seqs, tables, kernels_attention.HEAD_DIM ** -0.5,
                                  split_kv=False)
    torch.cuda.synchronize()
    print(f"ncu_attention: 3 launches over a {kv} cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
