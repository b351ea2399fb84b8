"""train.master_dtype: AdamW steps copies of the weights in a wider dtype and rounds them into the
model's weights each step. Under BF16 weights, steps below half an ulp accumulate in the FP32 masters
instead of rounding away; the model (what both sides run) only ever holds the rounded masters; the
masters are part of the checkpoint, so a resumed run continues them."""
import pytest
import torch

from onepath.numerics.diff import is_exact
from onepath.train import checkpoint
from onepath.train.actor import Actor
from onepath.train import trainer as trainer_module
from onepath.train.trainer import GRPOTrainer, prepare
from tests.tiny import tiny_model
from tests.train.test_resume import policy_weights, tiny_cfg


def stepped(master_dtype, steps=40, lr=2e-5):
    model = tiny_model("consistent", seed=1).to(torch.bfloat16)
    start = [p.detach().clone() for p in model.parameters()]
    actor = Actor(model, block_size=16, lr=lr, master_dtype=master_dtype)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in model.parameters()]
    for _ in range(steps):
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        actor.step()
    moved = sum(int((p != s).sum()) for p, s in zip(model.parameters(), start))
    return actor, model, moved


def test_fp32_masters_keep_the_steps_bf16_rounds_away():
    plain, _, moved_plain = stepped(None)
    actor, model, moved = stepped(torch.float32)
    assert plain.master is None and all(m.dtype == torch.float32 for m in actor.master)
    # the model holds exactly the masters rounded once to BF16, and its gradients went to the masters
    assert all(torch.equal(p, m.to(torch.bfloat16)) and p.grad is None for p, m in zip(model.parameters(), actor.master))
    total = sum(p.numel() for p in model.parameters())
    assert moved > 2 * moved_plain and moved > total // 4, (moved, moved_plain, total)


def test_same_dtype_needs_no_masters():
    model = tiny_model("consistent", seed=1)
    assert Actor(model, block_size=16, lr=1e-3, master_dtype=torch.float32).master is None


@pytest.mark.parametrize("restore_masters", [True, False])
def test_masters_are_checkpointed_and_a_resumed_run_continues_them(tmp_path, reward, monkeypatch, restore_masters):
    """The CPU model is FP32: FP64 masters (set through the config's name) hold bits the weights do not,
    so a restore that dropped them would show (negative control)."""
    monkeypatch.setitem(trainer_module.DTYPES, "bfloat16", torch.float64)
    extra = ("--train.master_dtype", "bfloat16")
    setup = prepare(tiny_cfg(tmp_path, 3, reward, *extra), tmp_path, progress=False)
    whole = GRPOTrainer(tiny_cfg(tmp_path, 3, reward, *extra), "consistent", setup, tmp_path / "whole")
    assert all(is_exact(m) for m in whole.run(progress=False))
    split = GRPOTrainer(tiny_cfg(tmp_path, 2, reward, *extra), "consistent", setup, tmp_path / "split")
    split.run(progress=False)
    _, tensors = checkpoint.load(checkpoint.latest(tmp_path / "split"))
    masters = [tensors["master"][name] for name in split.actor.names]  # full tensors by parameter name
    assert all(torch.equal(saved, m) for saved, m in zip(masters, split.actor.master))
    assert not all(torch.equal(m.float().double(), m) for m in masters)  # wider than the weights
    if not restore_masters:
        restore = GRPOTrainer.restore
        monkeypatch.setattr(GRPOTrainer, "restore", lambda self, state, t: restore(self, state, {**t, "master": {
            name: p.detach().double() for name, p in self.policy.named_parameters()}}))
    resumed = GRPOTrainer(tiny_cfg(tmp_path, 3, reward, *extra), "consistent", setup, tmp_path / "split", resume=True)
    history = resumed.run(progress=False)
    assert is_exact(history[-1])
    expected, got = policy_weights(whole), policy_weights(resumed)
    assert all(torch.equal(got[k], expected[k]) for k in expected) == restore_masters
