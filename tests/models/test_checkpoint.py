import json

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from onepath.models.checkpoint import (INDEX, WEIGHTS, load_config, load_state_dict, load_tokenizer,
                                       load_tokenizer_config, save_checkpoint)

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
SHARD = 20_000  # bytes: the tiny models split into several shards


def tiny_model(kind):
    torch.manual_seed(0)
    if kind == "llama":  # tied, with a scaled rope
        config = LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters={
            "rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0})
        return LlamaForCausalLM(config)
    return Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=False, rope_theta=1e6))


def expected_tensors(model):
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def word_tokenizer():
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "one", "plus", "two", "is", "three"])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return tok


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("max_shard_size", [None, SHARD])
def test_load_state_dict_reads_save_pretrained(tmp_path, kind, max_shard_size):
    model = tiny_model(kind)
    model.save_pretrained(tmp_path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    assert (tmp_path / INDEX).exists() == (max_shard_size is not None)
    assert_same(load_state_dict(tmp_path), expected_tensors(model))


def test_load_state_dict_casts_floats(tmp_path):
    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    state = load_state_dict(tmp_path, dtype=torch.bfloat16)
    want = expected_tensors(model)
    for name, tensor in state.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, want[name].to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_load_config_reads_fields(tmp_path, kind):
    model = tiny_model(kind)
    model.save_pretrained(tmp_path)
    config = load_config(tmp_path)
    assert config.model_type == kind
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 97)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.head_dim == model.config.head_dim
    assert config.tie_word_embeddings == model.config.tie_word_embeddings
    assert config.rope_theta == model.config.rope_parameters["rope_theta"]
    assert config.rope_scaling == ({"rope_type": "linear", "factor": 2.0} if kind == "llama" else None)
    assert (config.bos_token_id, config.eos_token_ids, config.torch_dtype) == (1, (2,), "float32")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("max_shard_size", [None, SHARD])
def test_save_checkpoint_round_trip(tmp_path, kind, max_shard_size):
    model = tiny_model(kind)
    model.save_pretrained(tmp_path / "hf")
    config = load_config(tmp_path / "hf")
    ours = tmp_path / "ours"
    save_checkpoint(ours, model.state_dict(), config, max_shard_size=max_shard_size)
    assert_same(load_state_dict(ours), expected_tensors(model))
    assert load_config(ours) == config
    assert json.loads((ours / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}

    if max_shard_size is not None:
        index = json.loads((ours / INDEX).read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and not (ours / WEIGHTS).exists()
        for shard in shards:
            tensors = load_file(ours / shard)
            assert sorted(tensors) == sorted(k for k, v in index["weight_map"].items() if v == shard)
            assert len(tensors) == 1 or sum(t.nbytes for t in tensors.values()) <= max_shard_size
        assert index["metadata"]["total_size"] == sum(t.nbytes for t in expected_tensors(model).values())

    loaded, info = AutoModelForCausalLM.from_pretrained(ours, output_loading_info=True)
    assert type(loaded) is type(model)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_same(loaded.state_dict(), model.state_dict())


def test_round_trip_keeps_one_ulp(tmp_path):
    # Negative control: a one-ulp change to one weight survives save and load, and the comparison sees it.
    model = tiny_model("qwen3")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    w = state["model.norm.weight"]
    w[0] = torch.nextafter(w[0], torch.tensor(2.0))
    save_checkpoint(tmp_path / "ours", state, load_config_of(model, tmp_path))
    got = load_state_dict(tmp_path / "ours")
    assert torch.equal(got["model.norm.weight"], w)
    with pytest.raises(AssertionError, match="model.norm.weight"):
        assert_same(got, model.state_dict())


def test_save_checkpoint_marks_dtype(tmp_path):
    model = tiny_model("qwen3").to(torch.bfloat16)
    save_checkpoint(tmp_path / "ours", model.state_dict(), load_config_of(model, tmp_path))
    raw = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert raw["torch_dtype"] == raw["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype="auto").dtype == torch.bfloat16


def load_config_of(model, tmp_path):
    model.save_pretrained(tmp_path / "hf")
    return load_config(tmp_path / "hf")


def test_save_checkpoint_unshares_views(tmp_path):
    config = load_config_of(tiny_model("qwen3"), tmp_path)
    base = torch.randn(8, 6)
    state = {"a": base, "a_view": base[2:5], "transposed": base.t(), "alias": base}
    save_checkpoint(tmp_path / "ours", state, config)
    got = load_state_dict(tmp_path / "ours")
    assert_same(got, {k: v.contiguous() for k, v in state.items()})


def test_save_checkpoint_replaces_existing(tmp_path):
    config = load_config_of(tiny_model("qwen3"), tmp_path)
    target = tmp_path / "ckpt"
    save_checkpoint(target, {"w": torch.zeros(3)}, config, max_shard_size=4)  # sharded first
    save_checkpoint(target, {"w": torch.ones(3)}, config)
    assert torch.equal(load_state_dict(target)["w"], torch.ones(3))
    assert not (target / INDEX).exists()  # nothing of the old checkpoint survives
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]  # no temporary siblings left


def test_save_checkpoint_failure_leaves_old(tmp_path):
    config = load_config_of(tiny_model("qwen3"), tmp_path)
    target = tmp_path / "ckpt"
    save_checkpoint(target, {"w": torch.zeros(3)}, config)
    with pytest.raises(TypeError):
        save_checkpoint(target, {"w": torch.ones(3)}, config, tokenizer_config={"bad": object()})
    assert torch.equal(load_state_dict(target)["w"], torch.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]


def test_tokenizer_round_trip(tmp_path):
    config = load_config_of(tiny_model("qwen3"), tmp_path)
    tok = word_tokenizer()
    tok_config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{{ messages }}"}
    save_checkpoint(tmp_path / "ours", {}, config, tokenizer=tok, tokenizer_config=tok_config)
    loaded = load_tokenizer(tmp_path / "ours")
    assert loaded.encode("one plus two is three").ids == [3, 4, 5, 6, 7] == tok.encode("one plus two is three").ids
    assert loaded.encode("one minus two").ids == [3, 0, 5]
    assert load_tokenizer_config(tmp_path / "ours") == tok_config
    assert load_tokenizer_config(tmp_path / "hf") == {}


# Bad inputs: each error names the file at fault.

def test_invalid_json_config(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_config(tmp_path)


def test_config_missing_hidden_size(tmp_path):
    raw = tiny_model("qwen3").config.to_dict()
    del raw["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"config\.json.*hidden_size"):
        load_config(tmp_path)


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_config(tmp_path)


def test_missing_shard(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path, max_shard_size=SHARD)
    index = json.loads((tmp_path / INDEX).read_text())
    shard = index["weight_map"]["model.norm.weight"]
    first = next(name for name, file in index["weight_map"].items() if file == shard)
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{shard} is missing: .*{first}.*re-download"):
        load_state_dict(tmp_path)


def test_no_weights(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=rf"no weights in .*{WEIGHTS}.*{INDEX}.*pytorch_model\.bin"):
        load_state_dict(tmp_path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_weights(tmp_path, damage):
    tiny_model("qwen3").save_pretrained(tmp_path)
    file = tmp_path / WEIGHTS
    data = file.read_bytes()
    file.write_bytes(b"not a safetensors file" if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{WEIGHTS} is unreadable"):
        load_state_dict(tmp_path)


def test_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json is missing"):
        load_tokenizer(tmp_path)


def test_not_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_state_dict(tmp_path / "nowhere")
