"""One `onepath train` run: prepare once, train each mode into its directory, summarise (rank 0)."""
from __future__ import annotations

import time
from pathlib import Path

from onepath.config import RunConfig
from onepath.train import parallel
from onepath.train.report import draw_report
from onepath.train.summary import summarise
from onepath.train.trainer import GRPOTrainer, prepare


def run(cfg: RunConfig, resume: bool = False, progress: bool = True) -> int:
    """Exit status: 0 when the run ends and the consistent mode (if any) kept diff = 0, else 1."""
    out = Path(cfg.out)
    rank, size = parallel.start(cfg.device)
    try:
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        world = parallel.world_for(cfg, rank, size)  # before the warm start: a layout the model cannot take
        setup = prepare(cfg, out, progress=progress, world=world)
        modes = ("consistent", "baseline") if cfg.mode == "both" else (cfg.mode,)
        histories = {}
        for mode in modes:
            run_dir = out / mode if len(modes) > 1 else out
            trainer = GRPOTrainer(cfg, mode, setup, run_dir, resume=resume, world=world)
            histories[mode] = trainer.run(progress=progress)
        if rank != 0:
            return 0
        ok = summarise(histories, out, time.perf_counter() - start)
        print(f"report: {draw_report([out], out)}")
        return 0 if ok else 1
    finally:
        parallel.stop()
