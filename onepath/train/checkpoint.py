"""Training checkpoints: `run_dir/step_N/` holds the policy in Hugging Face layout plus the trainer state.

    step_N/config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json
    step_N/trainer_state.json   step, sampler cursor, ExecutionSpec hash, config hash, config, model config
    step_N/trainer_state.pt     AdamW state (full tensors per parameter name: any layout resumes it), LR schedule, RNG
    step_N/manifest.json        the sha256 of every other file, taken as it was written

The whole directory is written under a temporary name and renamed into place, so a run killed at
any moment leaves only complete step_N directories; a leftover `.step_N.tmp-*` is never read. A
checkpoint damaged later (a truncated or edited file) fails its checksums or its parse on resume,
which then falls back to the newest intact one (load_intact).
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from onepath.config import RunConfig
from onepath.models.checkpoint import atomic_directory, load_state_dict, save_checkpoint
from onepath.train.data import read_jsonl

STATE_JSON = "trainer_state.json"
STATE_PT = "trainer_state.pt"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"step_(\d+)")
LEFTOVER = re.compile(r"\.+(step_\d+|metrics\.jsonl)\..*(tmp|old)-")
# Settings a resumed run may change: how far to go, what to keep, where the run lives and logs, the
# engine's capacity knobs (batch invariance and phase consistency: no bit moves), activation
# recomputation (no bit of the forward or the gradients moves) and, by design, the parallel layouts
# (the state is held as full tensors per name; a layout moves no forward bit, only the gradients'
# summation order). train.micro_batch_tokens is not among them: it changes that order within a rank.
MAY_CHANGE = frozenset({
    "out", "mode", "train.steps", "train.save_every", "train.keep_last", "train.log_every",
    "train.val_every", "train.val_temperature", "train.val_before_train", "data.val_path", "train.recompute",
    "logger.wandb", "logger.project", "logger.name",
    "rollout.max_num_seqs", "rollout.max_num_batched_tokens", "rollout.num_blocks", "rollout.prefill_chunk_size",
    "rollout.gpu_memory_utilization", "rollout.cuda_graphs", "parallel.rollout", "parallel.trainer", "parallel.tp",
    "parallel.rollout_processes", "parallel.launcher", "parallel.processes", "parallel.ray_address"})


def complete_steps(run_dir: Path) -> list[int]:
    """The steps of the complete checkpoints in run_dir, ascending."""
    if not run_dir.is_dir():
        return []
    steps = []
    for path in run_dir.iterdir():
        match = STEP_DIR.fullmatch(path.name)
        if match and path.is_dir() and (path / STATE_JSON).is_file() and (path / STATE_PT).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest(run_dir: Path) -> Path | None:
    steps = complete_steps(run_dir)
    return run_dir / f"step_{steps[-1]}" if steps else None


def save(run_dir: Path, step: int, weights: dict, setup, state: dict, tensors: dict, keep_last: int) -> Path:
    """Write step_N atomically (temporary directory, then rename), then delete all but the last keep_last."""
    path = run_dir / f"step_{step}"
    with atomic_directory(path) as tmp:
        save_checkpoint(tmp, weights, setup.model_config, setup.tokenizer, setup.tokenizer_config)
        torch.save(tensors, tmp / STATE_PT)
        (tmp / STATE_JSON).write_text(json.dumps(state, indent=2) + "\n")
        sums = {file.name: _sha256(file) for file in sorted(tmp.iterdir())}
        (tmp / MANIFEST).write_text(json.dumps({"sha256": sums}, indent=2) + "\n")
    for old in complete_steps(run_dir)[:-keep_last]:
        _remove(run_dir / f"step_{old}")
    return path


class CorruptCheckpoint(ValueError):
    """A checkpoint file that does not verify; str() names the file and what is wrong with it."""


def load(path: Path) -> tuple[dict, dict]:
    """(trainer_state.json, trainer_state.pt) of a checkpoint; CorruptCheckpoint when either does not parse."""
    state = _load_json(path / STATE_JSON)
    if not isinstance(state, dict) or "step" not in state:
        raise CorruptCheckpoint(f"{path / STATE_JSON} holds no trainer state (no step)")
    return state, _load_tensors(path / STATE_PT)


def verify(path: Path) -> dict:
    """The checkpoint's weights, once every file matches its sha256 in manifest.json (a checkpoint written
    before manifests has none: its files need only parse); CorruptCheckpoint naming the file otherwise."""
    manifest = _load_json(path / MANIFEST) if (path / MANIFEST).is_file() else {"sha256": {}}
    sums = manifest.get("sha256") if isinstance(manifest, dict) else None
    if not isinstance(sums, dict):
        raise CorruptCheckpoint(f"{path / MANIFEST} holds no sha256 table")
    for name, digest in sums.items():
        if not (path / name).is_file():
            raise CorruptCheckpoint(f"{path / name} is missing ({MANIFEST} lists it)")
        if _sha256(path / name) != digest:
            raise CorruptCheckpoint(f"{path / name} is truncated or changed since it was written (its sha256 "
                                    f"differs from {MANIFEST}'s)")
    try:
        return load_state_dict(path)
    except (ValueError, FileNotFoundError) as e:  # its message names the file
        raise CorruptCheckpoint(str(e).removesuffix(": re-download or re-export the checkpoint")) from None


def load_intact(run_dir: Path, say: Callable[[str], None]) -> tuple[Path, dict, dict, dict] | None:
    """The newest checkpoint in run_dir that verifies, as (path, state, tensors, weights); each newer one that
    does not is said in a line naming its bad file. None when run_dir holds no checkpoint, ValueError when none
    verifies."""
    bad = []
    for step in reversed(complete_steps(run_dir)):
        path = run_dir / f"step_{step}"
        try:
            state, tensors = load(path)
            weights = verify(path)
        except CorruptCheckpoint as e:
            bad.append(str(e))
            continue
        for problem in bad:
            say(f"{problem}: resuming from {path.name}")
        return path, state, tensors, weights
    if bad:
        raise ValueError(f"no intact checkpoint in {run_dir} ({'; '.join(bad)}): remove its step_N directories "
                         "to start afresh there, or choose another --out")
    return None


def _load_json(file: Path):
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"{file} is truncated or corrupt (not JSON: {e})") from None


def _load_tensors(file: Path) -> dict:
    try:
        with warnings.catch_warnings():  # an odd pickle protocol warns before it is refused
            warnings.simplefilter("ignore")
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # damaged bytes raise whatever torch's parser meets: RuntimeError, EOFError, KeyError...
        if isinstance(e, pickle.UnpicklingError) and "GLOBAL" in str(e):
            # torch's own message suggests weights_only=False, which would run the code the file names
            raise CorruptCheckpoint(f"{file} holds Python objects that onepath never writes (it was tampered with "
                                    "or written by another tool): onepath will not unpickle it") from None
        raise CorruptCheckpoint(f"{file} is truncated or corrupt (torch.load fails: {type(e).__name__})") from None


def _sha256(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def remove_leftovers(run_dir: Path) -> None:
    """Delete what a killed write or delete left behind (never a complete step_N)."""
    if run_dir.is_dir():
        for path in run_dir.iterdir():
            if LEFTOVER.match(path.name):
                shutil.rmtree(path, ignore_errors=True)


def _remove(path: Path) -> None:
    # renamed first: a delete killed half-way must not leave a step_N that looks complete
    aside = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(path, aside)
    shutil.rmtree(aside)


def rng_state(device: str) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def trajectory_config(cfg: RunConfig | dict) -> dict:
    """The settings that decide a run's trajectory, flat (`train.lr`): all but MAY_CHANGE."""
    raw = cfg.to_dict() if isinstance(cfg, RunConfig) else cfg
    flat = {}
    for key, value in raw.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for name, v in items:
            flat[key if name is None else f"{key}.{name}"] = v
    return {k: v for k, v in flat.items() if k not in MAY_CHANGE}


def config_hash(cfg: RunConfig | dict) -> str:
    return hashlib.sha256(json.dumps(trajectory_config(cfg), sort_keys=True).encode()).hexdigest()[:16]


def check_compatible(path: Path, state: dict, spec, model_config: dict, cfg: RunConfig) -> None:
    """Raise ValueError naming what differs when the checkpoint cannot continue under this config."""
    again = "resume with the settings the run started with (its config.yaml), or start a new run in another --out"
    saved_mode = state["spec"]["mode"]
    if saved_mode != spec.mode:
        raise ValueError(f"{path} is a checkpoint of a --mode {saved_mode} run, not of --mode {spec.mode}: resume it "
                         f"with --mode {saved_mode}, or start the {spec.mode} run in another --out")
    if state["spec_hash"] != spec.hash():
        raise ValueError(f"{path} was written under ExecutionSpec {state['spec_hash']} "
                         f"({state['spec']['mode']}, {state['spec']['device']}), this run's is {spec.hash()} "
                         f"({spec.mode}, {spec.device}): the numeric contract changed; {again}")
    changed = _changes(state["model_config"], model_config)
    if changed:
        raise ValueError(f"{path} holds a different model than this config builds ({changed}); {again}")
    # the saved config read through today's RunConfig: keys added since it was written take their defaults
    saved = RunConfig.from_dict(state["config"])
    if config_hash(saved) != config_hash(cfg):
        changed = _changes(trajectory_config(saved), trajectory_config(cfg))
        raise ValueError(f"{path} was written with other settings ({changed}); {again}")
    if state["step"] > cfg.train.steps:
        raise ValueError(f"{path} is past train.steps = {cfg.train.steps}: raise --train.steps to at least "
                         f"{state['step']}")


def _changes(old: dict, new: dict) -> str:
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    shown = ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:4])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > 4 else "")


def rewind_metrics(run_dir: Path, step: int) -> list[dict]:
    """Cut metrics.jsonl to steps <= step (a killed run logged steps its checkpoint lost, perhaps a
    partial last line) and return those records: the file then holds each step of the run once."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [record for _, record in read_jsonl(path, cut_short_last=True) if record.get("step", 0) <= step]
    tmp = path.with_name(f".metrics.jsonl.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)
    return records
