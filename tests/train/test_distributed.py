"""Several processes (gloo on the CPU): every pairing of rollout layout (dp replicas, single) and trainer
layout (fsdp shards, single) keeps diff = 0 over RL steps with weight sync; baseline differs."""
from onepath.train.distributed import all_exact, run


def test_every_layout_pairing_keeps_diff_exactly_zero():
    results = run(world=2, device="cpu", mode="consistent", steps=2, prompts_per_step=4)
    assert len(results) == 4
    for name, history in results.items():
        trainers = [r for step in history for r in step["ranks"] if r["trains"]]
        assert trainers and all(r["rollout_corr/valid_tokens"] > 0 for r in trainers), name
    assert all_exact(results), results


def test_negative_control_baseline_layouts_differ():
    results = run(world=2, device="cpu", mode="baseline", steps=1, prompts_per_step=4)
    assert not all_exact(results)
