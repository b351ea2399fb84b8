"""The hybrid's benchmarks run on the CPU at tiny size (their GPU numbers come from the device): `onepath bench rollout`
on the tiny-hybrid preset (both modes generate every token; the decode roofline counts each sequence's recurrent
state), the Nemotron-3-Nano preset's published shape, and bench/kernels_ssd.py's decode replay vs one-step rows per
context and chunk offset and its prefill rows against the HBM and tensor-core bounds."""
import json
import math

import torch

from onepath.bench import kernels_ssd
from onepath.bench.roofline import recurrent_state_bytes
from onepath.bench.workloads import model_config
from onepath.cli import main
from onepath.models.config import NemotronHConfig

REQUESTS = 3


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_rollout_bench_tiny_hybrid_cpu(tmp_path):
    out = tmp_path / "rollout.json"
    assert main(["bench", "rollout", "--model", "tiny-hybrid", "--device", "cpu", "--requests", str(REQUESTS),
                 "--scale", "0.01", "--decode-steps", "3", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
                 "--workloads", "fixed-1000,ragged", "--no-hf", "--out", str(out)]) in (0, 1)  # 1: targets unmet
    entry = json.loads(out.read_text())["models"]["tiny-hybrid"]
    assert entry["config"]["model_type"] == "nemotron_h"
    for row in entry["workloads"].values():
        for mode in ("consistent", "baseline"):
            m = row["modes"][mode]
            assert "error" not in m and m["generated_tokens"] == row["output_tokens"], m
            assert m["memory"]["state_slots"] == 8 and positive(m["memory"]["state_cache_gib"])
        assert positive(row["consistent_over_baseline"]) and positive(row["roofline"]["recurrent_bytes"])
    config = model_config("tiny-hybrid")
    assert entry["workloads"]["fixed-1000"]["roofline"]["recurrent_bytes"] == \
        REQUESTS * recurrent_state_bytes(config, torch.float32)


def test_the_nemotron_3_nano_preset_is_the_published_shape_cut_to_13_layers():
    c = model_config("nemotron-3-nano-13l")
    assert isinstance(c, NemotronHConfig) and c.num_hidden_layers == 13
    kinds = c.layers_block_type
    assert (kinds.count("linear_attention"), kinds.count("moe"), kinds.count("full_attention")) == (6, 5, 2)
    assert (c.hidden_size, c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size, c.chunk_size) == \
        (2688, 64, 64, 8, 128, 128)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.routed_scaling_factor) == \
        (128, 6, 1856, 2.5)


def test_kernels_ssd_runs_on_the_cpu(tmp_path):
    out = tmp_path / "ssd.json"
    assert kernels_ssd.main(["--device", "cpu", "--reps", "1", "--batches", "2", "--offsets", "0", "5", "15",
                             "--prefill", "2x20", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["shape"] == kernels_ssd.TINY and len(r["decode"]) == 3
    for row in r["decode"]:
        assert row["position"] % 16 == row["offset"]
        assert all(positive(row[k]) for k in ("replay_us", "one_step_us", "replay_over_one_step", "replay_bytes"))
    assert r["decode"][0]["replay_bytes"] < r["decode"][2]["replay_bytes"]  # the open chunk grows with the offset
    (p,) = r["prefill"]
    assert p["tokens"] == 40 and all(positive(p[k]) for k in ("us", "tflops", "gb_s", "fraction_of_bound"))
