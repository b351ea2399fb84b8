"""One `onepath train` run: prepare once, train each mode into its directory, summarise (rank 0)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from onepath.config import RunConfig
from onepath.train import checkpoint, parallel, ray_launch
from onepath.train.metrics import read_metrics
from onepath.train.report import draw_report, run_label
from onepath.train.summary import summarise
from onepath.train.trainer import GRPOTrainer, prepare

BOTH = ("consistent", "baseline")


def run(cfg: RunConfig, resume: bool = False, progress: bool = True) -> int:
    """Exit status: 0 when the run ends and the consistent mode (if any) kept diff = 0, else 1.
    parallel.launcher ray: this process starts the run's Ray actors (train/ray_launch.py), each of which
    runs this loop."""
    if cfg.parallel.launcher == "ray" and ray_launch.WORKER_ENV not in os.environ:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            raise ValueError("parallel.launcher = 'ray' starts its own processes: run `onepath train ...` alone, "
                             "not under torchrun, or use parallel.launcher torchrun")
        return ray_launch.launch(cfg, run, resume, progress)
    out = Path(cfg.out)
    rank, size = parallel.start(cfg.device)
    try:
        run_dirs = mode_dirs(out, cfg.mode)  # before the warm start: a directory this run must not touch
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        world = parallel.world_for(cfg, rank, size)  # before the warm start: a layout the model cannot take
        setup = prepare(cfg, out, progress=progress, world=world)
        if cfg.train.steps == 0:  # the data and the warm start alone (out/warm_start), for runs to share
            if rank == 0:
                print(f"train.steps 0: prepared {out} (data, warm start), no RL step")
            return 0
        histories = {}
        for mode, run_dir in run_dirs.items():
            trainer = GRPOTrainer(cfg, mode, setup, run_dir, resume=resume, world=world)
            histories[mode] = trainer.run(progress=progress)
        if rank != 0:
            return 0
        runs = [out]
        if out not in run_dirs.values():  # a both-mode directory: summary and report keep the other mode
            histories = with_other_mode(out, histories)
            runs = [out / mode for mode in histories]
        ok = summarise(histories, out, time.perf_counter() - start)
        print(f"report: {draw_report(runs, out)}")
        return 0 if ok else 1
    finally:
        parallel.stop()


def mode_dirs(out: Path, mode: str) -> dict[str, Path]:
    """Each mode's run directory: out/consistent and out/baseline for --mode both; out for one mode, but
    out/MODE when out holds a --mode both run (resuming one of its modes finds that mode's checkpoints).
    ValueError when out holds a run of another mode: this one would overwrite its results."""
    if mode != "both" and any(holds_run(out / m) for m in BOTH):
        return {mode: out / mode}
    held = mode_of(out)
    if (held is not None and held != mode) or (mode == "both" and holds_run(out)):
        what = f"a --mode {held} run: resume it with --mode {held}, or" if held else "a one-mode run's checkpoints:"
        raise ValueError(f"{out} holds {what} give the --mode {mode} run another --out")
    return {m: out / m for m in BOTH} if mode == "both" else {mode: out}


def holds_run(path: Path) -> bool:
    """A run of `onepath train` started here: its spec.json (written before step 1) or a checkpoint."""
    return (path / "spec.json").is_file() or bool(checkpoint.complete_steps(path))


def mode_of(path: Path) -> str | None:
    """The mode of the run in path, from its spec.json (None without one)."""
    return run_label(path) if (path / "spec.json").is_file() else None


def with_other_mode(out: Path, histories: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """histories plus the steps the other mode of a both-mode directory logged, in BOTH's order; a mode
    with no step logged yet has no entry."""
    logged = {m: read_metrics(out / m) for m in BOTH if m not in histories and (out / m / "metrics.jsonl").is_file()}
    merged = {**histories, **logged}
    return {m: merged[m] for m in BOTH if merged.get(m)}
