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

from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

from onepath.models import build_decoder
from onepath.models.batch import ForwardBatch
from onepath.models.config import ModelConfig
from onepath.models.fields import IMPLEMENTED, NO_MATH, REFUSED, classify, unclassified
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
}
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")
TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
TINY_FAMILY = {"qwen2_moe": dict(TINY_MOE, shared_expert_intermediate_size=24), "qwen3_moe": TINY_MOE}
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
    assert {"vocab_size", "hidden_size", "rope_parameters", "use_cache"} <= fields  # the walk found the config
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
}
# implemented fields no probe can isolate, with the test that covers them
COVERED = {"model_type": "picks the decoder and its rules: every case here builds one per family",
           "pad_token_id": "moves no logit, only the pad row's gradient: test_dense_vs_transformers.py's "
                           "test_pad_token_row_gets_transformers_gradient"}


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
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    config = ModelConfig.from_dict(raw)
    ours = build_decoder(config, Ops(ExecutionSpec(mode="consistent")), max_positions=64)
    ours.load_hf_state_dict(hf.state_dict())
    batch, num_blocks = ForwardBatch.for_sequences(seqs, 16)
    with torch.no_grad():
        got = ours.compute_logits(ours(batch, KVCache(config, num_blocks, 16, torch.float32)))
    return want, got


CASES = [(family, field) for family in sorted(FAMILIES) for field in IMPLEMENTED[family] if field not in COVERED]


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
            assert field in COVERED or field in PROBES or field in FAMILY_PROBES.get(family, {}), (family, field)
