"""Sliding-window attention against transformers: Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE (and Mistral).

transformers' rule (masking_utils.sliding_window_overlay): a query at position p sees the keys
p - window < j <= p, itself included, which is onepath's attention `sliding_window` (ops/attention.py
_key_mask, the Triton kernel's first_key = p - window + 1). Which layers are windowed: layer_types
where the family defines it (Qwen2, Qwen3, Qwen2-MoE), else each family's own default rule, read
here from transformers' config itself. Logits in FP32 on the CPU must match to 1e-4 with a window
shorter than the sequences; the same weights without the window must differ by more (negative control).
"""
import pytest
import torch

from transformers import (MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from onepath.models import build_decoder
from onepath.models.batch import ForwardBatch
from onepath.models.config import ModelConfig
from onepath.models.kv_cache import KVCache
from onepath.ops import ExecutionSpec, Ops
from tests.tiny import randomize

BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True)
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16)),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(MOE, shared_expert_intermediate_size=40)),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(MOE, head_dim=16)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(head_dim=16)),
}
WINDOW = 7
LENGTHS = (1, 5, 23, 40)  # shorter than the window, across it, several windows long
BLOCK_SIZE = 16
MAX_POSITIONS = 64
# FP32, different reduction orders (tiles and trees against one matmul): a few ulps of the logits
TOL = 1e-4
# Each case: the family and the window fields of its config.json. "derived" cases drop layer_types from
# the file, as the published Qwen2.5 / Qwen3 config.json files do, so onepath derives it as transformers does.
CASES = {
    "qwen2_max_window_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
                                "derived"),
    "qwen2_layer_types": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=[
        "sliding_attention", "full_attention", "full_attention", "sliding_attention"]), "explicit"),
    "qwen3_max_window_layers": ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
                                "derived"),
    "qwen3_all_windowed": ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
                           "derived"),
    "qwen3_layer_types": ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=[
        "full_attention", "sliding_attention", "sliding_attention", "full_attention"]), "explicit"),
    "qwen2_moe_max_window_layers": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                      max_window_layers=2), "derived"),
    "qwen2_moe_layer_types": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=[
        "full_attention", "sliding_attention", "full_attention", "sliding_attention"]), "explicit"),
    "qwen3_moe_every_layer": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=WINDOW), "derived"),
    "mistral_every_layer": ("mistral", dict(sliding_window=WINDOW), "derived"),
}


def without_window(family, window):
    """The same config with no layer windowed: explicit layer_types all full_attention, else the switch off."""
    if "layer_types" in window:
        return {**window, "layer_types": ["full_attention"] * BASE["num_hidden_layers"]}
    return {**window, **({"sliding_window": None} if family == "mistral" else {"use_sliding_window": False})}


def hf_model(family, window):
    config_cls, model_cls, fields = FAMILIES[family]
    config = config_cls(**{**BASE, **fields, **window}, attn_implementation="eager")
    torch.manual_seed(0)
    return randomize(model_cls(config).eval())


def config_json(hf, how):
    raw = hf.config.to_dict()
    if how == "derived":
        raw.pop("layer_types", None)
    return raw


def sequences():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() for n in LENGTHS]


def reference_logits(model, seqs):
    with torch.no_grad():
        return torch.cat([model(torch.tensor([s])).logits[0] for s in seqs])


def our_logits(config, state, seqs, mode="consistent"):
    model = build_decoder(config, Ops(ExecutionSpec(mode=mode)), max_positions=MAX_POSITIONS)
    model.load_hf_state_dict(state)
    batch, num_blocks = ForwardBatch.for_sequences(seqs, BLOCK_SIZE)
    with torch.no_grad():
        return model.compute_logits(model(batch, KVCache(config, num_blocks, BLOCK_SIZE, torch.float32)))


def hf_windows(hf) -> list[int | None]:
    """The window of each layer of transformers' model, from its attention modules and masks' rule."""
    c = hf.config
    types = getattr(c, "layer_types", None) or ["sliding_attention" if c.sliding_window else "full_attention"] \
        * c.num_hidden_layers
    return [c.sliding_window if t == "sliding_attention" else None for t in types]


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_windowed_logits_match_transformers(name, mode):
    family, window, how = CASES[name]
    hf = hf_model(family, window)
    config = ModelConfig.from_dict(config_json(hf, how))
    assert [config.attention_window(i) for i in range(config.num_hidden_layers)] == hf_windows(hf)
    assert WINDOW in hf_windows(hf)
    seqs = sequences()
    got, want = our_logits(config, hf.state_dict(), seqs, mode), reference_logits(hf, seqs)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name", sorted(CASES))
def test_negative_control_the_window_changes_the_logits(name):
    """transformers' logits of the same weights without the window are further from the windowed ones than the
    tolerance, so the test above could fail; and onepath's own logits move with the window too."""
    family, window, how = CASES[name]
    hf = hf_model(family, window)
    seqs = sequences()
    windowed = reference_logits(hf, seqs)
    hf_full = hf_model(family, without_window(family, window))
    assert (reference_logits(hf_full, seqs) - windowed).abs().max() > 100 * TOL
    full = ModelConfig.from_dict({**config_json(hf, how), **without_window(family, window)})
    assert all(full.attention_window(i) is None for i in range(full.num_hidden_layers))
    assert (our_logits(full, hf.state_dict(), seqs) - windowed).abs().max() > 100 * TOL


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_window_semantics_match_transformers_mask(mode):
    """The keys each query reads through ops.attention's sliding_window are those transformers' mask allows,
    p - window < j <= p: equal scores and one-hot values make each output row the mean of the keys it sees."""
    from transformers.masking_utils import sliding_window_causal_mask_function
    n = 30
    batch, num_blocks = ForwardBatch.for_sequences([[0] * n], BLOCK_SIZE)
    q = k = torch.zeros(n, 1, n)
    v = torch.eye(n)[:, None, :]
    caches = (torch.zeros(num_blocks, BLOCK_SIZE, 1, n), torch.zeros(num_blocks, BLOCK_SIZE, 1, n))
    with torch.no_grad():
        out = Ops(ExecutionSpec(mode=mode)).attention(q, k, v, *caches, batch.attn, 1.0, WINDOW)[:, 0]
    theirs = sliding_window_causal_mask_function(WINDOW)(torch.tensor(0), torch.tensor(0), torch.arange(n)[:, None],
                                                         torch.arange(n)[None, :])
    assert torch.equal(out > 0, theirs)
    assert int(theirs[20].sum()) == WINDOW


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen2_moe"])
def test_sliding_layers_without_a_window_are_refused(family):
    raw = hf_model(family, {}).config.to_dict()
    raw.update(use_sliding_window=False, layer_types=["sliding_attention"] + ["full_attention"] * 3)
    with pytest.raises(ValueError, match=r"layers \[0\] are sliding_attention.*use_sliding_window"):
        ModelConfig.from_dict(raw)


def test_unknown_layer_types_are_refused_naming_them():
    raw = hf_model("qwen3", {}).config.to_dict()
    raw["layer_types"] = ["chunked_attention"] + ["full_attention"] * 3
    with pytest.raises(ValueError, match="chunked_attention"):
        ModelConfig.from_dict(raw)
    raw["layer_types"] = ["full_attention"] * 3
    with pytest.raises(ValueError, match="3 entries for num_hidden_layers 4"):
        ModelConfig.from_dict(raw)


def test_an_absent_window_size_reads_as_transformers_default():
    """A config.json that turns the window on without its size: transformers windows at 4096, so does onepath."""
    for family in ("qwen2", "qwen3_moe"):
        config_cls = FAMILIES[family][0]
        raw = {**BASE, **FAMILIES[family][2], "use_sliding_window": True, "max_window_layers": 0}
        ours = ModelConfig.from_dict({**raw, "model_type": family})
        assert ours.attention_window(0) == config_cls(**raw).sliding_window == 4096


@pytest.mark.parametrize("family,window", [("mistral", dict(sliding_window=0)),
                                           ("qwen2", dict(use_sliding_window=True, sliding_window=0,
                                                          max_window_layers=0))])
def test_an_empty_window_is_refused(family, window):
    """A window of 0 keys would leave a query nothing to attend to (transformers' mask gives NaN rows)."""
    raw = {**config_json(hf_model(family, {}), "derived"), **window}
    with pytest.raises(ValueError, match=r"layers \[0, 1, 2, 3\] are sliding_attention but the window is 0"):
        ModelConfig.from_dict(raw)
