"""bench/moe_routing.py on the CPU: an embedded Qwen3-MoE trained a few steps, its routing agreement
recorded per step (the GPU run is the same code)."""
import json
from pathlib import Path

from onepath.bench import moe_routing as bench

ROOT = Path(__file__).resolve().parents[2]


def test_moe_routing_smoke(tmp_path):
    out = tmp_path / "routing.json"
    code = bench.main(["--config", str(ROOT / "onepath/configs/demo.yaml"), "--steps", "3", "--out", str(out),
                       "--set", "warm_start.steps=5", "--set", "train.prompts_per_step=4", "--set", "rollout.n=2"])
    assert code == 0
    result = json.loads(out.read_text())
    assert [s["step"] for s in result["steps"]] == [1, 2, 3] and result["all_steps_agree"]
    assert result["compared_tokens"] == sum(s["routing_compared_tokens"] for s in result["steps"]) > 0
    assert all(s["tokens_differing_frac"] == 0 for s in result["steps"])
