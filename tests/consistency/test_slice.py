"""slice keeps the chosen layers bit for bit: the sliced model runs exactly as a model built by hand
from those layers of the full one (consistent mode, torch.equal), and transformers loads it whole.

The full models are random 4-layer transformers models saved with save_pretrained (tied Llama,
untied Qwen3, one sharded), every tensor drawn at random so a wrong layer shows in the logits; the
slice takes the middle two layers. Negative control: the hand-built model from the first two layers
gives other logits."""
import json
from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from onepath.consistency.slice import main, slice_checkpoint, slice_config
from onepath.models.batch import ForwardBatch
from onepath.models.checkpoint import INDEX, WEIGHTS, load_config, load_state_dict
from onepath.models.dense import DenseDecoder
from onepath.models.kv_cache import KVCache
from onepath.ops import ExecutionSpec, Ops

BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
SHARD = 60_000  # bytes: the full model splits into several shards
START, LAYERS = 1, 2
SEQS = [[5, 9, 14, 3, 22, 41, 7], [60, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]
BLOCK_SIZE = 8


def hf_model(kind: str, **fields):
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**BASE, tie_word_embeddings=True, **fields))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**BASE, head_dim=24, tie_word_embeddings=False, **fields))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else noise / p.shape[-1] ** 0.5)
    return model.eval()


def full_checkpoint(tmp_path, kind: str, sharded: bool = False, **fields):
    path = tmp_path / "full"
    hf_model(kind, **fields).save_pretrained(path, **({"max_shard_size": SHARD} if sharded else {}))
    assert (path / INDEX).exists() == sharded
    tok = Tokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "one": 3}, unk_token="<unk>"))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


def consistent(config) -> DenseDecoder:
    return DenseDecoder(config, Ops(ExecutionSpec(mode="consistent")), max_positions=64)


def load_ours(path) -> DenseDecoder:
    model = consistent(load_config(path))
    model.load_hf_state_dict(load_state_dict(path))
    return model


def by_hand(full: DenseDecoder, start: int, count: int) -> DenseDecoder:
    """A DenseDecoder of `count` layers whose modules are copies of the full model's from `start` on."""
    layer_types = full.config.layer_types and full.config.layer_types[start:start + count]
    config = replace(full.config, num_hidden_layers=count, layer_types=layer_types)
    model = consistent(config)
    with torch.no_grad():
        model.model.embed_tokens.load_state_dict(full.model.embed_tokens.state_dict())
        model.model.norm.load_state_dict(full.model.norm.state_dict())
        for i in range(count):
            model.model.layers[i].load_state_dict(full.model.layers[start + i].state_dict())
        if not config.tie_word_embeddings:
            model.lm_head.weight.copy_(full.lm_head.weight)
    return model


def logits(model: DenseDecoder) -> torch.Tensor:
    batch, num_blocks = ForwardBatch.for_sequences(SEQS, BLOCK_SIZE)
    with torch.no_grad():
        return model.compute_logits(model(batch, KVCache(model.config, num_blocks, BLOCK_SIZE, torch.float32)))


@pytest.mark.parametrize("kind,sharded", [("llama", False), ("qwen3", True)])
def test_slice_equals_the_layers_it_cut(tmp_path, capsys, kind, sharded):
    full_path = full_checkpoint(tmp_path, kind, sharded)
    out = tmp_path / "slice"
    assert main([str(full_path), str(out), "--layers", str(LAYERS), "--start", str(START)]) == 0
    printed = capsys.readouterr().out
    assert f"sliced layers {START}..{START + LAYERS - 1} of 4" in printed
    assert "every kind of layer in the model is in the slice (1)" in printed

    full_cfg, cfg = load_config(full_path), load_config(out)
    resliced = {"layer_types": ["full_attention"] * LAYERS, "max_window_layers": LAYERS} if kind == "qwen3" else {}
    named = {k: v for k, v in resliced.items() if hasattr(full_cfg, k)}  # ModelConfig's fields; the rest in extra
    assert cfg == replace(full_cfg, num_hidden_layers=LAYERS, **named,
                          extra={**full_cfg.extra, **{k: v for k, v in resliced.items() if k not in named}})
    full_state, state = load_state_dict(full_path), load_state_dict(out)
    want = {}
    for key, t in full_state.items():
        if not key.startswith("model.layers."):
            want[key] = t
            continue
        _, _, i, rest = key.split(".", 3)
        if START <= int(i) < START + LAYERS:
            want[f"model.layers.{int(i) - START}.{rest}"] = t
    assert sorted(state) == sorted(want)
    assert all(torch.equal(state[k], t) and state[k].dtype == t.dtype for k, t in want.items())
    assert ("lm_head.weight" in state) == (kind == "qwen3")  # tied stays tied
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (full_path / name).read_bytes()
    assert (out / WEIGHTS).exists() and not (out / INDEX).exists()

    full = load_ours(full_path)
    got = logits(load_ours(out))
    assert torch.equal(got, logits(by_hand(full, START, LAYERS)))
    assert not torch.equal(got, logits(by_hand(full, 0, LAYERS)))  # negative control: other layers

    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert loaded.config.num_hidden_layers == LAYERS and loaded.config.tie_word_embeddings == (kind == "llama")
    hf_state = loaded.state_dict()
    assert all(torch.equal(hf_state[k], t) for k, t in want.items())


def test_slice_reports_a_kind_of_layer_it_lacks(tmp_path, capsys):
    # layers 0-1 full attention, 2-3 sliding window: the first two alone lack the sliding kind
    path = full_checkpoint(tmp_path, "qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    report = slice_checkpoint(path, tmp_path / "first", LAYERS)
    assert (report.kinds, report.missing_kinds) == (2, ["layer 2: sliding_attention"])
    assert "WARNING: the slice lacks 1 of the model's 2 kinds" in report.format()
    report = slice_checkpoint(path, tmp_path / "middle", LAYERS, start=1)
    assert report.missing_kinds == []
    raw = json.loads((tmp_path / "middle" / "config.json").read_text())
    assert raw["layer_types"] == ["full_attention", "sliding_attention"] and raw["max_window_layers"] == 1
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "middle").config.layer_types == raw["layer_types"]


def test_slice_config_reindexes_per_layer_fields():
    raw = {"num_hidden_layers": 6, "layer_types": list("abcdef"), "mlp_only_layers": [0, 2, 3, 5],
           "first_k_dense_replace": 3, "max_window_layers": 1, "decoder_sparse_step": 2, "hidden_size": 8}
    got = slice_config(raw, 2, 3)
    assert got == {**raw, "num_hidden_layers": 3, "layer_types": ["c", "d", "e"], "mlp_only_layers": [0, 1],
                   "first_k_dense_replace": 1, "max_window_layers": 0}
    assert raw["num_hidden_layers"] == 6  # the source config is not touched
    with pytest.raises(ValueError, match="decoder_sparse_step 2.*multiple of 2"):
        slice_config(raw, 1, 2)
    with pytest.raises(ValueError, match="layer_types has 6 entries for 5 layers"):
        slice_config({**raw, "num_hidden_layers": 5}, 0, 2)


@pytest.mark.parametrize("layers,start", [(0, 0), (5, 0), (2, 3), (1, -1)])
def test_layers_out_of_range(tmp_path, layers, start):
    path = full_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match=rf"--layers {layers} --start {start} .* model has layers 0\.\.3"):
        slice_checkpoint(path, tmp_path / "out", layers, start)
    assert not (tmp_path / "out").exists()


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        slice_checkpoint(tmp_path / "nowhere", tmp_path / "out", 2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        slice_checkpoint(tmp_path / "empty", tmp_path / "out", 2)
    path = full_checkpoint(tmp_path, "qwen3", sharded=True)
    with pytest.raises(ValueError, match="is or holds the model"):
        slice_checkpoint(path, path, 2)
    with pytest.raises(ValueError, match="is or holds the model"):
        slice_checkpoint(path, tmp_path, 2)
    (tmp_path / "taken").mkdir()
    with pytest.raises(ValueError, match="taken exists: .*--overwrite"):
        slice_checkpoint(path, tmp_path / "taken", 2)
    slice_checkpoint(path, tmp_path / "taken", 2, overwrite=True)
    assert load_config(tmp_path / "taken").num_hidden_layers == 2

    shard = json.loads((path / INDEX).read_text())["weight_map"]["model.layers.3.mlp.up_proj.weight"]
    (path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{shard} is missing"):
        slice_checkpoint(path, tmp_path / "out", 2)
    for p in path.glob("*.safetensors*"):
        p.unlink()
    with pytest.raises(FileNotFoundError, match="no weights in"):
        slice_checkpoint(path, tmp_path / "out", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full", "taken"]  # nothing half-written


def test_config_without_the_layers_it_counts(tmp_path):
    path = full_checkpoint(tmp_path, "llama")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 6}))
    with pytest.raises(ValueError, match=r"no tensors for layers \[4, 5\]"):
        slice_checkpoint(path, tmp_path / "out", 2, start=4)
