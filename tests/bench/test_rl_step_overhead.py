"""bench/rl_step_overhead.py on the CPU: it trains both modes per old-log-prob policy and reports
real step times and their ratio (the GPU numbers come from the same code)."""
import json
from pathlib import Path

from onepath.bench import rl_step_overhead as bench

ROOT = Path(__file__).resolve().parents[2]


def test_rl_step_overhead_smoke(tmp_path):
    out = tmp_path / "rl.json"
    code = bench.main(["--config", str(ROOT / "onepath/configs/demo.yaml"), "--device", "cpu", "--steps", "2",
                       "--skip-steps", "1", "--policies", "skip", "--repeats", "2", "--work", str(tmp_path / "runs"),
                       "--out", str(out), "--set", "train.prompts_per_step=4", "--set", "warm_start.steps=2",
                       "--set", "rollout.n=2"])
    assert code == 0
    row = json.loads(out.read_text())["policies"]["skip"]
    assert row["consistent"]["step"] > 0 and row["baseline"]["step"] > 0
    assert row["overhead"] == row["consistent"]["step"] / row["baseline"]["step"] - 1
    assert len(row["overhead_per_repeat"]) == 2
    # each mode ran in a run of its own per repeat, the second repeat in the other order
    runs = sorted(p.name for p in (tmp_path / "runs" / "skip").iterdir())
    assert runs == ["r0-baseline", "r0-consistent", "r1-baseline", "r1-consistent"]
    assert (tmp_path / "runs" / "skip" / "r1-baseline" / "metrics.jsonl").stat().st_mtime <= \
        (tmp_path / "runs" / "skip" / "r1-consistent" / "metrics.jsonl").stat().st_mtime
