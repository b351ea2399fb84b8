"""`onepath train` on a tiny Nemotron-H hybrid (Mamba-2, MoE, attention, MLP layers) from a checkpoint directory:
every step's rollout diff is exactly 0 and the routing is the rollout's (no replay), updates moving the weights;
the baseline run, same checkpoint and data, reports a diff."""
import pytest
import torch

from onepath.config import load_run_config
from onepath.models import build_decoder
from onepath.models.checkpoint import save_checkpoint
from onepath.models.config import NemotronHConfig
from onepath.numerics.diff import is_exact
from onepath.ops import ExecutionSpec, Ops
from onepath.tasks import arithmetic
from onepath.train.trainer import GRPOTrainer, prepare


def hybrid_checkpoint(path):
    tokenizer = arithmetic.build_tokenizer()
    config = NemotronHConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=32,
        layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=40, mamba_num_heads=4,
        mamba_head_dim=6, ssm_state_size=5, n_groups=2, chunk_size=8, n_routed_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=12, moe_shared_expert_intermediate_size=20, n_group=3, topk_group=2,
        max_position_embeddings=256, bos_token_id=arithmetic.BOS_ID, eos_token_id=arithmetic.EOS_ID,
        pad_token_id=arithmetic.PAD_ID)
    model = build_decoder(config, Ops(ExecutionSpec("baseline")))
    model.init_weights(0, std=0.2)
    save_checkpoint(path, model.hf_state_dict(), config, tokenizer, arithmetic.tokenizer_config(tokenizer, 128))
    return path


def hybrid_run(mode, tmp_path, reward):
    checkpoint = hybrid_checkpoint(tmp_path / "checkpoint")
    cfg = load_run_config(None, ["--model.path", str(checkpoint), "--train.steps", "3", "--train.prompts_per_step",
                                 "4", "--rollout.n", "4", "--data.n_train", "64", "--data.n_test", "8",
                                 "--rollout.prefill_chunk_size", "3", "--train.reward", reward,
                                 "--out", str(tmp_path)])
    setup = prepare(cfg, tmp_path, progress=False)
    return GRPOTrainer(cfg, mode, setup, tmp_path / mode).run(progress=False)


@pytest.mark.slow
def test_hybrid_grpo_steps_keep_diff_exactly_zero(tmp_path, reward):
    history = hybrid_run("consistent", tmp_path, reward)
    assert len(history) == 3 and all(is_exact(m) for m in history), history
    assert all(m["moe/routing_agreement"] == 1.0 and m["moe/routing_compared_tokens"] > 0 for m in history)
    assert any(m["actor/grad_norm"] > 0 for m in history)  # the updates move the weights the next steps sample
    assert (tmp_path / "consistent" / "step_3" / "model.safetensors").exists()


@pytest.mark.slow
def test_hybrid_baseline_reports_a_diff(tmp_path, reward):
    history = hybrid_run("baseline", tmp_path, reward)
    assert any(m["training/rollout_probs_diff_max"] > 0 for m in history)


def embedded_hybrid_run(mode, tmp_path, reward, pattern="M*EM-"):
    cfg = load_run_config(None, ["--model.model_type", "nemotron_h", "--model.hybrid_override_pattern", pattern,
                                 "--model.num_experts", "4", "--model.moe_intermediate_size", "16",
                                 "--warm_start.steps", "0", "--train.steps", "2", "--train.prompts_per_step", "4",
                                 "--rollout.n", "4", "--data.n_train", "32", "--data.n_test", "4",
                                 "--rollout.prefill_chunk_size", "5", "--train.reward", reward, "--out", str(tmp_path)])
    setup = prepare(cfg, tmp_path, progress=False)
    assert isinstance(setup.model_config, NemotronHConfig)
    assert setup.model_config.layers_block_type == ["linear_attention", "full_attention", "moe", "linear_attention",
                                                    "mlp"]
    return GRPOTrainer(cfg, mode, setup, tmp_path / mode).run(progress=False)


@pytest.mark.slow
def test_the_embedded_hybrid_trains_with_diff_exactly_zero(tmp_path, reward):
    """`onepath train --model.model_type nemotron_h` (no checkpoint): the embedded tiny hybrid of the pattern."""
    history = embedded_hybrid_run("consistent", tmp_path, reward)
    assert len(history) == 2 and all(is_exact(m) for m in history), history
    baseline = embedded_hybrid_run("baseline", tmp_path, reward)
    assert any(m["training/rollout_probs_diff_max"] > 0 for m in baseline)


def test_the_embedded_hybrid_is_built_from_the_pattern_and_a_bad_one_is_refused():
    cfg = load_run_config(None, ["--model.model_type", "nemotron_h", "--model.hybrid_override_pattern", "M-M*",
                                 "--model.ssm_state_size", "8"])
    config = cfg.model.hybrid_config(40, 1, 2, 0)
    assert config.layers_block_type == ["linear_attention", "mlp", "linear_attention", "full_attention"]
    assert (config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.ssm_state_size) == (4, 16, 2, 8)
    build_decoder(config, Ops(ExecutionSpec("consistent")))
    with pytest.raises(ValueError, match="model.hybrid_override_pattern = 'M\\*X' is not a layer pattern"):
        load_run_config(None, ["--model.model_type", "nemotron_h", "--model.hybrid_override_pattern", "M*X"])
    with pytest.raises(ValueError, match="model.num_experts = 0 must be >= 1 for model.model_type = nemotron_h"):
        load_run_config(None, ["--model.model_type", "nemotron_h", "--model.hybrid_override_pattern", "ME"])
