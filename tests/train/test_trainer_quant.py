"""trainer_quant: the realistic fast baseline, an FP8 rollout with an unquantised trainer. A baseline run builds
its trainer under trainer_quant's formats and records both specs; with `--mode both` the consistent half keeps one
spec on both sides (diff = 0 with the FP8 formats on each); a consistent run refuses it."""
import json

import pytest
import torch

from onepath.config import load_run_config, trainer_spec
from onepath.numerics.diff import is_exact
from onepath.numerics.spec import ExecutionSpec
from onepath.train.trainer import GRPOTrainer, prepare

SMALL = ["--warm_start.steps", "20", "--train.steps", "2", "--train.prompts_per_step", "4", "--rollout.n", "4",
         "--data.n_train", "64", "--data.n_test", "8", "--train.val_every", "0"]


def run(tmp_path, mode, *extra):
    cfg = load_run_config(None, [*SMALL, "--out", str(tmp_path), "--quant", "fp8", *extra])
    setup = prepare(cfg, tmp_path, progress=False)
    trainer = GRPOTrainer(cfg, mode, setup, tmp_path / mode)
    return trainer, trainer.run(progress=False)


def test_a_baseline_trainer_runs_its_own_formats_and_records_them(tmp_path):
    trainer, history = run(tmp_path, "baseline", "--mode", "both", "--trainer_quant", "none")
    assert trainer.engine.model.ops.spec.hash() == ExecutionSpec.default("baseline", "cpu", quant="fp8").hash()
    assert trainer.policy.ops.spec.hash() == ExecutionSpec.default("baseline", "cpu").hash()
    spec = json.loads((tmp_path / "baseline" / "spec.json").read_text())
    assert spec["hash"] != spec["trainer_hash"] and spec["trainer_hash"] == trainer.policy.ops.spec.hash()
    assert all(m["training/rollout_probs_diff_max"] > 0 for m in history)
    # the engine's FP8 weights follow the unquantised trainer's after each update (re-quantised on sync)
    trained = dict(trainer.policy.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in trainer.engine.model.named_parameters())


def test_the_consistent_half_of_a_both_run_keeps_one_spec(tmp_path):
    trainer, history = run(tmp_path, "consistent", "--mode", "both", "--trainer_quant", "none")
    assert trainer.policy.ops.spec.hash() == trainer.engine.model.ops.spec.hash()
    assert trainer.policy.ops.spec.hash() == ExecutionSpec.default("consistent", "cpu", quant="fp8").hash()
    assert len(history) == 2 and all(is_exact(m) for m in history)
    assert "trainer_hash" not in json.loads((tmp_path / "consistent" / "spec.json").read_text())


def test_trainer_quant_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="trainer_quant = 'none' applies to baseline runs only"):
        load_run_config(None, ["--mode", "consistent", "--quant", "fp8", "--trainer_quant", "none"])
    with pytest.raises(ValueError, match="quant preset 'fp9' is unknown"):
        load_run_config(None, ["--mode", "baseline", "--trainer_quant", "fp9"])
    cfg = load_run_config(None, ["--mode", "baseline", "--quant", "fp8+fp8_kv", "--trainer_quant", "fp8"])
    assert trainer_spec(cfg, ExecutionSpec.default("baseline", "cpu", quant="fp8+fp8_kv")).hash() == \
        ExecutionSpec.default("baseline", "cpu", quant="fp8").hash()
    unset = load_run_config(None, ["--mode", "baseline", "--quant", "fp8"])
    spec = ExecutionSpec.default("baseline", "cpu", quant="fp8")
    assert trainer_spec(unset, spec) is spec and "trainer_quant" not in unset.to_dict()
