"""The DeepSeek-V4 benches run on the CPU at tiny size: the rollout bench on the tiny-deepseek-v4 preset (both
modes generating every requested token, the cache's bytes per token reported by the engine, the recipe's 0.913
target applied), the top-k micro-benchmark (both timings real), the cache report."""
import json

from onepath.bench import deepseek_v4
from onepath.bench.summary import TARGETS
from onepath.bench.workloads import model_config
from onepath.models.deepseek_v4_config import DeepseekV4Config


def test_rollout_runs_on_a_tiny_deepseek_v4(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    assert deepseek_v4.main(["rollout", "--model", "tiny-deepseek-v4", "--device", "cpu", "--requests", "3",
                             "--scale", "0.01", "--decode-steps", "2", "--max-num-seqs", "4", "--threads", "1",
                             "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    entry = result["models"]["tiny-deepseek-v4"]
    assert result["options"]["quant"] == "fp8+fp8_kv+fp8_indexer" and entry["config"]["model_type"] == "deepseek_v4"
    for name in ("fixed-3000", "ragged"):
        row = entry["workloads"][name]
        for mode in ("consistent", "baseline"):
            r = row["modes"][mode]
            assert r["tokens_per_s"] > 0 and r["generated_tokens"] == row["output_tokens"], r
            assert r["memory"]["kv_bytes_per_token"] > 0 and r["memory"]["state_slots"] > 0
    assert {c["target"] for c in result["checks"] if c["name"] == "consistent/baseline tokens/s"} == {
        TARGETS["consistent_over_baseline_deepseek_v4"]}
    assert isinstance(model_config("deepseek-v4-flash-4l"), DeepseekV4Config)


def test_topk_and_cache_reports(capsys):
    timings = deepseek_v4.topk_timings(rows=3, length=700, k=64, device="cpu", repeats=2)
    assert timings["consistent_index_topk_us"] > 0 and timings["torch_topk_us"] > 0
    assert deepseek_v4.main(["cache", "--layers", "6"]) == 0
    assert json.loads(capsys.readouterr().out)["fp8_over_bf16"]["kv_per_token"] < 0.57
