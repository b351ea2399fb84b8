"""bench/rl_step_overhead.py on the CPU: it trains both modes per old-log-prob policy and reports
real step times and their ratio (the GPU numbers come from the same code)."""
import json
from pathlib import Path

from bench import rl_step_overhead as bench

ROOT = Path(__file__).resolve().parents[2]


def test_rl_step_overhead_smoke(tmp_path):
    out = tmp_path / "rl.json"
    code = bench.main(["--config", str(ROOT / "onepath/configs/demo.yaml"), "--device", "cpu", "--steps", "2",
                       "--skip-steps", "1", "--policies", "skip", "--work", str(tmp_path / "runs"), "--out", str(out),
                       "--set", "train.prompts_per_step=4", "--set", "warm_start.steps=2", "--set", "rollout.n=2"])
    assert code == 0
    row = json.loads(out.read_text())["policies"]["skip"]
    assert row["consistent"]["step"] > 0 and row["baseline"]["step"] > 0
    assert row["overhead"] == row["consistent"]["step"] / row["baseline"]["step"] - 1
