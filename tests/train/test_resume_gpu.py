"""Checkpoints and exact resume on the GPU (BF16, Triton kernels, CUDA-graph engine): the first step
after a restore has diff = 0 and the resumed run ends with the weights of an uninterrupted one; a run
SIGKILLed after a checkpoint and resumed ends bit for bit where the uninterrupted run ends. The CPU
versions (with their negative controls) are tests/train/test_resume.py."""
import pytest
import torch

from tests.train.conftest import DIGITS
from tests.train.test_resume import (assert_same_run, kill_after_a_checkpoint, policy_weights, tiny_cfg, train)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = ("--device", "cuda")


@pytest.fixture(scope="module")
def reward(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("reward") / "digits.py"
    path.write_text(DIGITS)
    return f"{path}:digits"


def test_restore_on_gpu_first_step_exact_and_same_final_weights(tmp_path, reward):
    from onepath.numerics.diff import is_exact
    from onepath.train.trainer import GRPOTrainer, prepare
    setup = prepare(tiny_cfg(tmp_path, 3, reward, *CUDA), tmp_path, progress=False)
    whole = GRPOTrainer(tiny_cfg(tmp_path, 3, reward, *CUDA), "consistent", setup, tmp_path / "whole")
    whole.run(progress=False)
    GRPOTrainer(tiny_cfg(tmp_path, 2, reward, *CUDA), "consistent", setup, tmp_path / "split").run(progress=False)
    resumed = GRPOTrainer(tiny_cfg(tmp_path, 3, reward, *CUDA), "consistent", setup, tmp_path / "split", resume=True)
    assert next(resumed.policy.parameters()).is_cuda
    history = resumed.run(progress=False)
    assert len(history) == 3 and all(is_exact(h) for h in history), history[-1]
    expected, got = policy_weights(whole), policy_weights(resumed)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_sigkill_then_resume_on_gpu_ends_with_the_same_bits(tmp_path, reward):
    reference = tmp_path / "uninterrupted"
    train(reference, reward, *CUDA)
    out = tmp_path / "killed"
    first = kill_after_a_checkpoint(out, reward, 1, 0.02, *CUDA)
    train(out, reward, "--resume", *CUDA)
    assert first >= 2
    assert_same_run(out, reference)
