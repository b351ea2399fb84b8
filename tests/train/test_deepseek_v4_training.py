"""`onepath train` on a tiny DeepSeek-V4 checkpoint (sliding, CSA and HCA layers, hash and top-k MoE): every step's
rollout diff is exactly 0 with the indexer frozen (its weights never move) and with train.indexer_loss > 0 (its KL
loss logged and its weights moving: the engine samples with the trained indexer and still agrees bitwise); a
model without a lightning indexer refuses the option by name."""
import pytest
import torch

from onepath.config import load_run_config
from onepath.models import build_decoder
from onepath.models.checkpoint import load_state_dict, save_checkpoint
from onepath.models.deepseek_v4_config import DeepseekV4Config
from onepath.numerics.diff import is_exact
from onepath.ops import ExecutionSpec, Ops
from onepath.tasks import arithmetic
from onepath.train.trainer import GRPOTrainer, prepare
from tests.tiny_deepseek_v4 import CSA, HCA, SLIDING


def checkpoint(path):
    tokenizer = arithmetic.build_tokenizer()
    config = DeepseekV4Config(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, head_dim=16, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=4,
        layer_types=[SLIDING, CSA, HCA], compress_rates={CSA: 3, HCA: 5}, hc_mult=2, sliding_window=6, o_groups=2,
        o_lora_rank=8, index_n_heads=4, index_head_dim=8, index_topk=2, mlp_layer_types=["hash_moe", "moe", "moe"],
        partial_rotary_factor=0.5, max_position_embeddings=256, bos_token_id=arithmetic.BOS_ID,
        eos_token_id=arithmetic.EOS_ID, pad_token_id=arithmetic.PAD_ID)
    model = build_decoder(config, Ops(ExecutionSpec("baseline")))
    model.init_weights(0, std=0.2)
    save_checkpoint(path, model.hf_state_dict(), config, tokenizer, arithmetic.tokenizer_config(tokenizer, 128))
    return path


def run(tmp_path, reward, *options):
    path = checkpoint(tmp_path / "checkpoint")
    cfg = load_run_config(None, ["--model.path", str(path), "--train.steps", "2", "--train.prompts_per_step", "4",
                                 "--rollout.n", "4", "--data.n_train", "32", "--data.n_test", "0",
                                 "--train.val_every", "0", "--rollout.prefill_chunk_size", "3",
                                 "--train.reward", reward, "--out", str(tmp_path), *options])
    setup = prepare(cfg, tmp_path, progress=False)
    history = GRPOTrainer(cfg, "consistent", setup, tmp_path / "run").run(progress=False)
    return history, load_state_dict(path), load_state_dict(tmp_path / "run" / "step_2")


def indexer_moved(before, after) -> bool:
    names = [n for n in before if ".indexer." in n]
    assert names
    return any(not torch.equal(before[n], after[n]) for n in names)


def test_frozen_and_trained_indexer_keep_diff_exactly_zero(tmp_path, reward):
    frozen, before, after = run(tmp_path / "frozen", reward)
    assert all(is_exact(m) for m in frozen) and not indexer_moved(before, after)
    assert any(not torch.equal(before[n], after[n]) for n in before if ".indexer." not in n)
    trained, before, after = run(tmp_path / "trained", reward, "--train.indexer_loss", "1.0")
    assert all(is_exact(m) for m in trained), trained
    assert all(m["actor/indexer_loss"] > 0 for m in trained) and indexer_moved(before, after)


def test_indexer_loss_without_an_indexer_is_refused(tmp_path, reward):
    cfg = load_run_config(None, ["--train.indexer_loss", "0.5", "--train.steps", "1", "--out", str(tmp_path),
                                 "--data.n_train", "8", "--data.n_test", "0", "--warm_start.steps", "0"])
    setup = prepare(cfg, tmp_path, progress=False)
    with pytest.raises(ValueError, match="train.indexer_loss is set but .* has no lightning indexer"):
        GRPOTrainer(cfg, "consistent", setup, tmp_path / "run")
    with pytest.raises(ValueError, match="indexer_loss"):
        load_run_config(None, ["--train.indexer_loss", "-1"])
