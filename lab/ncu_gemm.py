"""gemm_power.py's GEMMs at one shape, each launched twice inside a profiler range, for Nsight Compute: our BF16
GEMM, cuBLAS BF16, our block-FP8 GEMM (WS_CONFIG, then each --ws-variant: lab/fp8_gluon.py names) and cuBLAS FP8
with one scale per tensor. On the GPU:

    ncu --profile-from-start off --set full \\
        python lab/ncu_gemm.py --shape 4096 4096 4096 > lab/results/ncu-gemm-4096.txt

(ncu locks the SM clock at its base by default, so the kernels compare per cycle, without the power limit's
clock.) Without CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from lab.gemm_power import kernels  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=3, default=[4096, 4096, 4096], metavar=("M", "N", "K"))
    p.add_argument("--ws-variant", nargs="+", default=[], help="more block-FP8 configs (lab/fp8_gluon.py names)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("ncu_gemm: no CUDA device; nothing to profile")
        return 0
    calls = kernels(*args.shape, args.ws_variant)
    for call in calls.values():  # compiled and autotuned outside the profiled range
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, call in calls.items():
        print(f"ncu_gemm: {name} twice", flush=True)
        call()
        call()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
