"""Hugging Face checkpoint layout: config.json, model.safetensors or its shards and index, tokenizer files.

Tensor names are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`, ...).
A tied checkpoint holds no `lm_head.weight`; the model ties it to `model.embed_tokens.weight`.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from onepath.models.config import ModelConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
REDOWNLOAD = "re-download or re-export the checkpoint"


def load_config(path: str | Path) -> ModelConfig:
    return ModelConfig.from_json(_checkpoint_dir(path) / CONFIG)


def load_state_dict(path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, on the CPU; floating ones cast to `dtype` when given."""
    path = _checkpoint_dir(path)
    if (path / INDEX).is_file():
        files = read_index(path)
    elif (path / WEIGHTS).is_file():
        files = {WEIGHTS: None}
    else:
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {others}: convert them to safetensors)" if others else ""
        raise FileNotFoundError(f"no weights in {path}: expected {WEIGHTS} or {INDEX}{hint}")
    state = {}
    for name, keys in files.items():
        state.update(read_safetensors(path / name, keys, dtype))
    return state


def save_checkpoint(path: str | Path, state_dict: dict[str, torch.Tensor], config: ModelConfig,
                    tokenizer: Tokenizer | None = None, tokenizer_config: dict | None = None,
                    max_shard_size: int | None = None) -> None:
    """Write a checkpoint that transformers' from_pretrained and load_state_dict both read.

    Written into a sibling temporary directory and renamed into place, so a crash never leaves a
    half-written checkpoint at `path`.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory: choose another checkpoint path")
    tensors = _tensors_to_save(state_dict, config)
    with atomic_directory(path) as tmp:
        raw = config.to_dict()
        dtype = _dominant_dtype(tensors)
        if dtype is not None:
            raw["torch_dtype"] = raw["dtype"] = dtype
        write_json(tmp / CONFIG, raw)
        write_weights(tmp, tensors, max_shard_size)
        generation = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        write_json(tmp / GENERATION_CONFIG, {k: v for k, v in generation.items() if v is not None})
        if tokenizer is not None:
            tokenizer.save(str(tmp / TOKENIZER))
        if tokenizer_config is not None:
            write_json(tmp / TOKENIZER_CONFIG, tokenizer_config)


def write_weights(path: Path, tensors: dict[str, torch.Tensor], max_shard_size: int | None) -> None:
    """model.safetensors, or HF-named shards of at most max_shard_size bytes plus their index."""
    shards = _split(tensors, max_shard_size)
    if len(shards) == 1:
        save_file(shards[0], path / WEIGHTS, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    metadata = {"total_parameters": sum(t.numel() for t in tensors.values()),
                "total_size": sum(t.nbytes for t in tensors.values())}
    write_json(path / INDEX, {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))})


def load_tokenizer(path: str | Path) -> Tokenizer:
    file = _checkpoint_dir(path) / TOKENIZER
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: onepath needs the fast-tokenizer file; write it with "
                                f"tokenizer.save_pretrained(...) in transformers or tokenizers.Tokenizer.save")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(f"{file} is not a valid tokenizers file ({e}): {REDOWNLOAD}") from None


def unknown_characters(tokenizer: Tokenizer, text: str) -> list[str]:
    """The pieces of `text` the tokenizer encodes as its unknown token, each once (none for a byte-level one)."""
    unk = getattr(tokenizer.model, "unk_token", None)
    unk_id = tokenizer.token_to_id(unk) if unk else None
    if unk_id is None:
        return []
    encoding = tokenizer.encode(text, add_special_tokens=False)
    return list(dict.fromkeys(text[a:b] for i, (a, b) in zip(encoding.ids, encoding.offsets) if i == unk_id))


def load_tokenizer_config(path: str | Path) -> dict:
    file = _checkpoint_dir(path) / TOKENIZER_CONFIG
    return read_json(file) if file.is_file() else {}


def _checkpoint_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist or is not a directory")
    return path


def read_json(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}): {REDOWNLOAD}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} holds a {type(raw).__name__}, not a JSON object: {REDOWNLOAD}")
    return raw


def write_json(file: Path, obj: dict) -> None:
    file.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_index(path: Path) -> dict[str, list[str]]:
    """Shard file name -> the tensor names the index puts there, in index order."""
    index = path / INDEX
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map: {REDOWNLOAD}")
    files: dict[str, list[str]] = {}
    for tensor, name in weight_map.items():
        files.setdefault(name, []).append(tensor)
    for name, keys in files.items():
        if Path(name).name != name:
            raise ValueError(f"{index} names shard {name!r} outside {path}: {REDOWNLOAD}")
        if not (path / name).is_file():
            shown = ", ".join(keys[:3]) + (f", ... ({len(keys)} in all)" if len(keys) > 3 else "")
            raise FileNotFoundError(f"{path / name} is missing: {INDEX} puts {shown} there; {REDOWNLOAD}")
    return files


def read_safetensors(file: Path, keys: list[str] | None, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    try:
        with safe_open(file, framework="pt") as f:
            present = set(f.keys())
            keys = sorted(present) if keys is None else keys
            absent = [k for k in keys if k not in present]
            if absent:
                raise ValueError(f"{file} lacks {absent[:3]} that {INDEX} puts there: {REDOWNLOAD}")
            state = {k: f.get_tensor(k) for k in keys}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file} is unreadable ({e}): {REDOWNLOAD}") from None
    if dtype is not None:
        state = {k: t.to(dtype) if t.is_floating_point() else t for k, t in state.items()}
    return state


def _tensors_to_save(state_dict: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Contiguous tensors that own their storage: safetensors refuses shared or partial storage."""
    out, seen = {}, set()
    for name, t in state_dict.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = t.detach().contiguous()
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key in seen or t.nbytes != storage.nbytes():
            t = t.clone()
        seen.add(key)
        out[name] = t
    return out


def _split(tensors: dict[str, torch.Tensor], max_shard_size: int | None) -> list[dict[str, torch.Tensor]]:
    """Greedy in key order like transformers; a tensor larger than max_shard_size gets a shard alone."""
    if max_shard_size is not None and max_shard_size <= 0:
        raise ValueError(f"max_shard_size {max_shard_size} must be a positive number of bytes")
    shards, size = [{}], 0
    for name, t in tensors.items():
        if max_shard_size is not None and shards[-1] and size + t.nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    return shards


def _dominant_dtype(tensors: dict[str, torch.Tensor]) -> str | None:
    counts = Counter()
    for t in tensors.values():
        if t.is_floating_point():
            counts[str(t.dtype).removeprefix("torch.")] += t.numel()
    return counts.most_common(1)[0][0] if counts else None


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yields a new sibling directory `.NAME.tmp-*` to fill; once the block ends it replaces `path`, and an
    error deletes it. A crash at any moment leaves `path` whole (old or new) and at most a dot-named leftover."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if not path.exists():
            os.replace(tmp, path)
            return
        # POSIX cannot rename a directory over a non-empty one, so the old one steps aside first and is
        # deleted only once the new one is in place.
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
