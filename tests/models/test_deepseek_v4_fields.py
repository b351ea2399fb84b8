"""Every config.json field transformers defines for deepseek_v4 is implemented, refused unless harmless, or listed as
changing no math (onepath/models/fields.py), as tests/models/test_config_fields.py checks the other families; each
implemented field is probed: two configs differing in it alone give different transformers logits, and onepath's
match transformers' for both (FP32, CPU, 1e-4). The legacy names of published checkpoints are probed the same way.
"""
import copy
import re
import warnings

import pytest
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from onepath.models.config import ModelConfig
from onepath.models.fields import FAMILY_REFUSED, IMPLEMENTED, REFUSED, classify, unclassified
from tests.models.test_config_fields import DELETE, modeling_reads
from tests.tiny_deepseek_v4 import (CSA, HCA, SLIDING, TINY, onepath_logits, onepath_model, randomize, sequences,
                                    softmax_scoring, ties_to_larger_position, transformers_logits)

TOL = 1e-4
LEGACY = ("compress_ratios", "compress_rate_csa", "compress_rate_hca", "num_hash_layers", "qk_rope_head_dim",
          "rope_scaling")


def tiny_json() -> dict:
    return DeepseekV4Config(**TINY).to_dict()


def test_every_transformers_field_is_classified():
    fields = set(DeepseekV4Config().to_dict()) | modeling_reads("deepseek_v4")
    assert {"compress_rates", "hc_mult", "index_topk", "num_local_experts", "intermediate_size"} <= fields
    assert unclassified("deepseek_v4", dict.fromkeys(fields | set(LEGACY))) == []


def test_a_default_config_loads_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = ModelConfig.from_dict(DeepseekV4Config().to_dict())
    assert config.model_type == "deepseek_v4" and config.layer_types[:4] == [HCA, HCA, HCA, CSA]
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_partial_rotary_factor_is_implemented_here_though_refused_elsewhere():
    assert classify("deepseek_v4", "partial_rotary_factor") == "implemented"
    assert classify("qwen3", "partial_rotary_factor") == "refused"
    raw = {k: v for k, v in tiny_json().items() if k != "rope_parameters"}
    assert ModelConfig.from_dict({**raw, "partial_rotary_factor": 0.25}).rope_dim == 4


NOT_HARMLESS = {"hidden_act": "gelu", "attention_dropout": 0.1, "quantization_config": {"quant_method": "fp8"},
                "num_key_value_heads": 2, "n_shared_experts": 2, "norm_topk_prob": False, "attention_bias": True,
                "router_jitter_noise": 0.1}


def test_every_refusable_field_has_a_case():
    refusable = {f for f in REFUSED if f not in IMPLEMENTED["deepseek_v4"]} | set(FAMILY_REFUSED["deepseek_v4"])
    assert sorted(NOT_HARMLESS) == sorted(refusable)


@pytest.mark.parametrize("field", sorted(NOT_HARMLESS))
def test_a_refusable_field_is_refused_unless_harmless(field):
    raw = tiny_json()
    harmless = FAMILY_REFUSED["deepseek_v4"].get(field, REFUSED.get(field))[0]
    ModelConfig.from_dict({**raw, field: harmless})
    with pytest.raises(ValueError, match=re.escape(f"{field} = {NOT_HARMLESS[field]!r}")):
        ModelConfig.from_dict({**raw, field: NOT_HARMLESS[field]})


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
NO_ROPE = {"rope_parameters": DELETE}
SHORT_YARN = {**NO_ROPE, "compress_rope_theta": 100.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
PROBES = {
    "vocab_size": ({}, {"vocab_size": 53}),
    "hidden_size": ({}, {"hidden_size": 24}),
    "moe_intermediate_size": ({}, {"moe_intermediate_size": 12}),
    "intermediate_size": ({}, {"moe_intermediate_size": DELETE, "intermediate_size": 12}),
    "num_hidden_layers": ({}, {"num_hidden_layers": 2}),
    "num_attention_heads": ({}, {"num_attention_heads": 2}),
    "head_dim": ({}, {"head_dim": 8}),
    "q_lora_rank": ({}, {"q_lora_rank": 12}),
    "num_experts_per_tok": ({}, {"num_experts_per_tok": 3}),
    "n_routed_experts": ({}, {"n_routed_experts": 6}),
    "num_local_experts": ({}, {"n_routed_experts": DELETE, "num_local_experts": 6}),
    "scoring_func": ({}, {"scoring_func": "sigmoid"}),
    "routed_scaling_factor": ({}, {"routed_scaling_factor": 0.7}),
    # YaRN's pretraining length defaults to it
    "max_position_embeddings": (SHORT_YARN, {**SHORT_YARN, "max_position_embeddings": 128}),
    "rope_theta": (NO_ROPE, {**NO_ROPE, "rope_theta": 500.0}),
    "compress_rope_theta": (NO_ROPE, {**NO_ROPE, "compress_rope_theta": 900.0}),
    "rope_parameters": ({}, {"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 3000.0,
                                                          "partial_rotary_factor": 0.5},
                                                 "compress": {**YARN, "rope_theta": 5000.0,
                                                              "partial_rotary_factor": 0.5}}}),
    "partial_rotary_factor": (NO_ROPE, {**NO_ROPE, "partial_rotary_factor": 0.25}),
    "layer_types": ({}, {"layer_types": [HCA, CSA, SLIDING]}),
    "compress_rates": ({}, {"compress_rates": {CSA: 2, HCA: 4}}),
    "hc_mult": ({}, {"hc_mult": 3}),
    "hc_sinkhorn_iters": ({}, {"hc_sinkhorn_iters": 2}),
    "hc_eps": ({}, {"hc_eps": 0.1}),
    "mlp_layer_types": ({}, {"mlp_layer_types": ["moe", "hash_moe", "hash_moe"]}),
    "swiglu_limit": ({}, {"swiglu_limit": 0.2}),
    "sliding_window": ({}, {"sliding_window": 3}),
    "o_groups": ({}, {"o_groups": 4}),
    "o_lora_rank": ({}, {"o_lora_rank": 4}),
    "index_n_heads": ({}, {"index_n_heads": 8}),
    "index_head_dim": ({}, {"index_head_dim": 12}),
    "index_topk": ({}, {"index_topk": 1}),
    "rms_norm_eps": ({}, {"rms_norm_eps": 0.5}),
    "tie_word_embeddings": ({}, {"tie_word_embeddings": True}),
    "mlp_bias": ({}, {"mlp_bias": True}),
    "compress_ratios": ({"layer_types": DELETE, "compress_ratios": [0, 4, 128]},
                        {"layer_types": DELETE, "compress_ratios": [128, 4, 0]}),
    "compress_rate_csa": ({"compress_rates": DELETE, "compress_rate_hca": 8},
                          {"compress_rates": DELETE, "compress_rate_hca": 8, "compress_rate_csa": 2}),
    "compress_rate_hca": ({"compress_rates": DELETE, "compress_rate_hca": 8},
                          {"compress_rates": DELETE, "compress_rate_hca": 4}),
    "num_hash_layers": ({"mlp_layer_types": DELETE, "num_hash_layers": 1},
                        {"mlp_layer_types": DELETE, "num_hash_layers": 2}),
    "qk_rope_head_dim": ({**NO_ROPE, "partial_rotary_factor": DELETE, "qk_rope_head_dim": 8},
                         {**NO_ROPE, "partial_rotary_factor": DELETE, "qk_rope_head_dim": 4}),
    "rope_scaling": (NO_ROPE, {**NO_ROPE, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 64}}),
}
COVERED = {"model_type": "picks the decoder: every case here builds DeepSeek-V4",
           "pad_token_id": "moves no logit, only the pad row's gradient (ops.embedding's padding_idx, tested in "
                           "test_dense_vs_transformers.py's test_pad_token_row_gets_transformers_gradient)"}


def edited(edits):
    raw = tiny_json()
    for key, value in edits.items():
        if value is DELETE:
            raw.pop(key, None)
        else:
            raw[key] = copy.deepcopy(value)  # transformers writes into the rope dicts it is given
    return raw


def logits_both(raw):
    hf_config = DeepseekV4Config.from_dict(raw)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = randomize(DeepseekV4ForCausalLM(hf_config).eval())
    seqs = sequences(min(hf_config.vocab_size, 50))
    return transformers_logits(hf, seqs), onepath_logits(onepath_model(hf), seqs)


@pytest.mark.parametrize("field", sorted(f for f in IMPLEMENTED["deepseek_v4"] if f not in COVERED))
def test_an_implemented_field_changes_the_logits_as_in_transformers(field, monkeypatch):
    ties_to_larger_position(monkeypatch)
    softmax_scoring(monkeypatch)
    a, b = PROBES[field]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on rope and legacy fields
        want_a, got_a = logits_both(edited(a))
        want_b, got_b = logits_both(edited(b))
    moved = want_a.shape != want_b.shape or (want_a - want_b).abs().max() > 100 * TOL
    assert moved, f"{field}: the probe moves nothing"
    torch.testing.assert_close(got_a, want_a, rtol=TOL, atol=TOL)
    torch.testing.assert_close(got_b, want_b, rtol=TOL, atol=TOL)


def test_every_implemented_field_is_probed():
    assert sorted(set(IMPLEMENTED["deepseek_v4"]) - set(COVERED)) == sorted(PROBES)
