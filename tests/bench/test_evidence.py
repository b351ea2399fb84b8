"""bench/evidence.sh end to end on the CPU at toy size: one shared warm start, the four runs (consistent with the
FP8 formats on both sides, the FP8-rollout / unquantised-trainer baseline, with TIS, with MIS) and the figure."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onepath.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
SMALL = ("--quant fp8 --warm_start.steps 10 --train.steps 2 --train.prompts_per_step 4 --rollout.n 2 "
         "--data.n_train 40 --data.n_test 4 --quiet")


NAMES = ("consistent", "baseline", "baseline-tis", "baseline-mis")


def evidence(out: Path, concurrent: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "EVIDENCE_ARGS": SMALL, "PYTHON": os.environ.get("PYTHON", "python"), "OMP_NUM_THREADS": "1",
           "EVIDENCE_CONCURRENT": "2" if concurrent else "1"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    done = subprocess.run(["bash", "bench/evidence.sh", "onepath/configs/demo.yaml", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def sequential(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("evidence")
    evidence(out)
    return out


def test_evidence_script_runs_the_four_runs_from_one_warm_start(sequential):
    tmp_path = sequential
    runs = {name: read_metrics(tmp_path / name) for name in NAMES}
    assert all(len(h) == 2 for h in runs.values())
    assert all(m["training/rollout_probs_diff_max"] == 0 and m["rollout_corr/k3_kl"] == 0 for m in runs["consistent"])
    assert all(m["training/rollout_probs_diff_max"] > 0 for m in runs["baseline"])
    assert all("rollout_corr/rollout_is_mean" in m for m in runs["baseline-tis"])
    assert all("rollout_corr/rollout_rs_masked_fraction" in m for m in runs["baseline-mis"])
    spec = json.loads((tmp_path / "baseline" / "spec.json").read_text())
    assert spec["hash"] != spec["trainer_hash"]  # FP8 rollout, unquantised trainer
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((tmp_path / "evidence.json").read_text())
    assert record["command"].startswith("bash bench/evidence.sh onepath/configs/demo.yaml")
    assert record["runs"]["consistent (fp8)"]["steps_with_diff_exactly_0"] == 2
    assert all(run["wall"]["total_s"] > 0 for run in record["runs"].values())
    # one warm start: every run started from out/warm_start's weights
    import yaml
    shared = str(tmp_path / "warm_start")
    assert all(yaml.safe_load((tmp_path / n / "config.yaml").read_text())["model"]["path"] == shared for n in runs)
    assert not any((tmp_path / n / "warm_start").exists() for n in runs)


def outcome(metrics: dict) -> dict:
    """A step's record less its timings (what a run computed, not how long it took)."""
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/"))}


def test_concurrent_runs_compute_what_the_runs_one_after_another_do_and_a_rerun_keeps_them(sequential, tmp_path):
    evidence(tmp_path, concurrent=True)
    for name in NAMES:
        assert (tmp_path / f"{name}.log").stat().st_size > 0
        together, alone = read_metrics(tmp_path / name), read_metrics(sequential / name)
        assert [outcome(m) for m in together] == [outcome(m) for m in alone] and len(alone) == 2
    # run again on the same OUT: every run is finished, so each is kept as it is
    before = {name: (tmp_path / name / "metrics.jsonl").read_text() for name in NAMES}
    evidence(tmp_path)
    assert {name: (tmp_path / name / "metrics.jsonl").read_text() for name in NAMES} == before
