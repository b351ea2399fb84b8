"""bench/family_run.py on the CPU: both new families' presets shrunk to tiny widths by --set and --layers, a random
checkpoint trained 2 steps in each mode from the same weights: the consistent run exact with routing agreement 1.0
on every step, the baseline not exact (the negative control); bad input refused by name (the GPU run is the same
code at the presets' widths)."""
import json

import pytest

from onepath.bench import family_run as bench, runs
from onepath.bench.workloads import MODELS
from onepath.tasks import word_problems

# the tiny presets' widths on the real presets' layer schedules (the first --layers layers of each)
KEEP = ("vocab_size", "hybrid_override_pattern", "layer_types", "num_hidden_layers", "max_position_embeddings",
        "eos_token_id")
SMALL = ["train.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=8"]


def shrunk(preset: str, tiny: str) -> list[str]:
    return [f"model.{k}={json.dumps(v)}" for k, v in MODELS[tiny].items() if MODELS[preset].get(k) != v
            and k not in KEEP] + SMALL


@pytest.mark.slow
@pytest.mark.parametrize("preset,tiny,layers", [("nemotron-3-nano-13l", "tiny-hybrid", 6),
                                                ("deepseek-v4-flash-4l", "tiny-deepseek-v4", 4)])
def test_consistent_exact_with_routing_agreement_and_baseline_not(tmp_path, preset, tiny, layers):
    out = tmp_path / "run.json"
    argv = ["--preset", preset, "--layers", str(layers), "--steps", "2", "--out", str(out), "--run-dir",
            str(tmp_path / "runs")]
    code = bench.main([*argv, *(x for item in shrunk(preset, tiny) for x in ("--set", item))])
    result = json.loads(out.read_text())
    assert code == 0 and result["quant"] == bench.FAMILY_QUANT[result["model_type"]]
    assert result["layers"] == layers and result["parameters"] > 0
    consistent, baseline = (result["modes"][m]["steps"] for m in bench.MODES)
    assert [s["step"] for s in consistent] == [s["step"] for s in baseline] == [1, 2]
    assert all(s["exact"] and s["max_dp"] == 0 and s["k3"] == 0 for s in consistent)
    assert all(s["routing_agreement"] == 1.0 and s["routing_compared_tokens"] > 0 for s in consistent)
    assert any(s["grad_norm"] > 0 for s in consistent)  # the updates move the weights step 2 samples with
    assert any(not s["exact"] and s["max_dp"] > 0 for s in baseline)
    summary = result["summary"]
    assert summary["consistent_exact_every_step"] and summary["baseline_nonzero_some_step"]
    assert summary["consistent"]["min_routing_agreement"] == 1.0 and summary["consistent"]["steps"] == 2
    assert not list((tmp_path / "runs").glob("*/step_*"))  # the final checkpoints are not kept


def test_the_checkpoint_has_the_presets_layers_and_the_tasks_vocabulary():
    tokenizer = word_problems.build_tokenizer()
    config = bench.preset_config("nemotron-3-nano-13l", 7, {"n_routed_experts": 8}, tokenizer, word_problems)
    assert config.layers_block_type == ["linear_attention", "moe", "linear_attention", "moe", "linear_attention",
                                        "full_attention", "moe"]
    assert (config.hidden_size, config.mamba_num_heads, config.n_routed_experts) == (2688, 64, 8)
    assert config.vocab_size == tokenizer.get_vocab_size() and config.eos_token_id == word_problems.EOS_ID
    config = bench.preset_config("deepseek-v4-flash-4l", 3, {}, tokenizer, word_problems)
    assert config.layer_types == ["heavily_compressed_attention", "compressed_sparse_attention",
                                  "heavily_compressed_attention"] and config.hidden_size == 4096


def test_bad_input_is_refused_by_name():
    tokenizer = word_problems.build_tokenizer()
    with pytest.raises(ValueError, match="--layers 14 must be in \\[1, 13\\]"):
        bench.preset_config("nemotron-3-nano-13l", 14, {}, tokenizer, word_problems)
    with pytest.raises(ValueError, match="--set model.hiden_size: nemotron_h's config has no field 'hiden_size'"):
        bench.preset_config("nemotron-3-nano-13l", None, {"hiden_size": 64}, tokenizer, word_problems)
    with pytest.raises(ValueError, match="--preset 'nemotron' is unknown"):
        bench.preset_config("nemotron", None, {}, tokenizer, word_problems)
    with pytest.raises(SystemExit, match="--set 'train.lr' needs KEY=VALUE"):
        bench.override_pairs(["train.lr"])
    with pytest.raises(ValueError, match="quant preset 'fp9' is unknown"):
        bench.main(["--preset", "tiny-hybrid", "--quant", "fp9"])


def test_the_reward_gives_random_samples_a_signal():
    assert bench.digit_share("", "2*4=8. #### 14", 14) == 1.0
    assert bench.digit_share("", "ab12", 14) == 0.5 and bench.digit_share("", "abc", 14) == 0.0


def test_a_model_too_large_for_the_gpu_is_refused_naming_the_layers_that_fit(monkeypatch):
    tokenizer = word_problems.build_tokenizer()
    monkeypatch.setattr(bench, "device_bytes", lambda: 80 * 2**30)  # an H100
    bench.check_fits("deepseek-v4-flash-4l", None, {}, tokenizer, word_problems)
    bench.check_fits("nemotron-3-nano-13l", 8, {}, tokenizer, word_problems)
    with pytest.raises(SystemExit, match="nemotron-3-nano-13l with --layers 13 needs about 88 GiB .* --layers 8"):
        bench.check_fits("nemotron-3-nano-13l", None, {}, tokenizer, word_problems)
    monkeypatch.setattr(bench, "device_bytes", lambda: 141 * 2**30)  # an H200
    bench.check_fits("nemotron-3-nano-13l", None, {}, tokenizer, word_problems)


def test_a_run_past_its_timeout_is_stopped():
    assert runs.train(["--help"], timeout=0.01) == runs.TIMED_OUT
