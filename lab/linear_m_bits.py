"""At which row counts M does torch's CPU F.linear (FP32) give row 0 other bits than at M = 64, on this machine?
Answers why a baseline negative control that relies on M 3..15 moving bits holds on one CPU and not another.
    python lab/linear_m_bits.py --out lab/results/linear-m-bits-cpu.json
"""
import argparse
import json
import platform

import torch
import torch.nn.functional as F

SHAPES = [(24, 48), (48, 24), (48, 96), (64, 64), (1000, 1000)]  # (K, N): the tiny MoE's, then larger


def differing_ms(k: int, n: int, max_m: int = 64) -> list[int]:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(n, k, generator=g), torch.randn(max_m, k, generator=g)
    ref = F.linear(x, w)[0]
    return [m for m in range(1, max_m) if not torch.equal(F.linear(x[:m], w)[0], ref)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    result = {"command": "python lab/linear_m_bits.py --out lab/results/linear-m-bits-cpu.json",
              "torch": torch.__version__, "amx": "amx_tile" in flags, "avx512f": "avx512f" in flags,
              "differing_m_vs_64": {f"K{k}xN{n}": differing_ms(k, n) for k, n in SHAPES}}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
