"""`onepath bench rollout` on the tiny presets (CPU, dense and MoE): every measurement a real positive number,
both modes generating every requested token, the HF reference the same model, a failed mode recorded not
fatal, the roofline reading the experts a batch touches, the CPU estimate printed first and counting the
tokens the engine runs."""
import argparse
import json
import math

import pytest
import torch

from onepath.bench import rollout
from onepath.bench.hf_generate import hf_model
from onepath.bench.roofline import HBM_PEAK_B_S, decode_roofline, experts_touched, weight_bytes
from onepath.bench.summary import TARGETS
from onepath.bench.workloads import MODELS, model_config
from onepath.cli import main
from onepath.engine.llm_engine import LLMEngine
from onepath.models.batch import ForwardBatch
from onepath.models import build_decoder
from onepath.models.config import ModelConfig
from onepath.models.dense import DenseDecoder
from onepath.models.kv_cache import KVCache
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops

REQUESTS = 3
SMALL = ["--model", "tiny", "--device", "cpu", "--requests", str(REQUESTS), "--scale", "0.01", "--decode-steps", "3",
         "--max-num-batched-tokens", "64", "--max-num-seqs", "8"]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_rollout_bench_tiny_cpu(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    assert main(["bench", "rollout", *SMALL, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "targets" in printed and "HF generate" in printed and f"wrote {out}" in printed
    r = json.loads(out.read_text())
    assert r["command"].startswith("onepath bench rollout --model tiny")
    assert all(r[k] for k in ("date", "gpu", "torch", "transformers"))
    tiny = r["models"]["tiny"]
    assert list(tiny["workloads"]) == ["fixed-1000", "ragged", "fixed-3000"]
    for name, row in tiny["workloads"].items():
        assert row["requests"] == REQUESTS and row["output_tokens"] >= REQUESTS
        for mode in ("consistent", "baseline"):
            m = row["modes"][mode]
            assert "error" not in m, m
            assert m["generated_tokens"] == row["output_tokens"], (name, mode)
            assert m["prompt_tokens"] == row["prompt_tokens"]
            assert all(positive(m[k]) for k in ("tokens_per_s", "total_tokens_per_s", "seconds", "steps")), m
            assert positive(m["memory"]["kv_bytes_per_token"]) and positive(m["memory"]["num_blocks"])
            profile = m["step_profile"]
            assert profile["steps"] >= m["steps"] and profile["seconds"] <= m["seconds"], (profile, m)
            assert profile["eager_steps"] + profile["graph_steps"] == profile["steps"]
            assert positive(row["roofline"]["fraction"][mode]["of_peak"])
        assert positive(row["consistent_over_baseline"])
        assert positive(row["roofline"]["tokens_per_s_peak"]) and positive(row["roofline"]["kv_bytes"])
    fixed = tiny["workloads"]["fixed-1000"]
    assert fixed["hf"]["generated_tokens"] == fixed["output_tokens"] and positive(fixed["hf"]["tokens_per_s"])
    assert positive(fixed["over_hf"]["consistent"]) and positive(fixed["over_hf"]["baseline"])
    assert "hf" not in tiny["workloads"]["ragged"]
    for mode, step in tiny["decode_steps"][0]["modes"].items():
        assert step["pure_decode"] and step["batch"] == REQUESTS and step["stats"]["prefill_tokens"] == 0, (mode, step)
        assert positive(step["seconds_per_step"]) and positive(step["fraction"]["of_peak"])
    names = [c["name"] for c in r["checks"]]
    assert names.count("consistent/baseline tokens/s") == 3 and "consistent/HF generate tokens/s" in names
    assert any(n.startswith(f"consistent decode step at batch {REQUESTS}") for n in names)
    assert all(isinstance(c["passed"], bool) for c in r["checks"])


def test_a_failing_mode_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    build = rollout.build_engine

    def out_of_memory(config, mode, *args):
        if mode == "consistent":
            raise RuntimeError("CUDA out of memory (simulated)")
        return build(config, mode, *args)

    monkeypatch.setattr(rollout, "build_engine", out_of_memory)
    out = tmp_path / "rollout.json"
    assert main(["bench", "rollout", *SMALL, "--workloads", "fixed-1000,ragged", "--no-hf", "--out", str(out)]) == 1
    tiny = json.loads(out.read_text())["models"]["tiny"]
    for row in tiny["workloads"].values():
        assert "simulated" in row["modes"]["consistent"]["error"]
        # the frames that raised it, innermost last: the test's stand-in, then the bench's call of it
        where = row["modes"]["consistent"]["where"]
        assert where[-1].startswith("tests/bench/test_rollout.py:") and where[-1].endswith(" out_of_memory")
        assert where[-2].startswith("onepath/bench/rollout.py:") and where[-2].endswith(" bench_engine")
        assert positive(row["modes"]["baseline"]["tokens_per_s"]) and "consistent_over_baseline" not in row
    assert "error: building or warming up the engine" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_hf_reference_is_the_same_model(name):
    """transformers' model built from the bench's weights gives onepath's logits (FP32, a few ulps)."""
    config = model_config(name)
    ours = build_decoder(config, Ops(ExecutionSpec.default("baseline", "cpu")), max_positions=64)
    ours.init_weights(seed=1, std=0.2)  # far from uniform: a swapped or mis-mapped tensor shows
    ref = hf_model(config, ours.hf_state_dict(), torch.float32, "cpu")
    tokens = torch.randint(0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    batch, num_blocks = ForwardBatch.for_sequences([tokens], 16)
    with torch.no_grad():
        got = ours.compute_logits(ours(batch, KVCache(config, num_blocks, 16, torch.float32)))
        want = ref(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        ref.model.layers[1].self_attn.k_norm.weight[0] += 1e-2  # negative control: a small slip shows
        slipped = ref(torch.tensor([tokens])).logits[0]
    assert not torch.allclose(got, slipped, rtol=1e-4, atol=1e-4)


def test_rollout_bench_tiny_moe_cpu(tmp_path):
    out = tmp_path / "rollout.json"
    assert main(["bench", "rollout", *SMALL, "--model", "tiny-moe", "--workloads", "fixed-1000",
                 "--decode-prompts", "2,40", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert list(r["models"]) == ["tiny", "tiny-moe"]  # SMALL names tiny; --model repeats
    moe = r["models"]["tiny-moe"]
    assert moe["config"]["model_type"] == "qwen3_moe" and moe["config"]["num_experts"] == 8
    row = moe["workloads"]["fixed-1000"]
    assert [w["prompt_len"] for w in moe["decode_steps"]] == [2, 40]
    for mode in ("consistent", "baseline"):
        assert row["modes"][mode]["generated_tokens"] == row["output_tokens"], row["modes"][mode]
        short, long = (window["modes"][mode] for window in moe["decode_steps"])
        for step in (short, long):
            assert step["pure_decode"] and positive(step["fraction"]["of_peak"]), step
        assert long["context"] > short["context"] + 37 and long["roofline"]["kv_bytes"] > short["roofline"]["kv_bytes"]
    assert row["hf"]["generated_tokens"] == row["output_tokens"] and positive(row["over_hf"]["consistent"])
    # batch 3 of top-2 over 8 experts reads some of the experts, not all
    assert row["roofline"]["weight_bytes"] < moe["weight_bytes"]
    ratio = {c["model"]: c for c in r["checks"] if c["name"] == "consistent/baseline tokens/s"}
    assert ratio["tiny-moe"]["target"] == TARGETS["consistent_over_baseline_moe"] == 0.90
    assert ratio["tiny"]["target"] == TARGETS["consistent_over_baseline"] == 0.97


def test_step_profile_splits_eager_and_graph_steps_and_finds_the_slowest():
    times = [(0.05, False), *((0.001 * (1 + i // 10), True) for i in range(100)), (0.2, True)]
    p = rollout.step_profile(times, slowest=2)
    assert (p["steps"], p["eager_steps"], p["graph_steps"]) == (102, 1, 101)
    assert math.isclose(p["eager_seconds"], 0.05) and math.isclose(p["seconds"], p["eager_seconds"] + p["graph_seconds"])
    assert [round(ms, 6) for ms in p["graph_ms_by_tenth"][:3]] == [1.0, 2.0, 3.0]
    assert [s["step"] for s in p["slowest"]] == [101, 0] and p["slowest"][0]["graph"]
    assert rollout.step_profile([(0.01, False)])["graph_ms_median"] is None


def test_roofline_reads_each_weight_once_and_the_batch_rows_of_the_embedding():
    untied = ModelConfig(**{**MODELS["tiny"], "tie_word_embeddings": False})
    model = DenseDecoder(untied, Ops(ExecutionSpec.default("baseline", "cpu")), max_positions=2)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    assert weight_bytes(model.hf_state_dict(), untied, 0) == params - embed.numel() * 4  # only gathered rows
    config = model_config("tiny")
    model = DenseDecoder(config, Ops(ExecutionSpec.default("baseline", "cpu")), max_positions=2)
    state = model.hf_state_dict()
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: the embedding is the LM head
    row = config.hidden_size * 4
    assert weight_bytes(state, config, 0) == params and weight_bytes(state, config, 5) == params + 5 * row
    kv = KVCache.bytes_per_token(config, torch.float32)
    roof = decode_roofline(state, config, 8, 100.5, kv)
    assert roof["bytes"] == params + 8 * row + round(8 * 100.5 * kv)
    assert roof["tokens_per_s_peak"] == 8 * HBM_PEAK_B_S / roof["bytes"]


def test_roofline_reads_the_experts_a_batch_touches():
    config = model_config("tiny-moe")
    model = build_decoder(config, Ops(ExecutionSpec.default("baseline", "cpu")), max_positions=2)
    state = model.hf_state_dict()
    experts = sum(t.numel() * 4 for name, t in state.items() if ".mlp.experts." in name)
    # gate, up and down of every expert: the hub layout's per-expert tensors
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    assert experts == config.num_hidden_layers * 3 * e * h * i * 4
    row = config.hidden_size * 4
    dense = weight_bytes(state, config, 0)  # untied: the LM head in full, no embedding row, no expert
    assert dense == sum(p.numel() * 4 for p in model.parameters()) - experts - config.vocab_size * row
    assert experts_touched(config, 1) == config.num_experts_per_tok / config.num_experts
    assert weight_bytes(state, config, 1) == dense + row + round(experts * 2 / 8)
    assert weight_bytes(state, config, 3) == dense + 3 * row + round(experts * (1 - (6 / 8) ** 3))
    full = model_config("qwen3-30b-a3b-12l")
    assert experts_touched(full, 256) > 1 - 1e-6 and experts_touched(full, 1) == 8 / 128
    assert experts_touched(model_config("tiny"), 1) == 1.0  # a dense model reads every weight


def test_graph_batch_sizes_reach_the_engine_and_bad_ones_fail_by_name(tmp_path):
    out = tmp_path / "rollout.json"
    args = [*SMALL, "--workloads", "fixed-1000", "--modes", "consistent", "--no-hf", "--decode-prompts", "4"]
    assert main(["bench", "rollout", *args, "--graph-batch-sizes", "1,2,8", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["models"]["tiny"]["workloads"]["fixed-1000"]["modes"]["consistent"]
    assert row["engine"]["graph_batch_sizes"] == [1, 2, 8]
    with pytest.raises(SystemExit):
        main(["bench", "rollout", *args, "--graph-batch-sizes", "0,8"])
    model = build_decoder(model_config("tiny"), Ops(ExecutionSpec.default("consistent", "cpu")))
    for bad in ([], [0, 8]):
        with pytest.raises(ValueError, match=r"graph_batch_sizes .* must be batch sizes >= 1"):
            LLMEngine(model, num_blocks=8, graph_batch_sizes=bad)


def test_a_cpu_run_prints_its_estimate_first_and_a_long_one_how_to_make_it_short(tmp_path, monkeypatch, capsys):
    args = [*SMALL, "--workloads", "fixed-1000", "--modes", "consistent", "--no-hf", "--out", str(tmp_path / "r.json")]
    assert main(["bench", "rollout", *args]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("tiny on the cpu (") and "for the engine's" in printed
    assert printed.index("tiny on the cpu") < printed.index("tiny fixed-1000 consistent:")
    monkeypatch.setattr(rollout, "first_step", lambda *a: (1, 3600.0))  # an hour a token: a run of hours
    assert main(["bench", "rollout", *args]) == 0
    first = capsys.readouterr().out.splitlines()[:2]
    assert " h for the engine's" in first[0] and first[1].strip() == rollout.SHORT_RUN


def test_the_estimate_counts_the_tokens_the_warm_up_runs():
    """announce_estimate counts warm_up_calls with tokens_run: the engine's own count of a warm-up agrees."""
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    args = parser.parse_args(SMALL)
    config = model_config("tiny")
    state = rollout.random_weights(config, args)
    max_model_len, batch, prompt_lens = 40, 3, [5, 17, 9]
    engine, _ = rollout.build_engine(config, "consistent", state, max_model_len, batch, args)
    rollout.warm_up(engine, max_model_len, batch, args, prompt_lens)
    calls = rollout.warm_up_calls(max_model_len, batch, args, prompt_lens)
    assert len(calls) > 2
    assert engine.stats.prefill_tokens + engine.stats.generated_tokens == sum(
        rollout.tokens_run(lengths, max_tokens, max_model_len) for lengths, max_tokens in calls)
