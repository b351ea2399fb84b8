"""The long-episode bench on CUDA (Qwen3-0.6B's shape, BF16): two episodes of 8,192 tokens, diff = 0 on every
policy token before and after the update, the baseline differing, the trainer's peak per micro-batch setting
reported, the engine's KV cache sized by gpu_memory_utilization for both episodes."""
import json

import pytest
import torch

from onepath.bench import long_episode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_long_episodes_on_cuda(tmp_path):
    out = tmp_path / "long.json"
    assert long_episode.main(["--device", "cuda", "--episodes", "2", "--tokens", "8192", "--turn-tokens", "512",
                              "--reply-tokens", "1536", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    consistent, baseline = record["modes"]["consistent"], record["modes"]["baseline"]
    assert consistent["kv"]["episodes_that_fit"] >= 2 and consistent["kv"]["gpu_memory_utilization"] == 0.4
    for phase in ("before", "after"):
        assert consistent["diff"][phase]["exact"] and consistent["diff"][phase]["policy_tokens"] > 1000
        assert baseline["diff"][phase]["rollout_corr/tokens_differing_frac"] > 0
        assert all(e["tokens"] <= 8192 and e["turns"] >= 3 for e in consistent["rollouts"][phase]["episodes"])
    settings = consistent["trainer"]["settings"]
    assert all(s["peak_gib"] > s["peak_growth_gib"] > 0 for s in settings if "error" not in s)
    assert all(s["logprobs_equal_first_setting"] for s in settings if "error" not in s)
    assert consistent["trainer"]["weights_changed_frac"] > 0.5
