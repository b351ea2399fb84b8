"""Every config.json field transformers defines for a supported family is implemented, refused unless
harmless, or listed as not changing the math (onepath/models/fields.py); none is dropped without a word.

The walk: the keys of each family's transformers config (`XConfig().to_dict()`) and every `config.<name>`
its modeling code reads (head_dim by getattr in Qwen2, ...). An implemented field is then probed: two
configs that differ in that field alone give different transformers logits (the probe can fail), and
onepath's logits match transformers' for both, FP32 on the CPU, to 1e-4.
"""
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, NemotronHConfig,
                          NemotronHForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from onepath.models import build_decoder
from onepath.models.batch import ForwardBatch
from onepath.models.config import ModelConfig
from onepath.models.fields import FAMILY_REFUSED, IMPLEMENTED, NO_MATH, REFUSED, classify, unclassified
from onepath.models.kv_cache import KVCache
from onepath.ops import ExecutionSpec, Ops
from tests.tiny import randomize

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "nemotron_h": (NemotronHConfig, NemotronHForCausalLM),
}
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")
NO_ROPE = ("nemotron_h",)  # attention without positional encoding
TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
TINY_NEMOTRON = dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], mamba_num_heads=4,
                     mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=8, n_routed_experts=4,
                     moe_intermediate_size=24, moe_shared_expert_intermediate_size=32, num_experts_per_tok=2)
TINY_FAMILY = {"qwen2_moe": dict(TINY_MOE, shared_expert_intermediate_size=24), "qwen3_moe": TINY_MOE,
               "nemotron_h": TINY_NEMOTRON}
LENGTHS = (1, 23, 40)
TOL = 1e-4
DELETE = object()  # a probe edit that removes the key from config.json


def modeling_reads(family: str) -> set[str]:
    """The config attributes transformers' modeling file of `family` reads (config.x, getattr(config, "x"))."""
    source = (Path(transformers.__file__).parent / "models" / family / f"modeling_{family}.py").read_text()
    names = set(re.findall(r"\bconfig\.([a-z][a-z0-9_]*)\b(?!\()", source))
    names |= set(re.findall(r"getattr\((?:self\.)?config, \"([a-z][a-z0-9_]*)\"", source))
    return names


def transformers_fields(family: str) -> set[str]:
    return set(FAMILIES[family][0]().to_dict()) | modeling_reads(family)


def tiny_json(family: str) -> dict:
    """transformers' config.json of a tiny model of `family`, layer_types left to derive (as published files do)."""
    raw = FAMILIES[family][0](**TINY, **TINY_FAMILY.get(family, {})).to_dict()
    raw.pop("layer_types", None)
    return raw


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_transformers_field_is_classified(family):
    fields = transformers_fields(family)
    found = {"vocab_size", "hidden_size", "use_cache"} | ({"rope_parameters"} if family not in NO_ROPE else set())
    assert found <= fields  # the walk found the config
    assert unclassified(family, dict.fromkeys(fields)) == []


def test_the_walk_catches_an_unknown_field():
    """Negative control: a field nobody listed is caught by the walk and named in a warning at load."""
    raw = {**tiny_json("qwen3"), "fake_window_stride": 3}
    assert unclassified("qwen3", raw) == ["fake_window_stride"]
    with pytest.warns(UserWarning, match="fake_window_stride"):
        ModelConfig.from_dict(raw)


def test_a_field_of_another_family_is_not_read():
    """transformers' Mistral has no attention_bias: onepath does not add biases for it either."""
    raw = {**tiny_json("mistral"), "attention_bias": True}
    with pytest.warns(UserWarning, match="attention_bias"):
        config = ModelConfig.from_dict(raw)
    assert not config.has_attention_bias and config.extra["attention_bias"] is True


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_default_config_loads_without_a_warning(family):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = ModelConfig.from_dict(FAMILIES[family][0]().to_dict())
    assert config.model_type == family
    assert ModelConfig.from_dict(config.to_dict()) == config


NOT_HARMLESS = {"hidden_act": "gelu", "attention_dropout": 0.1, "partial_rotary_factor": 0.5,
                "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}


def test_every_refusable_field_has_a_case():
    assert sorted(NOT_HARMLESS) == sorted(REFUSED)


@pytest.mark.parametrize("field", sorted(REFUSED))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_refusable_field_is_refused_unless_harmless(family, field):
    raw = tiny_json(family)
    ModelConfig.from_dict({**raw, field: REFUSED[field][0]})
    value = NOT_HARMLESS[field]
    with pytest.raises(ValueError, match=re.escape(f"{field} = {value!r}")):
        ModelConfig.from_dict({**raw, field: value})


NOT_HARMLESS_FAMILY = {"tie_word_embeddings": True, "sliding_window": 7, "attention_bias": True,
                       "mamba_proj_bias": True, "residual_in_fp32": True, "hidden_dropout": 0.1,
                       "mamba_hidden_act": "gelu", "mlp_hidden_act": "silu", "n_shared_experts": 2}
# the families this file walks (deepseek_v4's refusals: tests/models/test_deepseek_v4_fields.py)
FAMILY_REFUSALS = [(family, field) for family, table in sorted(FAMILY_REFUSED.items()) if family in FAMILIES
                   for field in sorted(table)]


def test_every_family_refusable_field_has_a_case():
    assert sorted({field for _, field in FAMILY_REFUSALS}) == sorted(NOT_HARMLESS_FAMILY)


@pytest.mark.parametrize("family,field", FAMILY_REFUSALS)
def test_a_family_refusable_field_is_refused_unless_harmless(family, field):
    raw = tiny_json(family)
    ModelConfig.from_dict({**raw, field: FAMILY_REFUSED[family][field][0]})
    value = NOT_HARMLESS_FAMILY[field]
    with pytest.raises(ValueError, match=re.escape(f"{field} = {value!r}")):
        ModelConfig.from_dict({**raw, field: value})


def test_no_math_entries_say_why():
    assert all(len(why) > 10 for why in NO_MATH.values())


# (config.json edits a, edits b): they differ in the one field, so transformers' logits differ; onepath must
# follow both. A family-specific entry wins over the common one.
WINDOW = dict(use_sliding_window=True, sliding_window=7)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(8)],
            "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}
PROBES = {
    "vocab_size": ({}, {"vocab_size": 89}),
    "hidden_size": ({}, {"hidden_size": 48}),
    "intermediate_size": ({}, {"intermediate_size": 80}),
    "num_hidden_layers": ({}, {"num_hidden_layers": 3}),
    "num_attention_heads": ({}, {"num_attention_heads": 8}),
    "num_key_value_heads": ({}, {"num_key_value_heads": 1}),
    "head_dim": ({}, {"head_dim": 24}),
    "rms_norm_eps": ({}, {"rms_norm_eps": 0.5}),
    "max_position_embeddings": ({"rope_parameters": LONGROPE}, {"rope_parameters": LONGROPE,
                                                               "max_position_embeddings": 96}),
    "tie_word_embeddings": ({}, {"tie_word_embeddings": True}),
    "rope_parameters": ({}, {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}}),
    "rope_theta": ({"rope_parameters": DELETE, "rope_theta": 10000.0},
                   {"rope_parameters": DELETE, "rope_theta": 500.0}),
    "rope_scaling": ({"rope_parameters": DELETE}, {"rope_parameters": DELETE,
                                                   "rope_scaling": {"type": "linear", "factor": 2.0}}),
    "original_max_position_embeddings": (
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0},
         "original_max_position_embeddings": 16}),
    "attention_bias": ({}, {"attention_bias": True}),
    "mlp_bias": ({}, {"mlp_bias": True}),
    "use_sliding_window": ({**WINDOW, "max_window_layers": 1, "use_sliding_window": False},
                           {**WINDOW, "max_window_layers": 1}),
    "sliding_window": ({**WINDOW, "max_window_layers": 1}, {**WINDOW, "max_window_layers": 1, "sliding_window": 3}),
    "max_window_layers": ({**WINDOW, "max_window_layers": 2}, {**WINDOW, "max_window_layers": 3}),
    "layer_types": ({**WINDOW, "layer_types": ["sliding_attention"] + ["full_attention"] * 3},
                    {**WINDOW, "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2}),
    "num_experts": ({}, {"num_experts": 6}),
    "num_local_experts": ({}, {"num_local_experts": 6}),
    "num_experts_per_tok": ({}, {"num_experts_per_tok": 3}),
    "moe_intermediate_size": ({}, {"moe_intermediate_size": 16}),
    "norm_topk_prob": ({"norm_topk_prob": False}, {"norm_topk_prob": True}),
    "decoder_sparse_step": ({}, {"decoder_sparse_step": 2}),
    "mlp_only_layers": ({}, {"mlp_only_layers": [1]}),
    "shared_expert_intermediate_size": ({}, {"shared_expert_intermediate_size": 40}),
    "qkv_bias": ({}, {"qkv_bias": False}),
}
FAMILY_PROBES = {
    "mistral": {"sliding_window": ({"sliding_window": None}, {"sliding_window": 7})},
    # Qwen2-MoE windows the even layers below max_window_layers
    "qwen2_moe": {"use_sliding_window": ({**WINDOW, "max_window_layers": 4, "use_sliding_window": False},
                                         {**WINDOW, "max_window_layers": 4}),
                  "sliding_window": ({**WINDOW, "max_window_layers": 4}, {**WINDOW, "max_window_layers": 4,
                                                                           "sliding_window": 3}),
                  # the dense layers' MLP: only mlp_only_layers have one
                  "intermediate_size": ({"mlp_only_layers": [1]}, {"mlp_only_layers": [1], "intermediate_size": 80})},
    "qwen3_moe": {"use_sliding_window": ({**WINDOW, "use_sliding_window": False}, WINDOW),
                  "sliding_window": (WINDOW, {**WINDOW, "sliding_window": 3}),
                  "num_experts": ({}, {"num_local_experts": DELETE, "num_experts": 6}),
                  "intermediate_size": ({"mlp_only_layers": [1]}, {"mlp_only_layers": [1], "intermediate_size": 80})},
    "nemotron_h": {
        "layers_block_type": ({}, {"layers_block_type": ["linear_attention", "mlp", "full_attention", "moe"]}),
        "hybrid_override_pattern": ({"layers_block_type": DELETE, "hybrid_override_pattern": "ME*-"},
                                    {"layers_block_type": DELETE, "hybrid_override_pattern": "M-*E"}),
        "layer_types": ({"layers_block_type": DELETE,
                         "layer_types": ["linear_attention", "moe", "full_attention", "mlp"]},
                        {"layers_block_type": DELETE,
                         "layer_types": ["mlp", "moe", "full_attention", "linear_attention"]}),
        "num_local_experts": ({"n_routed_experts": DELETE, "num_local_experts": 4},
                              {"n_routed_experts": DELETE, "num_local_experts": 6}),
        "n_routed_experts": ({}, {"n_routed_experts": 6}),
        "layer_norm_epsilon": ({}, {"layer_norm_epsilon": 0.5}),
        "mamba_num_heads": ({}, {"mamba_num_heads": 2}),
        "mamba_head_dim": ({}, {"mamba_head_dim": 4}),
        "ssm_state_size": ({}, {"ssm_state_size": 4}),
        "n_groups": ({}, {"n_groups": 1}),
        "mamba_n_groups": ({}, {"mamba_n_groups": 1}),
        "conv_kernel": ({}, {"conv_kernel": 2}),
        "mamba_d_conv": ({}, {"mamba_d_conv": 2}),
        "use_conv_bias": ({}, {"use_conv_bias": False}),
        "mamba_conv_bias": ({}, {"mamba_conv_bias": False}),
        "time_step_limit": ({}, {"time_step_limit": [0.05, 0.3]}),
        "mamba_dt_limit": ({}, {"mamba_dt_limit": [0.05, 0.3]}),
        "use_bias": ({}, {"use_bias": True}),
        "moe_shared_expert_intermediate_size": ({}, {"moe_shared_expert_intermediate_size": 40}),
        "moe_latent_size": ({}, {"moe_latent_size": 24}),
        "routed_scaling_factor": ({}, {"routed_scaling_factor": 2.5}),
        "n_group": ({}, {"n_group": 2}),
        "topk_group": ({"n_group": 2}, {"n_group": 2, "topk_group": 2}),
    },
}
# implemented fields no probe can isolate, with the test that covers them
COVERED = {"model_type": "picks the decoder and its rules: every case here builds one per family",
           "pad_token_id": "moves no logit, only the pad row's gradient: test_dense_vs_transformers.py's "
                           "test_pad_token_row_gets_transformers_gradient"}

FAMILY_COVERED = {"nemotron_h": {
    "chunk_size": "the scan's value does not depend on it beyond rounding; it must divide the spec's ssd.chunk "
                  "(test_nemotron_h_vs_transformers.py: test_a_chunk_size_that_does_not_divide_the_spec_tile_...)",
    "mamba_chunk_size": "the legacy name of chunk_size",
    "mamba_ssm_cache_dtype": "transformers ignores it; the state's rounding at chunk boundaries is tested against the "
                             "formula (tests/ops/test_ssd.py) and in every phase "
                             "(tests/models/test_nemotron_h_phases.py)",
    "max_position_embeddings": "Nemotron-H has no positional encoding; it bounds the engine's max_model_len"}}


def covered(family, field):
    return field in COVERED or field in FAMILY_COVERED.get(family, {})


def probe(family, field):
    return FAMILY_PROBES.get(family, {}).get(field) or PROBES[field]


def edited(family, edits):
    raw = tiny_json(family)
    for key, value in edits.items():
        if value is DELETE:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def logits_both(family, raw):
    """transformers' and onepath's logits of one random model built from config.json `raw`."""
    config_cls, model_cls = FAMILIES[family]
    hf_config = config_cls.from_dict(raw)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = randomize(model_cls(hf_config).eval())
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 80, (n,), generator=g).tolist() for n in LENGTHS]
    with torch.no_grad():  # use_cache=False: transformers' NemotronH needs it for attention-free patterns
        want = torch.cat([hf(torch.tensor([s]), use_cache=False).logits[0] for s in seqs])
    config = ModelConfig.from_dict(raw)
    ours = build_decoder(config, Ops(ExecutionSpec(mode="consistent")), max_positions=64)
    ours.load_hf_state_dict(hf.state_dict())
    batch, num_blocks = ForwardBatch.for_sequences(seqs, 16)
    with torch.no_grad():
        got = ours.compute_logits(ours(batch, KVCache(config, num_blocks, 16, torch.float32)))
    return want, got


CASES = [(family, field) for family in sorted(FAMILIES) for field in IMPLEMENTED[family] if not covered(family, field)]


@pytest.mark.parametrize("family,field", CASES)
def test_an_implemented_field_changes_the_logits_as_in_transformers(family, field):
    a, b = probe(family, field)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on legacy rope fields
        want_a, got_a = logits_both(family, edited(family, a))
        want_b, got_b = logits_both(family, edited(family, b))
    assert want_a.shape != want_b.shape or (want_a - want_b).abs().max() > 100 * TOL, f"{field}: the probe moves nothing"
    torch.testing.assert_close(got_a, want_a, rtol=TOL, atol=TOL)
    torch.testing.assert_close(got_b, want_b, rtol=TOL, atol=TOL)


def test_every_implemented_field_is_probed():
    for family in FAMILIES:
        assert classify(family, "model_type") == "implemented"
        for field in IMPLEMENTED[family]:
            assert covered(family, field) or field in PROBES or field in FAMILY_PROBES.get(family, {}), (family, field)
