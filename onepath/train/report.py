"""report.png: reward, max |Δp| and k3 KL (symlog), rollout tokens/ms per step; runs side by side."""
from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from onepath.numerics.spec import MODES
from onepath.train.metrics import read_metrics
from onepath.train.summary import DIFF_KEYS, mode_summary

REWARD, PROBS_DIFF, K3_KL, TOKENS_PER_S = ("critic/score/mean", "training/rollout_probs_diff_max",
                                           "rollout_corr/k3_kl", "perf/rollout_tokens_per_s")
REQUIRED = (REWARD, TOKENS_PER_S)  # DIFF_KEYS only on verified steps (train.old_logprob)
SMOOTH = 5
# Linear below 1e-20, log above: an exact 0 is a flat line at 0, and the smallest drift a float32
# run shows (k3 KL ~ (6e-8)^2 / 2 / tokens ~ 1e-18) still lands decades above it, never on it.
LINTHRESH = 1e-20


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
        runs += sorted(children, key=lambda run: (_mode_rank(run_label(run)), str(run)))
    return runs


def run_label(run: Path) -> str:
    """The run's ExecutionSpec mode from spec.json, else its directory name."""
    spec = run / "spec.json"
    if not spec.is_file():
        return run.name
    try:
        return json.loads(spec.read_text()).get("spec", {}).get("mode", run.name)
    except json.JSONDecodeError as e:
        raise ValueError(f"{spec}: not JSON ({e.msg}); delete it to label the run by its directory") from None


def report_summary(runs) -> dict[str, dict]:
    """Per run label: train's mode_summary (steps, diff = 0 steps, max diffs, reward first/last 5) and run_dir."""
    return {label: {**mode_summary(history), "run_dir": str(run)}
            for label, run, history in _load(runs)}


def draw_report(runs, out) -> Path:
    """Draw report.png into directory `out` (or to `out` itself when it ends in .png); return its path."""
    loaded = _load(runs)
    out = Path(out)
    path = out if out.suffix == ".png" else out / "report.png"
    path.parent.mkdir(parents=True, exist_ok=True)

    fig = Figure(figsize=(17, 5), layout="constrained")  # no pyplot: no display, no global backend
    reward, drift, speed = fig.subplots(1, 3)
    for i, (label, _, history) in enumerate(loaded):
        # earlier runs draw wider, beneath later ones: equal curves (the two modes' rewards often
        # are) show as one line edged in the other's colour instead of one hiding the other
        color, wide = f"C{i % 10}", 1 + 0.8 * (len(loaded) - 1 - i)
        steps = [m["step"] for m in history]
        rewards = [m[REWARD] for m in history]
        reward.plot(steps, rewards, color=color, lw=0.8 * wide, alpha=0.4)
        reward.plot(steps, moving_average(rewards, SMOOTH), color=color, lw=2.2 * wide, label=label)
        verified = [m for m in history if all(k in m for k in DIFF_KEYS)]
        drift.plot([m["step"] for m in verified], [m[PROBS_DIFF] for m in verified], color=color, lw=2 * wide,
                   label=f"{label}: max |Δp|")
        drift.plot([m["step"] for m in verified], [m[K3_KL] for m in verified], color=color, lw=1.2 * wide, ls="--",
                   label=f"{label}: k3 KL")
        speed.plot(steps, [m[TOKENS_PER_S] / 1000 for m in history], color=color, lw=1.5 * wide, label=label)

    reward.set(title=f"reward (thin: per step, thick: {SMOOTH}-step mean)", xlabel="step", ylabel=REWARD)
    drift.set_yscale("symlog", linthresh=LINTHRESH)
    drift.set_ylim(bottom=-LINTHRESH)  # lifts an all-zero line off the axis edge
    drift.set(title=f"rollout vs trainer drift (symlog, linear below {LINTHRESH:g})", xlabel="step",
              ylabel=f"{PROBS_DIFF}\n{K3_KL}")
    speed.set(title="rollout throughput", xlabel="step", ylabel="rollout tokens / ms")
    speed.set_ylim(bottom=0)
    for ax in (reward, drift, speed):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=2, fontsize="small", frameon=False)
    fig.suptitle(" | ".join(_verdict(label, history) for label, _, history in loaded))
    fig.savefig(path, dpi=110)
    return path


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start, so the line begins at step 1)."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / min(i + 1, window) for i in range(len(values))]


def _load(runs) -> list[tuple[str, Path, list[dict]]]:
    loaded = []
    for run in find_runs(runs):
        history = read_metrics(run)
        if not history:
            raise ValueError(f"{run / 'metrics.jsonl'} has no steps yet: report after the first step is logged")
        for m in history:
            missing = [key for key in REQUIRED if key not in m]
            if missing:
                raise ValueError(f"{run / 'metrics.jsonl'} step {m.get('step')} lacks {', '.join(missing)}: "
                                 "was it written by `onepath train`?")
        loaded.append((run_label(run), run, history))
    labels = [label for label, _, _ in loaded]
    # two runs of one mode (say two seeds) keep apart by their directory
    return [(f"{label} ({run.name})" if labels.count(label) > 1 else label, run, history)
            for label, run, history in loaded]


def _verdict(label: str, history: list[dict]) -> str:
    s = mode_summary(history)
    text = f"{label}: diff = 0 on {s['steps_with_diff_exactly_0']}/{s['steps_verified']} verified steps"
    return text if s["max_probs_diff"] == 0 else f"{text} (max |Δp| {s['max_probs_diff']:.2g})"


def _mode_rank(label: str) -> int:
    return MODES.index(label) if label in MODES else len(MODES)
