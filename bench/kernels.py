"""Every GPU kernel against its stock counterpart, one table per operator family, JSON in bench/results/.

`python bench/kernels.py --out-dir bench/results` runs bench/kernels_{linear,fp8,attention,moe,pointwise,ssd}.py
in turn, each writing <out-dir>/<topic>/kernels-<name>.json (FOLDER; each also runs alone, with more options).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

PARTS = ("linear", "fp8", "attention", "moe", "pointwise", "ssd")
FOLDER = dict(linear="linear", fp8="linear", attention="attention", moe="moe", pointwise="pointwise", ssd="ssd")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--only", nargs="+", choices=PARTS, default=PARTS)
    args = p.parse_args()
    here = Path(__file__).parent
    status = 0
    for part in args.only:
        print(f"\n== {part} ==", flush=True)
        out = Path(args.out_dir) / FOLDER[part] / f"kernels-{part}.json"
        status |= subprocess.call([sys.executable, str(here / f"kernels_{part}.py"), "--out", str(out)])
    sys.exit(status)


if __name__ == "__main__":
    main()
