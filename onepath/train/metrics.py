"""MetricsLogger: one step's metrics to metrics.jsonl, TensorBoard, a console row and (optionally) W&B; Timer."""
from __future__ import annotations

import json
import math
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from onepath.train.data import read_jsonl

# (metric, header, width): the console row; every metric still goes to metrics.jsonl and TensorBoard.
CONSOLE_COLUMNS = (
    ("step", "step", 6),
    ("critic/score/mean", "score", 9),
    ("response_length/mean", "resp_len", 9),
    ("training/rollout_probs_diff_max", "max|dp|", 10),
    ("rollout_corr/k3_kl", "k3_kl", 10),
    ("actor/pg_loss", "pg_loss", 10),
    ("actor/grad_norm", "grad_norm", 10),
    ("perf/rollout_tokens_per_s", "tok/s", 9),
)
HEADER_EVERY = 20


class MetricsLogger:
    """`wandb`: wandb.init's arguments to log every record there too, or None."""

    def __init__(self, run_dir, tensorboard: bool = True, console: bool = True, purge_step: int | None = None,
                 wandb: dict | None = None, console_every: int = 1):
        """console_every: the console row every N steps (and at step 1); every step still goes to
        metrics.jsonl, TensorBoard and W&B."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a")  # append: a resumed run continues its own file
        # purge_step: a resumed run drops TensorBoard events from the steps it runs again
        self._writer = _summary_writer(self.run_dir / "tb", purge_step) if tensorboard else None
        self.console, self.console_every = console, console_every
        self._rows = 0
        self._wandb = require_wandb().init(**wandb) if wandb is not None else None

    def log(self, step: int, metrics: dict[str, float]):
        record = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._writer.add_scalar(key, value, int(step))
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=int(step))
        if self.console and (step == 1 or step % self.console_every == 0):
            if self._rows % HEADER_EVERY == 0:
                tqdm.write(format_header())
            tqdm.write(format_row(record))
            self._rows += 1

    def close(self):
        if not self._file.closed:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc):
        self.close()


def format_header() -> str:
    return " ".join(f"{header:>{width}}" for _, header, width in CONSOLE_COLUMNS)


def format_row(record: dict) -> str:
    return " ".join(f"{format_value(record.get(key)):>{width}}" for key, _, width in CONSOLE_COLUMNS)


def format_value(value) -> str:
    """Exact 0 prints as `0`: the consistency metrics must read as zero, and a 3.1e-08 must not."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or value == 0:
        return str(int(value))
    if not math.isfinite(value):
        return str(value)
    if 1e-3 <= abs(value) < 1e3:
        return f"{value:.4g}"
    if 1e3 <= abs(value) < 1e8:
        return f"{value:.0f}"
    return f"{value:.2e}"


def read_metrics(path) -> list[dict]:
    """The records of a metrics.jsonl (or of the run directory holding one), in order."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    return [record for _, record in read_jsonl(path)]


class Timer:
    """`with timer("gen"): ...` adds the wall time to `timing_s/gen`; `metrics()` returns and resets.
    `sync` (torch.cuda.synchronize on the GPU) runs at both ends of a timed block, so a block's time
    is its kernels', not their launch's; without it, end GPU work at a point that synchronises."""

    def __init__(self, sync=None):
        self._seconds: dict[str, float] = {}
        self._sync = sync

    @contextmanager
    def __call__(self, name: str):
        if self._sync is not None:
            self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            key = f"timing_s/{name}"
            self._seconds[key] = self._seconds.get(key, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        seconds, self._seconds = self._seconds, {}
        return seconds


def require_wandb():
    """The wandb module, or an error that says how to get it (logger.wandb is on)."""
    try:
        import wandb
    except ImportError as e:
        raise RuntimeError(f"logger.wandb is true but wandb cannot be imported ({e}): pip install wandb, "
                           "or set --logger.wandb false") from None
    return wandb


def _summary_writer(log_dir: Path, purge_step: int | None = None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        warnings.warn(f"TensorBoard logging is off ({e}): metrics go to metrics.jsonl only; "
                      "pip install tensorboard to get it back", stacklevel=3)
        return None
    return SummaryWriter(str(log_dir), purge_step=purge_step)


def _scalar(value):
    if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
        value = value.item()
    return value
