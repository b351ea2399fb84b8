"""MoeDecoder against transformers' Qwen3-MoE and Qwen2-MoE, our independent reference for the architecture.

Small random models built by transformers, saved with save_pretrained (the hub layout: one
gate/up/down projection per expert), loaded by onepath: our logits must match transformers' for
each sequence run alone, to the dense test's tolerance (FP32, different reduction orders).
transformers 5 holds the experts fused in memory (mlp.experts.gate_up_proj [E, 2I, H]); that state
dict loads too, with the same bits. Our checkpoint, read back by transformers, gives its logits bitwise.
"""
import pytest
import torch

from safetensors import safe_open
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from onepath.models import build_decoder
from onepath.models.batch import ForwardBatch
from onepath.models.checkpoint import WEIGHTS, load_config, load_state_dict, save_checkpoint
from onepath.models.kv_cache import KVCache
from onepath.models.moe import MoeDecoder
from onepath.ops import ExecutionSpec, Ops
from tests.tiny import randomize
from tests.models.test_dense_vs_transformers import ATOL, BLOCK_SIZE, LENGTHS, MAX_POSITIONS, RTOL, assert_reloads_as, \
    reference_logits, sequences

BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, moe_intermediate_size=24,
            num_experts_per_tok=2)
CASES = {
    "qwen3_moe_normalised": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        num_experts=8, norm_topk_prob=True, head_dim=16, tie_word_embeddings=False)),
    "qwen3_moe_dense_layers_tied": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        num_hidden_layers=4, num_experts=6, norm_topk_prob=False, mlp_only_layers=[0], decoder_sparse_step=2,
        head_dim=24, attention_bias=True, tie_word_embeddings=True)),
    "qwen2_moe_shared_expert": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(
        num_experts=4, norm_topk_prob=False, shared_expert_intermediate_size=40, qkv_bias=True,
        tie_word_embeddings=False)),
}


def hf_model(name, **options):
    config_cls, model_cls, fields = CASES[name]
    config = config_cls(**{**BASE, **fields}, attn_implementation="eager", **options)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    # random values everywhere, router rows of unit scale included
    return randomize(model)


def ours(config, state, mode="consistent") -> MoeDecoder:
    model = build_decoder(config, Ops(ExecutionSpec(mode=mode)), max_positions=MAX_POSITIONS)
    model.load_hf_state_dict(state)
    return model


def our_logits(model, seqs):
    batch, num_blocks = ForwardBatch.for_sequences(seqs, BLOCK_SIZE)
    cache = KVCache(model.config, num_blocks, BLOCK_SIZE, torch.float32)
    with torch.no_grad():
        return list(model.compute_logits(model(batch, cache)).split(LENGTHS))


def assert_match(got, want):
    for b, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, msg=lambda m: f"sequence {b}: {m}")
        assert torch.equal(g.argmax(-1), w.argmax(-1)), f"sequence {b}: greedy tokens differ"


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(tmp_path, name, mode):
    ref = hf_model(name)
    ref.save_pretrained(tmp_path)
    with safe_open(tmp_path / WEIGHTS, "pt") as f:
        assert "model.layers.1.mlp.experts.0.gate_proj.weight" in f.keys()  # the hub layout
    model = ours(load_config(tmp_path), load_state_dict(tmp_path), mode)
    assert isinstance(model, MoeDecoder)
    seqs = sequences(ref.config.vocab_size)
    assert_match(our_logits(model, seqs), reference_logits(ref, seqs))


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_state_dict_loads_the_same_weights(tmp_path, name):
    ref = hf_model(name)
    ref.save_pretrained(tmp_path)
    config = load_config(tmp_path)
    assert "model.layers.1.mlp.experts.gate_up_proj" in ref.state_dict()
    from_file, from_memory = ours(config, load_state_dict(tmp_path)), ours(config, ref.state_dict())
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert sorted(from_memory.state_dict()) == sorted(set(ref.state_dict()) - tied)
    assert all(torch.equal(t, from_file.state_dict()[k]) for k, t in from_memory.state_dict().items())


@pytest.mark.parametrize("name", sorted(CASES))
def test_save_checkpoint_loads_in_transformers(tmp_path, name):
    ref = hf_model(name)
    ref.save_pretrained(tmp_path / "hf")
    model = ours(load_config(tmp_path / "hf"), load_state_dict(tmp_path / "hf"))
    save_checkpoint(tmp_path / "ours", model.hf_state_dict(), model.config)
    assert sorted(load_state_dict(tmp_path / "ours")) == sorted(load_state_dict(tmp_path / "hf"))
    assert_reloads_as(ref, tmp_path / "ours")


def test_tolerance_catches_the_wrong_top_k_normalisation(tmp_path):
    ref = hf_model("qwen3_moe_normalised")
    ref.save_pretrained(tmp_path)
    config = load_config(tmp_path)
    config.norm_topk_prob = False
    seqs = sequences(ref.config.vocab_size)
    with pytest.raises(AssertionError):
        assert_match(our_logits(ours(config, load_state_dict(tmp_path)), seqs), reference_logits(ref, seqs))


def test_a_checkpoint_missing_an_expert_is_refused(tmp_path):
    ref = hf_model("qwen2_moe_shared_expert")
    ref.save_pretrained(tmp_path)
    state = load_state_dict(tmp_path)
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    with pytest.raises(ValueError, match=r"experts\.2\.up_proj"):
        ours(load_config(tmp_path), state)
