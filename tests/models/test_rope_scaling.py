import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from onepath.models.config import ModelConfig
from onepath.models.rope_scaling import cos_sin_table, inv_freq

SMALL = dict(vocab_size=97, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2)
HALF = 8  # head_dim 16


def _longrope(**extra):
    return {"rope_type": "longrope", "original_max_position_embeddings": 32,
            "short_factor": [1.0 + 0.25 * i for i in range(HALF)],
            "long_factor": [2.0 + 0.5 * i for i in range(HALF)], **extra}


CASES = {
    "default": (dict(rope_theta=10000.0), None),
    "default_int_theta": (dict(rope_theta=1000000), None),
    "linear": (dict(rope_theta=10000.0), {"rope_type": "linear", "factor": 2.5}),
    "dynamic": (dict(rope_theta=10000.0), {"rope_type": "dynamic", "factor": 3.0}),
    "yarn": (dict(rope_theta=10000.0), {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "yarn_mscale": (dict(rope_theta=1000000.0), {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                                                 "mscale_all_dim": 0.707, "beta_fast": 24, "beta_slow": 2,
                                                 "original_max_position_embeddings": 16}),
    "yarn_untruncated": (dict(rope_theta=10000.0), {"rope_type": "yarn", "factor": 4.0, "truncate": False,
                                                    "attention_factor": 1.25,
                                                    "original_max_position_embeddings": 32}),
    "llama3": (dict(rope_theta=500000.0, hidden_size=256, num_attention_heads=4),
               {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
    "longrope": (dict(rope_theta=10000.0), _longrope()),
    "longrope_no_factor": (dict(rope_theta=10000.0, max_position_embeddings=512), _longrope()),
}


def _configs(name):
    fields, scaling = CASES[name]
    kw = dict(SMALL, hidden_size=64, num_attention_heads=4, max_position_embeddings=128)
    kw.update(fields)
    theta = kw.pop("rope_theta")
    hf = LlamaConfig(**kw, rope_parameters={"rope_theta": theta, **(scaling or {"rope_type": "default"})})
    # Through config.json's dict, as a checkpoint would arrive.
    return hf, ModelConfig.from_dict(hf.to_dict())


def _reference(hf):
    rope_type = hf.rope_parameters["rope_type"]
    fn = LlamaRotaryEmbedding.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
    return fn(hf)


@pytest.mark.parametrize("name", sorted(CASES))
def test_inv_freq_matches_transformers(name):
    hf, ours = _configs(name)
    ref_inv, ref_scaling = _reference(hf)
    got_inv, got_scaling = inv_freq(ours)
    assert got_inv.dtype == torch.float32 and got_inv.shape == (ours.head_dim // 2,)
    assert torch.equal(got_inv, ref_inv)
    assert got_scaling == ref_scaling


@pytest.mark.parametrize("name", sorted(CASES))
def test_cos_sin_table_matches_rotary_forward(name):
    hf, ours = _configs(name)
    positions = 31 if name.startswith("longrope") else 127  # odd: vector tails on CPU
    rotary = LlamaRotaryEmbedding(hf)
    x = torch.zeros(1, dtype=torch.float32)
    ref_cos, ref_sin = rotary(x, torch.arange(positions)[None])
    cos, sin = cos_sin_table(ours, positions)
    half = ours.head_dim // 2
    assert cos.shape == (positions, half) and cos.dtype == torch.float32
    assert torch.equal(cos, ref_cos[0, :, :half]) and torch.equal(cos, ref_cos[0, :, half:])
    assert torch.equal(sin, ref_sin[0, :, :half]) and torch.equal(sin, ref_sin[0, :, half:])


def test_table_order_matters():
    # Negative control: the same math in float64, rounded once at the end, is not bit-equal.
    _, ours = _configs("yarn")
    inv, scaling = inv_freq(ours)
    freqs = torch.arange(128, dtype=torch.float64)[:, None] * inv.double()
    cos, _ = cos_sin_table(ours, 128)
    assert not torch.equal(cos, (freqs.cos() * scaling).float())


def test_legacy_type_key():
    base = dict(SMALL, hidden_size=64, num_attention_heads=4)
    legacy = ModelConfig(**base, rope_scaling={"type": "linear", "factor": 2.0})
    modern = ModelConfig(**base, rope_scaling={"rope_type": "linear", "factor": 2.0})
    plain = ModelConfig(**base)
    assert torch.equal(inv_freq(legacy)[0], inv_freq(modern)[0])
    assert not torch.equal(inv_freq(legacy)[0], inv_freq(plain)[0])


def test_legacy_rope_scaling_json_matches_transformers():
    raw = dict(SMALL, hidden_size=64, num_attention_heads=4, rope_theta=5000.0,
               rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64})
    hf = LlamaConfig.from_dict(raw)
    ref_inv, ref_scaling = _reference(hf)
    got_inv, got_scaling = inv_freq(ModelConfig.from_dict(raw))
    assert torch.equal(got_inv, ref_inv) and got_scaling == ref_scaling


def test_unknown_type_is_refused_at_load_naming_it():
    with pytest.raises(ValueError, match="'su'.*llama3"):
        ModelConfig(**SMALL, hidden_size=64, num_attention_heads=4, rope_scaling={"rope_type": "su", "factor": 2})


def test_partial_rotary_refused_at_load():
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        ModelConfig(**SMALL, hidden_size=64, num_attention_heads=4,
                    rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5})


@pytest.mark.parametrize("name,limit", [("dynamic", 128), ("longrope", 32)])
def test_table_refuses_lengths_transformers_rescales(name, limit):
    _, ours = _configs(name)
    cos_sin_table(ours, limit)
    with pytest.raises(ValueError, match=f"max_positions {limit + 1} > {limit}"):
        cos_sin_table(ours, limit + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(CASES))
def test_cos_sin_table_matches_rotary_forward_on_cuda(name):
    # transformers computes inv_freq on the CPU and cos/sin on the model's device; so does the table.
    hf, ours = _configs(name)
    positions = {"dynamic": 128, "longrope": 32, "longrope_no_factor": 32}.get(name, 4099)
    rotary = LlamaRotaryEmbedding(hf).to("cuda")
    x = torch.zeros(1, dtype=torch.float32, device="cuda")
    ref_cos, ref_sin = rotary(x, torch.arange(positions, device="cuda")[None])
    cos, sin = cos_sin_table(ours, positions, device="cuda")
    half = ours.head_dim // 2
    assert cos.device.type == "cuda"
    assert torch.equal(cos, ref_cos[0, :, :half]) and torch.equal(sin, ref_sin[0, :, :half])
