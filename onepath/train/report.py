"""report.png: train-inference KL and max |Δp| (symlog), reward, actor entropy, rollout throughput and
validation score per step, runs side by side; the per-run wall time and its split."""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from matplotlib.figure import Figure

from onepath.numerics.spec import MODES
from onepath.train.metrics import read_metrics
from onepath.train.summary import DIFF_KEYS, mode_summary

REWARD, PROBS_DIFF, K3_KL, TOKENS_PER_S = ("critic/score/mean", "training/rollout_probs_diff_max",
                                           "rollout_corr/k3_kl", "perf/rollout_tokens_per_s")
ENTROPY, VAL_SCORE = "actor/entropy", "val/score"  # optional: older runs lack entropy, val_every 0 runs val
REQUIRED = (REWARD, TOKENS_PER_S)  # DIFF_KEYS only on verified steps (train.old_logprob)
SMOOTH = 5
# Linear below 1e-20, log above: an exact 0 is a flat line at 0, and the smallest drift a float32
# run shows (k3 KL ~ (6e-8)^2 / 2 / tokens ~ 1e-18) still lands decades above it, never on it.
LINTHRESH = 1e-20
CORRECTIONS = ("", "+TIS", "+MIS", "+TIS+MIS")  # the figure's order within a mode
# Timer phases inside timing_s/step, then val, which the trainer times after the step
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def find_runs(paths) -> list[Path]:
    """Run directories (holding metrics.jsonl) named by `paths`, each a run or a parent of runs."""
    runs = []
    for path in map(Path, paths):
        if path.name == "metrics.jsonl" and path.is_file():
            path = path.parent
        if (path / "metrics.jsonl").is_file():
            runs.append(path)
            continue
        children = [p.parent for p in path.glob("*/metrics.jsonl")] if path.is_dir() else []
        if not children:
            raise FileNotFoundError(f"{path}: no metrics.jsonl in it or in its subdirectories; pass a run "
                                    "directory of `onepath train --out DIR` (DIR/consistent, DIR/baseline) or DIR")
        runs += sorted(children, key=lambda run: (_rank(run_kind(run)), str(run)))
    return runs


def run_label(run: Path) -> str:
    """The run's ExecutionSpec mode from spec.json, else config.yaml's mode, else its directory name."""
    return _spec(run).get("mode") or run_config(run).get("mode") or run.name


def run_kind(run: Path) -> str:
    """The mode and the rollout correction config.yaml turns on: baseline, baseline+TIS, baseline+MIS."""
    train = run_config(run).get("train") or {}
    tis, mis = train.get("rollout_is") is not None, train.get("rollout_rs") is not None
    return run_label(run) + CORRECTIONS[tis + 2 * mis]


def run_formats(run: Path) -> tuple[str, str]:
    """(rollout, trainer) number formats: config.yaml's quant and trainer_quant (null: the same as
    quant; "none": unquantised), an unquantised side named by its spec's linear dtype (spec.json's
    spec, and its trainer_spec where the trainer's differs)."""
    cfg = run_config(run)
    rollout = cfg.get("quant") or _dtype(_spec(run))
    trainer = cfg.get("trainer_quant")
    if trainer is None:
        return rollout, rollout
    return rollout, (_dtype(_spec(run, "trainer_spec") or _spec(run)) if trainer == "none" else str(trainer))


def run_config(run: Path) -> dict:
    """The run's config.yaml as written by the trainer, or {} without one (an older run directory)."""
    path = run / "config.yaml"
    if not path.is_file():
        return {}
    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not YAML ({str(e).splitlines()[0]}); delete it to label the run by its "
                         "spec.json mode alone") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a mapping of config sections; delete it to label the run by its "
                         "spec.json mode alone")
    return cfg


def report_summary(runs) -> dict[str, dict]:
    """Per run label: train's mode_summary (steps, diff = 0 steps, max diffs, reward first/last 5, last
    val score, wall time) and run_dir."""
    return {label: {**mode_summary(history), "run_dir": str(run)}
            for label, run, history in _load(runs)}


def draw_report(runs, out) -> Path:
    """Draw report.png into directory `out` (or to `out` itself when it ends in .png); return its path."""
    fig = report_figure(runs)
    out = Path(out)
    path = out if out.suffix == ".png" else out / "report.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def report_figure(runs) -> Figure:
    """The report's Figure; each panel's Axes is labelled (kl, probs_diff, reward, entropy, throughput,
    val) and holds one line per run labelled with the run (a reward run also a thin per-step line)."""
    loaded = _load(runs)
    fig = Figure(figsize=(18, 9.5), layout="constrained")  # no pyplot: no display, no global backend
    (kl, diff, reward), (entropy, speed, val) = fig.subplots(2, 3)
    for ax, name in zip((kl, diff, reward, entropy, speed, val),
                        ("kl", "probs_diff", "reward", "entropy", "throughput", "val")):
        ax.set_label(name)
    for i, (label, _, history) in enumerate(loaded):
        # earlier runs draw wider, beneath later ones: equal curves (runs' rewards often are) show as
        # one line edged in the others' colours instead of one hiding the others
        style = dict(color=f"C{i % 10}", label=label)
        wide = 1 + 0.6 * (len(loaded) - 1 - i)
        steps, rewards = _series(history, REWARD)
        reward.plot(steps, rewards, color=style["color"], lw=0.8 * wide, alpha=0.35, label=f"_{label} per step")
        reward.plot(steps, moving_average(rewards, SMOOTH), lw=2.2 * wide, **style)
        verified = [m for m in history if all(k in m for k in DIFF_KEYS)]
        kl.plot(*_series(verified, K3_KL), lw=1.6 * wide, **style)
        diff.plot(*_series(verified, PROBS_DIFF), lw=1.6 * wide, **style)
        entropy.plot(*_series(history, ENTROPY), lw=1.4 * wide, **style)
        steps, speeds = _series(history, TOKENS_PER_S)
        speed.plot(steps, [s / 1000 for s in speeds], lw=1.4 * wide, **style)
        val.plot(*_series(history, VAL_SCORE), lw=1.2 * wide, marker="o", ms=3 + 1.5 * wide, **style)

    for ax, what in ((kl, f"train-inference KL (k3, symlog, linear below {LINTHRESH:g})"),
                     (diff, f"max |Δp| rollout vs trainer (symlog, linear below {LINTHRESH:g})")):
        ax.set_yscale("symlog", linthresh=LINTHRESH)
        ax.set_ylim(bottom=-LINTHRESH)  # lifts an all-zero line off the axis edge
        ax.set_title(what)
    kl.set_ylabel(K3_KL)
    diff.set_ylabel(PROBS_DIFF)
    reward.set(title=f"reward (thin: per step, thick: {SMOOTH}-step mean)", ylabel=REWARD)
    entropy.set(title="actor entropy (per token)", ylabel=ENTROPY)
    speed.set(title="rollout throughput", ylabel="rollout tokens / ms")
    speed.set_ylim(bottom=0)
    val.set(title="validation score (held-out split, every train.val_every steps)", ylabel=VAL_SCORE)
    for ax, key in ((entropy, ENTROPY), (val, VAL_SCORE)):
        if not any(line.get_xdata().size for line in ax.get_lines()):
            ax.text(0.5, 0.5, f"no run logged {key}", transform=ax.transAxes, ha="center", color="0.4")
    for ax in fig.axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.legend(*reward.get_legend_handles_labels(), loc="outside lower center", ncols=min(len(loaded), 4),
               frameon=False)
    fig.suptitle("\n".join(_verdict(label, history) for label, _, history in loaded))
    return fig


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start, so the line begins at step 1)."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / min(i + 1, window) for i in range(len(values))]


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    """The steps that logged `key` and its values there."""
    return [m["step"] for m in history if key in m], [m[key] for m in history if key in m]


def _load(runs) -> list[tuple[str, Path, list[dict]]]:
    """(label, run, history) per run in the figure's order: consistent, baseline, baseline+TIS,
    baseline+MIS, then others (a stable sort: ties keep the order given)."""
    loaded = []
    for run in find_runs(runs):
        history = read_metrics(run)
        if not history:
            raise ValueError(f"{run / 'metrics.jsonl'} has no steps yet: report after the first step is logged")
        for m in history:
            # step 0 (train.val_before_train) is a validation alone
            missing = [key for key in ((VAL_SCORE,) if m.get("step") == 0 else REQUIRED) if key not in m]
            if missing:
                raise ValueError(f"{run / 'metrics.jsonl'} step {m.get('step')} lacks {', '.join(missing)}: "
                                 "was it written by `onepath train`?")
        loaded.append((run_kind(run), run, history))
    loaded.sort(key=lambda item: _rank(item[0]))
    formats = [run_formats(run) for _, run, _ in loaded]
    if len(set(formats)) > 1:  # runs in different formats: each label says its own
        loaded = [(f"{label} ({_formats_text(*fmt)})", run, history)
                  for (label, run, history), fmt in zip(loaded, formats)]
    labels = [label for label, _, _ in loaded]
    # two runs of one kind (say two seeds) keep apart by their directory
    return [(f"{label} ({run.name})" if labels.count(label) > 1 else label, run, history)
            for label, run, history in loaded]


def _formats_text(rollout: str, trainer: str) -> str:
    return rollout if rollout == trainer else f"{rollout} rollout, {trainer} trainer"


def _spec(run: Path, key: str = "spec") -> dict:
    path = run / "spec.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text()).get(key) or {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg}); delete it to label the run by its config.yaml or "
                         "directory") from None


def _dtype(spec: dict) -> str:
    dtype = ((spec.get("ops") or {}).get("linear") or {}).get("dtype")
    return SHORT_DTYPES.get(dtype, dtype or "unquantised")


def _verdict(label: str, history: list[dict]) -> str:
    s = mode_summary(history)
    text = f"{label}: diff = 0 on {s['steps_with_diff_exactly_0']}/{s['steps_verified']} verified steps"
    return text if s["max_probs_diff"] == 0 else f"{text} (max |Δp| {s['max_probs_diff']:.2g})"


def _rank(kind: str) -> tuple[int, int]:
    """consistent, baseline, each without a correction, then +TIS, +MIS, +TIS+MIS; other kinds last."""
    for i, mode in enumerate(MODES):
        for j, correction in enumerate(CORRECTIONS):
            if kind == mode + correction:
                return i, j
    return len(MODES), 0
