"""`quant` in the run config reaches both sides' ExecutionSpec (and so its hash, which resume checks)."""
from onepath.numerics.spec import ExecutionSpec
from onepath.train.trainer import GRPOTrainer, prepare
from tests.train.test_resume import tiny_cfg


def test_quant_preset_reaches_engine_and_trainer(tmp_path, reward):
    cfg = tiny_cfg(tmp_path, 1, reward, "--quant", "fp8+fp8_kv")
    trainer = GRPOTrainer(cfg, "consistent", prepare(cfg, tmp_path, progress=False), tmp_path / "run")
    for spec in (trainer.spec, trainer.policy.ops.spec, trainer.engine.model.ops.spec):
        assert spec.op("linear").weight is not None and spec.op("attention").kv is not None
    assert trainer.spec.hash() != ExecutionSpec.default("consistent", "cpu").hash()
