"""slice: cut layers [start, start + N) of a Hugging Face checkpoint into a small model for fast iteration.

The slice keeps the layers' tensors bit for bit, in their stored dtypes (quantised weights and their
scales travel as stored), the embeddings, the final norm, lm_head (a tied checkpoint stays tied), every
other top-level file (tokenizer, generation config, chat template), and config.json with
num_hidden_layers = N and its per-layer fields re-indexed (a hybrid's layers_block_type list or
hybrid_override_pattern string too); nothing else in config.json changes. Layer tensors are renumbered
`model.layers.{i - start}.*` (a Nemotron-H checkpoint's `backbone.layers.*` keep their prefix). Only the kept
tensors are read, one shard at a time.

Two or more layers keep the layer-to-layer interaction (one layer's output is the next one's input).
A layer's kind is its layer_types (or layers_block_type, or pattern letter) entry and the names of its
tensors (expert indices folded); the report lists every kind the model has and the slice lacks, so a
slice that drops an operator class is seen.
"""
from __future__ import annotations

import argparse
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from onepath.models.checkpoint import (CONFIG, INDEX, REDOWNLOAD, WEIGHTS, atomic_directory, read_index, read_json,
                                       read_safetensors, write_json, write_weights)

LAYER_KEY = re.compile(r"^(model|backbone)\.layers\.(\d+)\.(.+)$")
NOT_COPIED = (".safetensors", ".index.json", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
# config.json fields that describe layers by index, and how a slice rewrites them.
PER_LAYER = ("layer_types", "no_rope_layers", "layers_block_type", "mlp_layer_types",
             "compress_ratios")                                # one entry per layer: sliced
PATTERNS = ("hybrid_override_pattern",)                        # one letter per layer: sliced
LAYER_INDICES = ("mlp_only_layers",)                           # indices of some layers: kept ones renumbered
LEADING_COUNTS = ("max_window_layers", "first_k_dense_replace", "num_hash_layers")  # "the first k layers": shifted
PERIODS = ("decoder_sparse_step", "moe_layer_freq", "interleave_moe_layer_step", "sliding_window_pattern",
           "full_attention_interval", "no_rope_layer_interval")  # a pattern every p layers: start % p == 0
MAX_SHARD_SIZE = 5 * 2**30


@dataclass(slots=True)
class SliceReport:
    model: str
    out: str
    start: int
    stop: int
    total_layers: int
    tensors: int
    bytes: int
    copied: list[str]
    kinds: int                 # kinds of layer in the model
    missing_kinds: list[str]   # 'layer j: what sets it apart', one per kind no sliced layer has

    def format(self) -> str:
        copied = ", ".join(self.copied) or "no other file"
        lines = [f"sliced layers {self.start}..{self.stop - 1} of {self.total_layers}: {self.model} -> {self.out}",
                 f"  {self.tensors} tensors, {self.bytes / 2**20:.1f} MiB; copied {copied}"]
        if self.stop - self.start == 1:
            lines.append("WARNING: one layer has no layer-to-layer interaction: slice 2 or more layers")
        if self.missing_kinds:
            lines.append(f"WARNING: the slice lacks {len(self.missing_kinds)} of the model's {self.kinds} "
                         "kinds of layer:")
            lines += [f"  {k}" for k in self.missing_kinds]
            lines.append("  choose --start and --layers so the slice covers them: checks on the slice test only "
                         "the operators it holds")
        else:
            lines.append(f"every kind of layer in the model is in the slice ({self.kinds})")
        return "\n".join(lines)


def layer_count(raw: dict):
    """num_hidden_layers, or the length of a hybrid's per-layer list or pattern (Nemotron-H may give only those)."""
    for key in ("num_hidden_layers", "layers_block_type", *PATTERNS):
        if raw.get(key) is not None:
            return raw[key] if key == "num_hidden_layers" else len(raw[key])
    return None


def layer_kinds(raw: dict) -> list | None:
    """Each layer's kind as config.json names it (layer_types, layers_block_type or a pattern's letters)."""
    for key in ("layer_types", "layers_block_type", *PATTERNS):
        if isinstance(raw.get(key), (list, str)):
            return list(raw[key])
    return None


def slice_config(raw: dict, start: int, count: int) -> dict:
    """config.json of layers [start, start + count) of the model `raw` describes."""
    total = layer_count(raw)
    if not isinstance(total, int) or total < 1:
        raise ValueError(f"config.json has num_hidden_layers {total!r}: slice needs the model's layer count there")
    if count < 1 or start < 0 or start + count > total:
        raise ValueError(f"--layers {count} --start {start} asks for layers {start}..{start + count - 1}, but the "
                         f"model has layers 0..{total - 1}: use --layers >= 1 and --start >= 0 with start + layers "
                         f"<= {total}")
    stop = start + count
    out = dict(raw, num_hidden_layers=count)
    for key in PER_LAYER:
        if isinstance(raw.get(key), list):
            if len(raw[key]) != total:
                raise ValueError(f"config.json's {key} has {len(raw[key])} entries for {total} layers: fix the config")
            out[key] = raw[key][start:stop]
    for key in PATTERNS:
        if isinstance(raw.get(key), str):
            if len(raw[key]) != total:
                raise ValueError(f"config.json's {key} has {len(raw[key])} letters for {total} layers: fix the config")
            out[key] = raw[key][start:stop]
    for key in LAYER_INDICES:
        if isinstance(raw.get(key), list):
            out[key] = [i - start for i in raw[key] if start <= i < stop]
    for key in LEADING_COUNTS:
        if isinstance(raw.get(key), int):
            out[key] = min(max(raw[key] - start, 0), count)
    for key in PERIODS:
        p = raw.get(key)
        if isinstance(p, int) and p > 1 and start % p:
            raise ValueError(f"config.json has {key} {p}: the layer pattern repeats every {p} layers, so --start "
                             f"{start} would change which layers are which; use a --start that is a multiple of {p}")
    return out


def slice_checkpoint(model: str | Path, out: str | Path, layers: int, start: int = 0, overwrite: bool = False,
                     max_shard_size: int | None = MAX_SHARD_SIZE) -> SliceReport:
    """Write layers [start, start + layers) of checkpoint `model` as a checkpoint at `out`."""
    src, out = Path(model), Path(out)
    if not src.is_dir():
        raise FileNotFoundError(f"checkpoint directory {src} does not exist or is not a directory")
    if not (src / CONFIG).is_file():
        raise FileNotFoundError(f"{src / CONFIG} is missing: a checkpoint directory needs a config.json")
    raw = read_json(src / CONFIG)
    config = slice_config(raw, start, layers)
    if out.resolve() == src.resolve() or out.resolve() in src.resolve().parents:
        raise ValueError(f"output {out} is or holds the model {src}: write the slice to a new directory")
    if out.exists() and not (overwrite and out.is_dir()):
        raise ValueError(f"output {out} exists: choose a new directory, or pass --overwrite to replace it")

    stop, total = start + layers, layer_count(raw)
    files = _weight_files(src)
    names = {}  # layer -> its tensor names after the layer prefix
    for keys in files.values():
        for key in keys:
            m = LAYER_KEY.match(key)
            if m and int(m[2]) < total:
                names.setdefault(int(m[2]), set()).add(m[3])
    if not names:
        raise ValueError(f"{src} has no tensor named model.layers.<i>.* (or backbone.layers.<i>.*): slice cuts "
                         "Hugging Face causal-LM checkpoints whose decoder layers are named so")
    absent = [i for i in range(start, stop) if i not in names]
    if absent:
        raise ValueError(f"{src} has no tensors for layers {absent} though config.json has num_hidden_layers "
                         f"{total}: {REDOWNLOAD}")

    state = {}
    for file, keys in files.items():
        renamed = {key: _renamed(key, start, stop) for key in keys}
        kept = [key for key, new in renamed.items() if new is not None]
        if kept:
            tensors = read_safetensors(src / file, kept, None)
            state.update((renamed[key], tensors[key]) for key in kept)

    with atomic_directory(out) as tmp:
        write_json(tmp / CONFIG, config)
        write_weights(tmp, dict(sorted(state.items())), max_shard_size)
        copied = []
        for p in sorted(src.iterdir()):
            if p.is_file() and p.name != CONFIG and not p.name.endswith(NOT_COPIED) and not p.name.startswith("."):
                shutil.copy2(p, tmp / p.name)
                copied.append(p.name)
    return SliceReport(str(src), str(out), start, stop, total, len(state), sum(t.nbytes for t in state.values()),
                       copied, *_missing_kinds(names, layer_kinds(raw), start, stop))


def _weight_files(path: Path) -> dict[str, list[str]]:
    """Safetensors file name -> the tensor names in it, read from the index or the file's header."""
    if (path / INDEX).is_file():
        return read_index(path)
    if not (path / WEIGHTS).is_file():
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {others}: convert them to safetensors)" if others else ""
        raise FileNotFoundError(f"no weights in {path}: expected {WEIGHTS} or {INDEX}{hint}")
    try:
        with safe_open(path / WEIGHTS, framework="pt") as f:
            return {WEIGHTS: sorted(f.keys())}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path / WEIGHTS} is unreadable ({e}): {REDOWNLOAD}") from None


def _renamed(key: str, start: int, stop: int) -> str | None:
    """The key in the slice; None for a layer outside [start, stop) (extra layers past the count too)."""
    m = LAYER_KEY.match(key)
    if m is None:
        return key
    i = int(m[2])
    return f"{m[1]}.layers.{i - start}.{m[3]}" if start <= i < stop else None


def _missing_kinds(names: dict[int, set[str]], layer_types: list | None, start: int,
                   stop: int) -> tuple[int, list[str]]:
    """How many kinds of layer the model has, and one line per kind no layer of the slice has."""
    def kind(i):
        folded = frozenset(re.sub(r"(?<=\.)\d+(?=\.)", "*", n) for n in names.get(i, ()))  # experts.17. -> experts.*.
        return (layer_types[i] if isinstance(layer_types, list) else None), folded

    kinds = {}
    for i in sorted(names):
        kinds.setdefault(kind(i), i)
    have = {kind(i) for i in range(start, stop)}
    have_types = {t for t, _ in have}
    have_names = set().union(*(n for _, n in have))
    missing = []
    for (layer_type, folded), i in kinds.items():
        if (layer_type, folded) in have:
            continue
        apart = ([layer_type] if layer_type not in have_types else []) + sorted(folded - have_names)
        shown = ", ".join(apart[:4]) + (f", ... ({len(apart)} in all)" if len(apart) > 4 else "")
        missing.append(f"layer {i}: {shown or 'another combination of the same tensors'}")
    return len(kinds), missing


def main(argv: list[str]) -> int:
    """`onepath slice MODEL OUT --layers N [--start S]`: write the slice, print what it holds; exit 0."""
    parser = argparse.ArgumentParser(prog="onepath slice", description="cut N consecutive layers of a Hugging Face "
                                     "checkpoint, with its embeddings, final norm, lm_head and tokenizer, into a "
                                     "small model of the same layer sizes and dtypes",
                                     epilog="example: onepath slice ~/models/Qwen3-8B runs/qwen3-8b-2layers --layers 2 "
                                            "--start 10")
    parser.add_argument("model", help="a Hugging Face checkpoint directory (config.json, safetensors)")
    parser.add_argument("out", help="directory for the sliced checkpoint (must not exist, unless --overwrite)")
    parser.add_argument("--layers", type=int, required=True, help="number of consecutive layers to keep (2 or more "
                        "keep the layer-to-layer interaction)")
    parser.add_argument("--start", type=int, default=0, help="first layer kept (default 0)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    args = parser.parse_args(argv)
    print(slice_checkpoint(args.model, args.out, args.layers, args.start, args.overwrite).format())
    return 0
