"""NemotronHDecoder against transformers' NemotronHForCausalLM, our independent reference for the architecture.

Ten random small configs cover every layer kind (Mamba-2, attention, MLP, MoE) and option (n_groups, conv taps and
bias, projection biases, time_step_limit, chunk sizes, GQA, latent experts, group routing, scaling, unnormalised
weights, the correction bias, the legacy pattern and names). transformers saves each with save_pretrained (the hub
layout: backbone.*, one up/down projection per expert); onepath loads it and its FP32 logits match transformers'
for each sequence run alone, within 1e-4 (different reduction orders). Our checkpoint, read back by transformers,
gives transformers' logits bitwise.
"""
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, NemotronHConfig, NemotronHForCausalLM

from onepath.models import build_decoder
from onepath.models.batch import ForwardBatch
from onepath.models.checkpoint import CONFIG, WEIGHTS, load_config, load_state_dict, save_checkpoint
from onepath.models.config import ModelConfig
from onepath.models.nemotron_h import NemotronHDecoder
from onepath.ops import ExecutionSpec, Ops
from tests.tiny import randomize

BASE = dict(vocab_size=101, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=40, mamba_num_heads=4, mamba_head_dim=6, ssm_state_size=5, n_groups=2, conv_kernel=4,
            chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
            moe_shared_expert_intermediate_size=20, tie_word_embeddings=False)
ALL = ["linear_attention", "moe", "full_attention", "mlp"]
CASES = {
    "every_kind": dict(layers_block_type=ALL + ["linear_attention"]),
    "one_group_no_conv_bias": dict(layers_block_type=["linear_attention", "mlp", "linear_attention"], n_groups=1,
                                   use_conv_bias=False, conv_kernel=3),
    "group_per_head_biases": dict(layers_block_type=["linear_attention", "full_attention", "mlp"], n_groups=4,
                                  use_bias=True, mlp_bias=True, conv_kernel=2),
    "dt_limited": dict(layers_block_type=["linear_attention", "linear_attention", "mlp"],
                       time_step_limit=(0.05, 0.4), chunk_size=4),
    "long_chunk_wide_state": dict(layers_block_type=["linear_attention", "full_attention"], chunk_size=16,
                                  ssm_state_size=12, mamba_num_heads=6, mamba_head_dim=4, n_groups=3),
    "mqa_attention": dict(layers_block_type=["full_attention", "mlp", "linear_attention"], num_key_value_heads=1,
                          head_dim=12),
    "latent_experts": dict(layers_block_type=["linear_attention", "moe", "moe"], moe_latent_size=16, mlp_bias=True),
    "grouped_routing": dict(layers_block_type=["moe", "linear_attention", "moe"], n_routed_experts=8, n_group=4,
                            topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.5),
    "unnormalised_weights": dict(layers_block_type=["linear_attention", "moe"], norm_topk_prob=False,
                                 routed_scaling_factor=0.5, n_routed_experts=6),
    "legacy_pattern": dict(hybrid_override_pattern="M*ME-", mamba_n_groups=4, mamba_d_conv=3, layer_norm_epsilon=1e-3),
}
LENGTHS = (1, 7, 17, 40)   # one token, within a chunk, a chunk and a bit, several chunks
SPEC = ExecutionSpec(mode="consistent").with_op("ssd", chunk=16)
TOL = 1e-4


def hf_model(name: str, seed: int = 0) -> NemotronHForCausalLM:
    fields = {**BASE, **CASES[name]}
    if "hybrid_override_pattern" in fields:
        fields.pop("layers_block_type", None)
    config = NemotronHConfig(**fields, attn_implementation="eager")
    torch.manual_seed(seed)
    return nontrivial(randomize(NemotronHForCausalLM(config).eval(), seed + 1), seed)


def nontrivial(model, seed):
    """randomize() leaves A near -1 and the correction bias zero: decays from -1 to -12, dt_bias around softplus^-1
    of 0.01 .. 1, a correction bias that moves the choice."""
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("A_log"):
                t.copy_(torch.log(1 + 11 * torch.rand(t.shape, generator=g)))
            elif name.endswith("dt_bias"):
                t.copy_(torch.empty(t.shape).uniform_(-4.6, 0.5, generator=g))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.3 * torch.randn(t.shape, generator=g))
    return model


def sequences(vocab_size, lengths=LENGTHS, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def reference_logits(model, seqs):
    with torch.no_grad():
        return [model(torch.tensor([s]), use_cache=False).logits[0] for s in seqs]


def our_logits(model, seqs):
    batch, num_blocks = ForwardBatch.for_sequences(seqs, 16)
    with torch.no_grad():
        logits = model.compute_logits(model(batch, model.make_cache(num_blocks, 16)))
    return list(logits.split([len(s) for s in seqs]))


def load_ours(path, spec=SPEC) -> NemotronHDecoder:
    model = build_decoder(load_config(path), Ops(spec))
    model.load_hf_state_dict(load_state_dict(path))
    return model


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(tmp_path, name, mode):
    ref = hf_model(name)
    ref.save_pretrained(tmp_path)
    with safe_open(tmp_path / WEIGHTS, "pt") as f:
        assert all(k.startswith(("backbone.", "lm_head.")) for k in f.keys())  # the hub layout
    model = load_ours(tmp_path, SPEC.with_mode(mode))
    assert isinstance(model, NemotronHDecoder)
    seqs = sequences(ref.config.vocab_size)
    for b, (g, w) in enumerate(zip(our_logits(model, seqs), reference_logits(ref, seqs))):
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL, msg=lambda m: f"sequence {b}: {m}")


def test_the_cases_cover_every_layer_kind_and_option():
    configs = [NemotronHConfig(**{**BASE, **{k: v for k, v in c.items()}}) for c in CASES.values()]
    kinds = {t for c in configs for t in c.layers_block_type}
    assert kinds == set(ALL)
    seen = lambda f: {getattr(c, f) if not isinstance(getattr(c, f), list) else tuple(getattr(c, f)) for c in configs}
    for option in ("n_groups", "use_conv_bias", "conv_kernel", "use_bias", "mlp_bias", "time_step_limit", "chunk_size",
                   "num_key_value_heads", "moe_latent_size", "n_group", "routed_scaling_factor", "norm_topk_prob",
                   "layer_norm_epsilon"):
        assert len(seen(option)) > 1, option


def test_a_model_differing_in_one_weight_fails_the_comparison(tmp_path):
    """Negative control: the tolerance is tight enough to see a 1e-3 change of one A_log entry."""
    ref = hf_model("every_kind")
    ref.save_pretrained(tmp_path)
    model = load_ours(tmp_path)
    with torch.no_grad():
        model.model.layers[0].mixer.A_log[1] += 1e-3
    seqs = sequences(ref.config.vocab_size)
    diffs = [(g - w).abs().max() for g, w in zip(our_logits(model, seqs), reference_logits(ref, seqs))]
    assert max(diffs) > 2 * TOL


def test_the_in_memory_layout_loads_with_the_same_bits(tmp_path):
    """transformers' state_dict (model.*, experts fused [E, I, D]) loads as the hub files do; mtp.* tensors (MTP
    layers transformers builds none of) are skipped."""
    ref = hf_model("latent_experts")
    ref.save_pretrained(tmp_path)
    from_files = load_ours(tmp_path)
    in_memory = build_decoder(from_files.config, Ops(SPEC))
    in_memory.load_hf_state_dict({**ref.state_dict(), "mtp.layers.0.norm.weight": torch.ones(3)})
    seqs = sequences(ref.config.vocab_size)
    assert all(torch.equal(a, b) for a, b in zip(our_logits(in_memory, seqs), our_logits(from_files, seqs)))


def reload(path):
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():  # fresh allocations, as the original's (test_dense_vs_transformers.reload)
        for p in [*model.parameters(), *model.buffers()]:
            p.data = p.data.clone()
    return model


@pytest.mark.parametrize("name", ["every_kind", "latent_experts", "legacy_pattern"])
def test_save_checkpoint_loads_in_transformers_bitwise(tmp_path, name):
    ref = hf_model(name)
    ref.save_pretrained(tmp_path / "hf")
    ours = load_ours(tmp_path / "hf")
    save_checkpoint(tmp_path / "ours", ours.hf_state_dict(), ours.config)
    raw = json.loads((tmp_path / "ours" / CONFIG).read_text())
    assert raw["architectures"] == ["NemotronHForCausalLM"] and raw["layers_block_type"] == ref.config.layers_block_type
    back = reload(tmp_path / "ours")
    assert type(back) is NemotronHForCausalLM
    want, got = ref.state_dict(), back.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], t) for k, t in want.items())
    seqs = sequences(ref.config.vocab_size)
    for b, (g, w) in enumerate(zip(reference_logits(back, seqs), reference_logits(ref, seqs))):
        assert torch.equal(g, w), f"sequence {b}: max |diff| {(g - w).abs().max().item()}"
    assert ModelConfig.from_dict(raw) == ours.config


@pytest.mark.parametrize("edit, message", [
    (dict(layers_block_type=["linear_attention", "sliding_attention"]),
     "layers_block_type names 'sliding_attention' at layer 1"),
    (dict(layers_block_type=None, hybrid_override_pattern="M*X"), "hybrid_override_pattern 'M\\*X' has 'X' at layer 2"),
    (dict(mamba_num_heads=6, n_groups=4), "mamba_num_heads 6 is not a multiple of n_groups 4"),
    (dict(time_step_limit=[0.5, 0.1]), "time_step_limit \\[0.5, 0.1\\]"),
    (dict(mamba_ssm_cache_dtype="float8"), "mamba_ssm_cache_dtype 'float8'"),
    (dict(n_routed_experts=6, n_group=4), "n_routed_experts 6 is not a multiple of n_group 4"),
    (dict(n_routed_experts=4, n_group=4), "n_group 4 leaves 1 expert per group"),
    (dict(n_routed_experts=8, n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok 3 exceeds the 2"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act = 'silu' is not supported"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings = True is not supported"),
])
def test_bad_config_names_the_field(edit, message):
    raw = {**NemotronHConfig(**BASE, layers_block_type=ALL).to_dict(), **edit}
    if raw.get("layers_block_type") is None:
        raw.pop("layers_block_type")
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_a_chunk_size_that_does_not_divide_the_spec_tile_is_refused():
    config = ModelConfig.from_dict(NemotronHConfig(**{**BASE, "chunk_size": 32}, layers_block_type=ALL).to_dict())
    with pytest.raises(ValueError, match="chunk_size 32 does not divide the spec's ssd.chunk 16"):
        build_decoder(config, Ops(SPEC))
    build_decoder(config, Ops(SPEC.with_op("ssd", chunk=64)))
    no_mamba = ModelConfig.from_dict(NemotronHConfig(**{**BASE, "chunk_size": 32}, layers_block_type=["mlp"]).to_dict())
    build_decoder(no_mamba, Ops(SPEC))  # nothing to scan: any chunk_size


def test_a_checkpoint_with_mismatched_mamba_dims_names_the_tensor(tmp_path):
    ref = hf_model("every_kind")
    ref.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / CONFIG).read_text())
    (tmp_path / CONFIG).write_text(json.dumps({**raw, "ssm_state_size": 6}))
    with pytest.raises(ValueError, match="tensor model.layers.0.mixer.in_proj.weight has shape"):
        load_ours(tmp_path)
