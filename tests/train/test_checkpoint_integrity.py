"""A checkpoint damaged after it was written (a truncated file, a changed byte, a pickle payload) is named in a
line on resume, and the run resumes from the newest intact step_N; with none intact, one error names them all."""
import json
import os
import shutil

import pytest
import torch

from onepath.config import load_run_config
from onepath.models.checkpoint import load_state_dict
from onepath.train import checkpoint
from onepath.train.trainer import GRPOTrainer, prepare


def cfg(out, steps, reward):
    return load_run_config(None, ["--warm_start.steps", "0", "--train.steps", str(steps), "--train.save_every", "1",
                                  "--train.prompts_per_step", "4", "--rollout.n", "4", "--data.n_train", "64",
                                  "--data.n_test", "8", "--train.reward", reward, "--out", str(out)])


class Payload:
    """What a tampered trainer_state.pt holds: an object whose unpickling calls a function."""

    def __reduce__(self):
        return os.getcwd, ()


@pytest.fixture(scope="module")
def finished(tmp_path_factory, reward):
    """A 3-step run with step_2 and step_3 (keep_last 2), and its setup."""
    out = tmp_path_factory.mktemp("finished")
    setup = prepare(cfg(out, 3, reward), out, progress=False)
    GRPOTrainer(cfg(out, 3, reward), "consistent", setup, out / "run").run(progress=False)
    assert checkpoint.complete_steps(out / "run") == [2, 3]
    return out / "run", setup


@pytest.fixture
def run_dir(tmp_path, finished):
    shutil.copytree(finished[0], tmp_path / "run")
    return tmp_path / "run"


def truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def flip_a_byte(file):
    data = bytearray(file.read_bytes())
    data[-1] ^= 1  # the last weight's last byte: the file still parses, only its checksum tells
    file.write_bytes(bytes(data))


def pickle_payload(file):
    torch.save({"optimizer": Payload(), "rng": {}}, file)


DAMAGE = {
    "model.safetensors truncated": ("model.safetensors", truncate, "is truncated or changed since it was written"),
    "model.safetensors one byte": ("model.safetensors", flip_a_byte, "is truncated or changed since it was written "
                                   "(its sha256 differs from manifest.json's)"),
    "trainer_state.pt truncated": ("trainer_state.pt", truncate, "is truncated or corrupt (torch.load fails"),
    "trainer_state.json truncated": ("trainer_state.json", truncate, "is truncated or corrupt (not JSON"),
    "trainer_state.pt pickle": ("trainer_state.pt", pickle_payload,
                                "holds Python objects that onepath never writes (it was tampered with or written by "
                                "another tool): onepath will not unpickle it"),
}


def test_each_checkpoint_records_the_sha256_of_its_files(run_dir):
    step = run_dir / "step_3"
    sums = json.loads((step / checkpoint.MANIFEST).read_text())["sha256"]
    assert sorted(sums) == sorted(p.name for p in step.iterdir() if p.name != checkpoint.MANIFEST)
    assert {"model.safetensors", "trainer_state.pt", "trainer_state.json", "config.json"} <= sums.keys()
    checkpoint.verify(step)
    flip_a_byte(step / "model.safetensors")
    load_state_dict(step)  # still parses: only the checksum tells
    with pytest.raises(checkpoint.CorruptCheckpoint, match=r"model.safetensors is truncated or changed .* sha256"):
        checkpoint.verify(step)


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_gives_way_to_the_newest_intact_one(run_dir, finished, reward, capsys, damage):
    name, spoil, problem = DAMAGE[damage]
    spoil(run_dir / "step_3" / name)
    capsys.readouterr()
    resumed = GRPOTrainer(cfg(run_dir.parent, 4, reward), "consistent", finished[1], run_dir, resume=True)
    printed = capsys.readouterr().out
    assert f"[consistent] {run_dir / 'step_3' / name} {problem}" in printed, printed
    assert ": resuming from step_2\n" in printed and "weights_only" not in printed
    assert resumed.start == 2
    saved = load_state_dict(run_dir / "step_2")
    assert all(torch.equal(p, saved[n]) for n, p in resumed.policy.named_parameters())


def test_the_resumed_run_rewrites_the_damaged_step_with_the_same_bits(run_dir, finished, reward):
    intact = {k: t.clone() for k, t in load_state_dict(run_dir / "step_3").items()}  # not views of the file
    truncate(run_dir / "step_3" / "model.safetensors")
    GRPOTrainer(cfg(run_dir.parent, 3, reward), "consistent", finished[1], run_dir, resume=True).run(progress=False)
    again = load_state_dict(run_dir / "step_3")
    assert again.keys() == intact.keys() and all(torch.equal(again[k], intact[k]) for k in intact)


def test_no_intact_checkpoint_is_one_error_naming_each_bad_file(run_dir, finished, reward):
    truncate(run_dir / "step_3" / "trainer_state.json")
    pickle_payload(run_dir / "step_2" / "trainer_state.pt")
    with pytest.raises(ValueError) as error:
        GRPOTrainer(cfg(run_dir.parent, 4, reward), "consistent", finished[1], run_dir, resume=True)
    message = str(error.value)
    assert message.startswith(f"no intact checkpoint in {run_dir} ({run_dir / 'step_3' / 'trainer_state.json'} is")
    assert f"{run_dir / 'step_2' / 'trainer_state.pt'} holds Python objects" in message
    assert message.endswith("remove its step_N directories to start afresh there, or choose another --out")
