"""Several processes (gloo on the CPU): every pairing of rollout layout (dp replicas, single) and trainer
layout (fsdp shards, single) keeps diff = 0 over RL steps with weight sync; baseline differs. The MoE
model adds expert parallelism (ep) on either side, at 2 and 4 processes."""
import json

import torch

from onepath.train.distributed import all_exact, run


def test_every_layout_pairing_keeps_diff_exactly_zero(tmp_path):
    progress = tmp_path / "steps.jsonl"
    results = run(world=2, device="cpu", mode="consistent", steps=2, prompts_per_step=4, progress=str(progress))
    assert len(results) == 4
    for name, history in results.items():
        trainers = [r for step in history for r in step["ranks"] if r["trains"]]
        assert trainers and all(r["rollout_corr/valid_tokens"] > 0 for r in trainers), name
    assert all_exact(results), results
    # every step was also written as it ended, the same report
    lines = [json.loads(line) for line in progress.read_text().splitlines()]
    assert [(line["pairing"], line["step"]) for line in lines] == [(name, s) for name in results for s in range(2)]
    assert all(line["ranks"] == results[line["pairing"]][line["step"]]["ranks"] for line in lines)


def test_negative_control_baseline_layouts_differ():
    results = run(world=2, device="cpu", mode="baseline", steps=1, prompts_per_step=4)
    assert not all_exact(results)


# MoE: expert parallelism (ep) on either side; the engine and the trainer at different EP degrees
MOE_LAYOUTS = [("ep", "single"), ("single", "single"), ("single", "ep"), ("ep", "ep"), ("dp", "ep"), ("ep", "fsdp")]


def test_moe_expert_parallel_layouts_keep_diff_exactly_zero():
    results = run(world=2, device="cpu", mode="consistent", steps=2, prompts_per_step=4, model="moe",
                  layouts=MOE_LAYOUTS, keep_weights=True)
    assert len(results) == len(MOE_LAYOUTS)
    for name, history in results.items():
        trainers = [r for step in history for r in step["ranks"] if r["trains"]]
        assert trainers and all(r["rollout_corr/valid_tokens"] > 0 for r in trainers), name
    # diff = 0 before every update, the second step's rollout on weights synced into the engines
    assert all_exact(results), results
    # the ep engines took different numbers of steps: a finished rank served its experts to the other
    assert any(len({r["engine_steps"] for r in step["ranks"]}) > 1 for step in results["rollout=ep,trainer=ep"])
    # the trained weights depend on the trainer's layout only: bitwise the same under every rollout layout
    digests = lambda name: [step["ranks"][0]["weights"] for step in results[name]]
    assert digests("rollout=ep,trainer=single") == digests("rollout=single,trainer=single")
    assert digests("rollout=single,trainer=ep") == digests("rollout=ep,trainer=ep") == digests("rollout=dp,trainer=ep")
    # the ep trainer takes the fsdp trainer's steps (the same data-parallel loss), up to the order of the
    # gradient sums: replicated gradients all-reduced, expert gradients summed by the all-to-all's backward
    final = lambda name: torch.from_numpy(results[name][-1]["ranks"][0]["weights_vector"])
    torch.testing.assert_close(final("rollout=ep,trainer=ep"), final("rollout=ep,trainer=fsdp"), rtol=0, atol=1e-6)
    assert len(set(digests("rollout=ep,trainer=ep"))) == 2  # each step moved the weights


def test_moe_negative_control_baseline_expert_parallel_differs():
    results = run(world=2, device="cpu", mode="baseline", steps=1, prompts_per_step=4, model="moe",
                  layouts=[("ep", "ep")])
    assert not all_exact(results)


def test_moe_four_processes_engines_at_ep_4_keep_diff_exactly_zero():
    results = run(world=4, device="cpu", mode="consistent", steps=2, prompts_per_step=4, model="moe",
                  layouts=[("ep", "single"), ("single", "single"), ("ep", "ep")])
    assert all_exact(results), results
    trainers = [r for step in results["rollout=ep,trainer=ep"] for r in step["ranks"]]
    assert len(trainers) == 8 and all(r["rollout_corr/valid_tokens"] > 0 for r in trainers)
    # four engines at EP 4 sample what one engine samples: one trainer ends with the same weights
    digests = lambda name: [step["ranks"][0]["weights"] for step in results[name]]
    assert digests("rollout=ep,trainer=single") == digests("rollout=single,trainer=single")
