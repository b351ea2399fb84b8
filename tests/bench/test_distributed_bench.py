"""bench/distributed.py on the CPU (gloo): rollout on 1 and 2 processes, data-parallel and tensor-parallel,
and TP's row-parallel site, gather against all-reduce; real launches, real timings (the GPU numbers come
from the same code)."""
import json

from onepath.bench import distributed as bench


def test_distributed_bench_smoke(tmp_path):
    out = tmp_path / "distributed.json"
    code = bench.main(["--device", "cpu", "--parts", "rollout", "tp-reduce", "--processes", "1", "2", "--model", "tiny",
                       "--requests", "4", "--prompt-len", "8", "--output-len", "8", "--tokens", "1", "8", "--reps", "3",
                       "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["label"] == "cpu-functional" and "not how the layouts scale" in result["note"]
    rollout = result["parts"]["rollout"]
    assert [(r["layout"], r["processes"]) for r in rollout] == [("dp", 1), ("dp", 2), ("tp", 2)]
    assert all(r["tokens"] == 4 * 8 and r["tokens_per_s"] > 0 for r in rollout)  # every request once, every layout
    assert rollout[1]["scaling_efficiency"] == rollout[1]["tokens_per_s"] / rollout[0]["tokens_per_s"] / 2
    reduce = result["parts"]["tp-reduce"]
    assert [r["tokens"] for r in reduce] == [1, 8]
    assert all(r["gather_us"] > 0 and r["all_reduce_us"] > 0 for r in reduce)
