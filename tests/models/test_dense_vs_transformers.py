"""DenseDecoder against transformers, our independent reference for the architecture.

A small random model built by transformers, saved with save_pretrained, loaded by onepath: our
logits for a batch of awkward lengths must match transformers' for each sequence run alone.
Not bitwise: the two sides reduce in different orders (our consistent backend sums in fixed tiles
and trees, transformers' eager attention runs one matmul over the whole sequence; GEMMs pick
kernels by M), so FP32 rounding differs in the last bits and grows a little through the layers.
Our own checkpoint, read back by transformers, gives its logits bitwise: same weights, same code.
"""
import pytest
import torch

from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from onepath.models.batch import ForwardBatch
from onepath.models.checkpoint import INDEX, load_config, load_state_dict, save_checkpoint
from onepath.models.dense import DenseDecoder
from onepath.models.kv_cache import KVCache
from onepath.ops import ExecutionSpec, Ops
from tests.tiny import randomize

BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    "llama_gqa_llama3": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, rope_parameters=LLAMA3)),
    "llama_linear_bias": (LlamaConfig, LlamaForCausalLM, dict(
        num_key_value_heads=1, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5})),
    "qwen2_qkv_bias": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False,
                                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3_tied_bias": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=24, tie_word_embeddings=True,
                                                           attention_bias=True)),
    "qwen3_untied_sharded": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=24, num_attention_heads=6,
                                                                tie_word_embeddings=False)),
}
SHARDED = {"qwen3_untied_sharded": 20_000}  # bytes: several shards and an index
LENGTHS = (1, 17, 40)  # a single token, across a block and tile edge, three blocks
BLOCK_SIZE = 16
MAX_POSITIONS = 64
# FP32, logits up to ~4.4: measured max |diff| 1e-6 .. 3.5e-6 in both modes (a few ulps of the
# logit); 1e-5 leaves headroom for other CPUs' kernels and still catches a 1e-3 slip in one weight.
RTOL = ATOL = 1e-5


def hf_model(name):
    config_cls, model_cls, fields = CASES[name]
    config = config_cls(**{**BASE, **fields}, attn_implementation="eager")
    torch.manual_seed(0)
    model = model_cls(config).eval()
    # transformers inits norms to 1 and biases to 0: random values everywhere instead
    return randomize(model)


def sequences(vocab_size):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def reference_logits(model, seqs):
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0] for s in seqs]


def saved(model, path, name):
    model.save_pretrained(path, **({"max_shard_size": SHARDED[name]} if name in SHARDED else {}))
    assert (path / INDEX).exists() == (name in SHARDED)
    return path


def reload(path):
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    # from_pretrained leaves the weights in the safetensors mmap, aligned as the file's header falls;
    # torch's M = 1 GEMV rounds differently at another alignment (transformers' own save_pretrained
    # -> from_pretrained then differs from the original in the last bit), so re-home them as the
    # original's are: fresh allocations.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


def load_ours(path, mode):
    config = load_config(path)
    model = DenseDecoder(config, Ops(ExecutionSpec(mode=mode)), max_positions=MAX_POSITIONS)
    model.load_hf_state_dict(load_state_dict(path))
    return model


def our_logits(model, seqs):
    batch, num_blocks = ForwardBatch.for_sequences(seqs, BLOCK_SIZE)
    cache = KVCache(model.config, num_blocks, BLOCK_SIZE, torch.float32)
    with torch.no_grad():
        logits = model.compute_logits(model(batch, cache))
    return list(logits.split(LENGTHS))


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(tmp_path, name, mode):
    ref = hf_model(name)
    seqs = sequences(ref.config.vocab_size)
    want = reference_logits(ref, seqs)
    got = our_logits(load_ours(saved(ref, tmp_path, name), mode), seqs)
    for b, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, msg=lambda m: f"sequence {b}: {m}")
        assert torch.equal(g.argmax(-1), w.argmax(-1)), f"sequence {b}: greedy tokens differ"


@pytest.mark.parametrize("name", sorted(CASES))
def test_save_checkpoint_loads_in_transformers(tmp_path, name):
    ref = hf_model(name)
    ours = load_ours(saved(ref, tmp_path / "hf", name), "consistent")
    save_checkpoint(tmp_path / "ours", ours.hf_state_dict(), ours.config, max_shard_size=SHARDED.get(name))
    assert_reloads_as(ref, tmp_path / "ours")


def assert_reloads_as(ref, path):
    """transformers reads our checkpoint at `path` back into ref's class, its tensors and logits bitwise ref's."""
    back = reload(path)
    assert type(back) is type(ref)
    want_state, got_state = ref.state_dict(), back.state_dict()
    assert sorted(got_state) == sorted(want_state)
    assert all(torch.equal(got_state[k], t) for k, t in want_state.items())
    seqs = sequences(ref.config.vocab_size)
    for b, (g, w) in enumerate(zip(reference_logits(back, seqs), reference_logits(ref, seqs))):
        assert torch.equal(g, w), f"sequence {b}: max |diff| {(g - w).abs().max().item()}"


def _nudge_k_norm(model):
    model.model.layers[1].self_attn.k_norm.weight[0] += 1e-3


def _eps_1e_5(model):
    for module in model.modules():
        if hasattr(module, "eps"):
            module.eps = 1e-5


@pytest.mark.parametrize("slip", [_nudge_k_norm, _eps_1e_5])
def test_tolerance_catches_a_small_slip(tmp_path, slip):
    ref = hf_model("qwen3_tied_bias")
    seqs = sequences(ref.config.vocab_size)
    ours = load_ours(saved(ref, tmp_path, "qwen3_tied_bias"), "consistent")
    with torch.no_grad():
        slip(ours)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(torch.cat(our_logits(ours, seqs)), torch.cat(reference_logits(ref, seqs)),
                                   rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("tied", [False, True])
def test_pad_token_row_gets_transformers_gradient(tmp_path, tied):
    """pad_token_id is transformers' embedding padding_idx: the lookups of that row add nothing to its gradient
    (tied, the LM head's share still does). The embedding gradient of a batch holding the pad token matches
    transformers'; the control, the same forward without padding_idx, gives the pad row a gradient it lacks."""
    name = "qwen3_tied_bias" if tied else "qwen2_qkv_bias"
    config_cls, model_cls, fields = CASES[name]
    pad = 7
    torch.manual_seed(0)
    ref = randomize(model_cls(config_cls(**{**BASE, **fields}, pad_token_id=pad, attn_implementation="eager")))
    seq = [3, pad, 11, pad, 40, 2, pad, 9, 15]
    ref(torch.tensor([seq])).logits.float().square().mean().backward()
    want = ref.model.embed_tokens.weight.grad
    ours = load_ours(saved(ref, tmp_path, name), "consistent")
    assert ours.config.padding_idx == pad

    def embedding_grad(model):
        model.zero_grad(set_to_none=True)
        batch, num_blocks = ForwardBatch.for_sequences([seq], BLOCK_SIZE)
        logits = model.compute_logits(model(batch, KVCache(model.config, num_blocks, BLOCK_SIZE, torch.float32)))
        logits.float().square().mean().backward()
        return model.model.embed_tokens.weight.grad.clone()

    got = embedding_grad(ours)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    if not tied:
        assert not got[pad].any() and not want[pad].any(), "the pad row's lookups gave it a gradient"
    ours.config.pad_token_id = None  # the control: the same forward, padding_idx off
    control = embedding_grad(ours)
    assert not torch.allclose(control[pad], want[pad], rtol=1e-4, atol=1e-6), "the control matched transformers"
    others = torch.arange(BASE["vocab_size"]) != pad
    assert torch.equal(control[others], got[others]), "padding_idx moved another row's gradient"
