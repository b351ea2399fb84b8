"""What goes around a benchmark's numbers: the machine and versions, the JSON file, the console table."""
from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch


def environment(device: str) -> dict:
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else f"CPU {platform.processor() or platform.machine()}"
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), gpu=gpu, device=device,
                torch=torch.__version__, triton=_version("triton"), transformers=_version("transformers"),
                cuda=torch.version.cuda, python=platform.python_version(), cpu_count=os.cpu_count())


KERNEL_TIMING = "triton.testing.do_bench median, L2 flushed"


def kernel_us(fn, rep_ms: int, graph: bool = False) -> float:
    """fn's median time in microseconds: triton.testing.do_bench (L2 flushed between calls, as a decode
    step reads each weight from HBM), or with graph the replays of a CUDA graph of fn (no launch cost)."""
    import triton.testing

    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e3


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except ImportError:
        return None


def save_json(result: dict, path: Path) -> None:
    """Rewritten whole after every measurement, through a rename: a run cut short leaves a valid file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    """Label columns (the first three) left-aligned, numbers right-aligned; a short row ends in a
    message (an error), printed as is."""
    cells = [[_cell(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in [header, *cells] if len(r) == len(header)) for i in range(len(header))]
    print(f"\n{title}")
    for row in [header, *cells]:
        aligned = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        if len(row) < len(header):
            aligned[-1] = row[-1]
        print("  ".join(aligned).rstrip())


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0 or 0.01 <= abs(value) < 100:
            return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2e}"
    return str(value)
