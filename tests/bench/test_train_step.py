"""bench/train_step.py --tiny: the training-step benchmark runs on the CPU and writes its JSON."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_step_benchmark_tiny(tmp_path):
    out = tmp_path / "train-step.json"
    done = subprocess.run([sys.executable, "bench/train_step.py", "--tiny", "--micro-batch-tokens", "60",
                           "--recompute", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": ""})
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert set(record["results"]) == {"consistent", "baseline", "stock"}
    assert record["ratio_consistent_over_baseline"] > 0 and record["command"].startswith("python bench/train_step.py")
    assert record["attention_backward"]["reference_s_all_layers"] > 0
    assert {"forward", "loss_and_backward", "optimizer"} == set(record["results"]["consistent"]["phases_median_s"])
