"""The closing summary of a run: is every diff exactly 0, how far the baseline drifts, did reward rise."""
from __future__ import annotations

import json
from pathlib import Path

DIFF_KEYS = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std",
             "rollout_corr/k3_kl", "rollout_corr/logprob_abs_diff_max", "rollout_corr/tokens_differing_frac")
# the step's timed phases (trainer.py's Timer keys, timing_s/<phase>)
PHASES = ("gen", "old_logprob", "update", "sync", "reward")


def wall_time(history: list[dict]) -> dict | None:
    """The run's logged time: total = the steps' timing_s/step plus the validations' timing_s/val, with
    its split into PHASES, val and the step's other work; None when no step logged timing_s/step.
    Checkpoint saves and the warm start are outside it."""
    if not any("timing_s/step" in m for m in history):
        return None

    def total(key):
        return sum(m.get(f"timing_s/{key}", 0.0) for m in history)

    steps = total("step")
    split = {key: total(key) for key in (*PHASES, "val") if any(f"timing_s/{key}" in m for m in history)}
    split["other"] = max(steps - sum(v for k, v in split.items() if k in PHASES), 0.0)
    return {"total_s": steps + split.get("val", 0.0), "split_s": split}


def mode_summary(history: list[dict]) -> dict:
    """Diff figures are over the steps that measured them (train.old_logprob every_n / skip measure fewer). A
    step-0 record (train.val_before_train: a validation alone) counts in the val scores and the wall time only."""
    scores = [m["val/score"] for m in history if "val/score" in m]
    wall = wall_time(history)
    history = [m for m in history if m.get("step") != 0]
    rewards = [m["critic/score/mean"] for m in history]
    verified = [m for m in history if all(k in m for k in DIFF_KEYS)]
    exact = [all(m[k] == 0.0 for k in DIFF_KEYS) for m in verified]
    head, tail = rewards[:5], rewards[-5:]
    return {
        "steps": len(history),
        "steps_verified": len(verified),
        "steps_with_diff_exactly_0": sum(exact),
        "max_probs_diff": max((m["training/rollout_probs_diff_max"] for m in verified), default=0.0),
        "max_k3_kl": max((m["rollout_corr/k3_kl"] for m in verified), default=0.0),
        "reward_first5": sum(head) / max(len(head), 1),
        "reward_last5": sum(tail) / max(len(tail), 1),
        "rollout_tokens_per_s": sum(m["perf/rollout_tokens_per_s"] for m in history) / max(len(history), 1),
        "val_score_last": scores[-1] if scores else None,
        "wall": wall,
    }


def summarise(histories: dict[str, list[dict]], out: Path, seconds: float) -> bool:
    """Print and write summary.json; True when the consistent run (if any) kept diff = 0 on every step."""
    summary = {mode: mode_summary(h) for mode, h in histories.items()}
    summary["wall_seconds"] = seconds
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nonepath run summary ({seconds:.0f} s)")
    print(f"{'mode':<11} {'steps':>5} {'diff=0 steps':>12} {'max|dp|':>10} {'max k3':>10} "
          f"{'reward 1-5':>10} {'last 5':>7} {'tok/s':>8}")
    for mode, s in summary.items():
        if mode == "wall_seconds":
            continue
        print(f"{mode:<11} {s['steps']:>5} {s['steps_with_diff_exactly_0']:>12} {s['max_probs_diff']:>10.3g} "
              f"{s['max_k3_kl']:>10.3g} {s['reward_first5']:>10.3f} {s['reward_last5']:>7.3f} "
              f"{s['rollout_tokens_per_s']:>8.0f}")
    consistent = summary.get("consistent")
    ok = consistent is None or consistent["steps_with_diff_exactly_0"] == consistent["steps_verified"]
    if consistent is not None:
        verdict = "every diff metric exactly 0 on every step" if ok else "DIFF != 0: the contract is broken"
        if not consistent["steps_verified"]:
            verdict = "diff not measured (train.old_logprob skip)"
        elif ok and consistent["steps_verified"] < consistent["steps"]:
            verdict = f"every diff metric exactly 0 on the {consistent['steps_verified']} verified steps (train.old_logprob)"
        print(f"consistent: {verdict}")
    return ok
