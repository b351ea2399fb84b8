"""`onepath train` on several processes (torchrun, gloo on the CPU): every pairing of rollout layout
and trainer layout keeps diff = 0 on every step, with the weight sync between steps; baseline differs;
a checkpoint written in one layout resumes in another. Dense: rollout dp | tp | single x trainer fsdp |
single; MoE adds ep on either side; the sides colocated or disaggregated (parallel.rollout_processes);
two torchrun "nodes" joined by a c10d rendezvous. Each case is a real launch: `python -m
torch.distributed.run --standalone --nproc-per-node K -m onepath train ...`."""
import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from onepath.config import load_run_config
from onepath.numerics.diff import DIFF_METRICS
from onepath.train.parallel import world_for
from tests.models.test_moe_ep import free_port

TINY = ["--warm_start.steps", "0", "--train.steps", "2", "--train.prompts_per_step", "4", "--rollout.n", "2",
        "--data.n_train", "40", "--data.n_test", "4", "--quiet"]
MOE = ["--model.model_type", "qwen3_moe", "--model.num_experts", "4", "--model.num_experts_per_tok", "2",
       "--model.moe_intermediate_size", "32"]
DENSE_PAIRS = [(r, t) for r in ("dp", "tp", "single") for t in ("fsdp", "single")]
MOE_PAIRS = [(r, t) for r in ("ep", "dp", "tp", "single") for t in ("ep", "fsdp", "single")]


def train(processes: int, out: Path, *args: str) -> list[dict]:
    """One launch; the run's metrics.jsonl (a mode's, with --mode both: out/consistent, out/baseline)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] if processes > 1 else []
    done = subprocess.run([sys.executable, *launcher, "-m", "onepath", "train", *TINY, "--out", str(out), *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return metrics(out) if "both" not in args else []


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def exact(history: list[dict]) -> bool:
    assert history and all(m["rollout_corr/valid_tokens"] > 0 for m in history)
    return all(m[k] == 0.0 for m in history for k in DIFF_METRICS)


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / f"step_{step}" / "model.safetensors")


def layout(rollout: str, trainer: str) -> list[str]:
    return ["--parallel.rollout", rollout, "--parallel.trainer", trainer]


def test_dense_two_processes_dp_fsdp_keeps_diff_zero_and_baseline_differs(tmp_path, reward):
    train(2, tmp_path, "--mode", "both", "--train.reward", reward, *layout("dp", "fsdp"))
    consistent, baseline = metrics(tmp_path / "consistent"), metrics(tmp_path / "baseline")
    assert len(consistent) == 2 and exact(consistent)
    assert any(m["training/rollout_probs_diff_max"] > 0 for m in baseline)  # negative control
    # the run's files come from rank 0 alone, once
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "report.png").is_file()
    assert sorted(p.name for p in (tmp_path / "consistent").glob("step_*")) == ["step_2"]


def test_moe_four_processes_ep_engines_and_ep_trainer_keep_diff_zero(tmp_path, reward):
    history = train(4, tmp_path, "--train.reward", reward, *MOE, *layout("ep", "ep"))
    assert len(history) == 2 and exact(history)
    # the engines' routing, gathered from four ranks, is the trainers' in every slot
    assert all(m["moe/routing_agreement"] == 1.0 and m["moe/routing_compared_tokens"] > 0 for m in history)


def test_dense_tensor_parallel_rollout_against_one_trainer_keeps_diff_zero(tmp_path, reward):
    """Rollout at TP 2, the trainer at TP 1: diff = 0 on every step; the baseline's TP (partial sums
    all-reduced) and its kernels differ."""
    train(2, tmp_path, "--mode", "both", "--train.reward", reward, *layout("tp", "single"))
    consistent, baseline = metrics(tmp_path / "consistent"), metrics(tmp_path / "baseline")
    assert len(consistent) == 2 and exact(consistent)
    assert any(m["training/rollout_probs_diff_max"] > 0 for m in baseline)
    # each generated token counted once, though both ranks of the TP group generated it
    for m in consistent:
        generated = m["perf/rollout_tokens_per_s"] * m["timing_s/gen"]
        assert m["rollout_corr/valid_tokens"] <= round(generated) < 1.5 * m["rollout_corr/valid_tokens"]


def test_moe_disaggregated_fsdp_trainers_and_a_tensor_parallel_engine_keep_diff_zero(tmp_path, reward):
    """Four processes: ranks 0-1 train (fsdp), ranks 2-3 hold one engine at TP 2; the weights reach the
    engine by a broadcast from rank 0 into its shards. The run's tokens match a colocated one's."""
    args = ["--train.reward", reward, *MOE, "--train.save_every", "1"]
    history = train(4, tmp_path / "split", *args, *layout("tp", "fsdp"), "--parallel.rollout_processes", "2")
    assert len(history) == 2 and exact(history)
    assert all(m["moe/routing_agreement"] == 1.0 for m in history)
    colocated = train(2, tmp_path / "together", *args, *layout("dp", "fsdp"))
    assert [m["response_length/mean"] for m in history] == [m["response_length/mean"] for m in colocated]
    split, together = weights(tmp_path / "split", 2), weights(tmp_path / "together", 2)
    assert all(torch.equal(split[k], together[k]) for k in together)  # fsdp on 2 ranks either way


def test_two_torchrun_nodes_joined_by_a_c10d_rendezvous(tmp_path, reward):
    """`torchrun --nnodes 2 --rdzv-backend c10d`: two launchers on this machine, one process each, find
    each other through the rendezvous and run dp x fsdp with diff = 0 on every step."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                "-m", "onepath", "train", *TINY, "--out", str(tmp_path), "--train.reward", reward,
                *layout("dp", "fsdp")]
    nodes = [subprocess.Popen(launcher, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), logs[0][-3000:] + logs[1][-3000:]
    history = metrics(tmp_path)
    assert len(history) == 2 and exact(history)


def test_checkpoint_resumes_across_a_change_of_layout(tmp_path, reward):
    """fsdp on 2 ranks writes step_1; resumed on 2 ranks fsdp it is the uninterrupted run, bit for bit;
    on 1 process and on 4 ranks fsdp the first step after the restore still has diff = 0 and lands
    where the uninterrupted run does up to the gradients' summation order (the optimizer state came
    through: without it the step would move the weights by about lr)."""
    args = ["--train.reward", reward, "--train.save_every", "1", *layout("dp", "fsdp")]
    train(2, tmp_path / "whole", *args)
    train(2, tmp_path / "split", *args, "--train.steps", "1")
    for name, processes, extra in (("same", 2, []), ("one", 1, layout("single", "single")), ("four", 4, [])):
        run = tmp_path / name
        shutil.copytree(tmp_path / "split" / "step_1", run / "step_1")
        history = train(processes, run, *args, *extra, "--resume")
        assert [m["step"] for m in history] == [2] and exact(history), name
    whole, first = weights(tmp_path / "whole", 2), weights(tmp_path / "whole", 1)
    assert all(torch.equal(weights(tmp_path / "same", 2)[k], whole[k]) for k in whole)
    moved = max((whole[k] - first[k]).abs().max() for k in whole)
    for name in ("one", "four"):
        got = weights(tmp_path / name, 2)
        assert max((got[k] - whole[k]).abs().max() for k in whole) < moved / 1000, name


def test_a_layout_the_model_cannot_take_is_refused_at_start():
    with pytest.raises(ValueError, match=r"parallel.trainer = 'ep' splits the experts.*dense"):
        load_run_config(None, layout("dp", "ep"))
    with pytest.raises(ValueError, match=r"parallel.rollout = 'pp' is not a rollout layout"):
        load_run_config(None, layout("pp", "fsdp"))
    with pytest.raises(ValueError, match=r"parallel.tp = 2 applies to parallel.rollout tp, not 'dp'"):
        load_run_config(None, [*layout("dp", "fsdp"), "--parallel.tp", "2"])
    with pytest.raises(ValueError, match=r"parallel.rollout_processes = 2 splits the processes, but a layout is ep"):
        load_run_config(None, [*MOE, *layout("ep", "fsdp"), "--parallel.rollout_processes", "2"])
    tp = load_run_config(None, layout("tp", "single"))
    assert world_for(tp, 1, 4).rollout_share(8, 2) == [0, 1, 2, 3, 4, 5, 6, 7]  # one engine over 4 ranks
    assert world_for(load_run_config(None, [*layout("tp", "single"), "--parallel.tp", "2"]), 3, 4).rollout_share(
        8, 2) == [2, 3, 6, 7]  # two TP groups, data-parallel
    with pytest.raises(ValueError, match=r"parallel.tp = 3 on 4 rollout processes: the TP degree must be >= 2"):
        world_for(load_run_config(None, [*layout("tp", "single"), "--parallel.tp", "3"]), 0, 4)
    with pytest.raises(ValueError, match=r"parallel.tp = 8 does not divide the 4 attention heads"):
        world_for(tp, 0, 8)
    with pytest.raises(ValueError, match=r"rollout_processes = 2 on 2 processes leaves none to train"):
        world_for(load_run_config(None, ["--parallel.rollout_processes", "2"]), 0, 2)
    split = world_for(load_run_config(None, [*layout("dp", "fsdp"), "--parallel.rollout_processes", "1"]), 2, 3)
    assert split.has_engine and not split.trains and split.rollout_share(4, 1) == [0, 1, 2, 3]
    cfg = load_run_config(None, [*MOE, *layout("ep", "fsdp")])
    with pytest.raises(ValueError, match=r"on 3 processes: 4 experts do not split evenly"):
        world_for(cfg, 0, 3)
    assert world_for(cfg, 1, 2).rollout_share(8, 2) == [2, 3, 6, 7]  # whole groups, group g on rank g % 2
    with pytest.raises(ValueError, match=r"set train.micro_batch_tokens \(= 64\) to null"):
        world_for(load_run_config(None, [*MOE, *layout("ep", "ep"), "--train.micro_batch_tokens", "64"]), 0, 2)
    with pytest.raises(ValueError, match=r"rollout.env = 'calculator' runs its episodes on one process"):
        world_for(load_run_config(None, ["--rollout.env", "calculator", *layout("dp", "single")]), 0, 2)
    assert world_for(cfg, 0, 1).rollout == "single"  # one process: every layout is single


@pytest.mark.slow
@pytest.mark.parametrize("model, pairs", [("dense", DENSE_PAIRS), ("moe", MOE_PAIRS)])
def test_every_layout_pair_keeps_diff_zero_on_two_processes(tmp_path, reward, model, pairs):
    """The trained weights depend on the trainer's layout only: bitwise the same under every rollout layout."""
    final = {}
    for rollout, trainer in pairs:
        run = tmp_path / f"{rollout}-{trainer}"
        history = train(2, run, "--train.reward", reward, *(MOE if model == "moe" else []), *layout(rollout, trainer))
        assert exact(history), (rollout, trainer)
        final[rollout, trainer] = weights(run, 2)
    for rollout, trainer in pairs:
        reference = final[pairs[0][0], trainer]
        assert all(torch.equal(final[rollout, trainer][k], reference[k]) for k in reference), (rollout, trainer)


@pytest.mark.slow
def test_moe_baseline_expert_parallel_differs(tmp_path, reward):
    history = train(2, tmp_path, "--mode", "baseline", "--train.reward", reward, *MOE, *layout("ep", "ep"))
    assert any(m["training/rollout_probs_diff_max"] > 0 for m in history)
