"""`onepath train --parallel.launcher ray` on a local Ray cluster of two nodes (a head and a second node,
one CPU each, both on this machine's loopback address): the trainer's actor on one node and the engine's
on the other (disaggregated), weights broadcast over gloo into the engine's storage after every step;
diff = 0 on every consistent step, the baseline's differs. Colocated: one tensor-parallel engine and an
fsdp trainer spanning both nodes."""
import json
import os
import subprocess
import sys

import pytest

from tests.train.test_distributed import TINY, exact, metrics

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
# Ray's switch to the loopback address for every node and process (named for the platforms it was meant for):
# the test's traffic stays on 127.0.0.1
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture(scope="module")
def cluster():
    saved = {k: os.environ.get(k) for k in LOOPBACK}
    os.environ.update(LOOPBACK)
    two = Cluster(initialize_head=True, head_node_args=dict(NODE))
    two.add_node(**NODE)
    two.wait_for_nodes()
    yield two
    two.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_ray_actors_on_two_nodes_disaggregated_keep_diff_zero(tmp_path, reward, cluster):
    done = subprocess.run([sys.executable, "-m", "onepath", "train", *TINY, "--out", str(tmp_path), "--mode", "both",
                           "--train.reward", reward, "--parallel.launcher", "ray", "--parallel.ray_address",
                           cluster.address, "--parallel.processes", "2", "--parallel.rollout", "dp",
                           "--parallel.rollout_processes", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    placed = [line.split(" on node ")[1].split()[0] for line in done.stdout.splitlines() if line.startswith("ray: rank")]
    assert len(placed) == 2 and placed[0] != placed[1]  # the trainer and the engine on different nodes
    assert "rank 0 (trainer)" in done.stdout and "rank 1 (rollout)" in done.stdout
    consistent, baseline = metrics(tmp_path / "consistent"), metrics(tmp_path / "baseline")
    assert len(consistent) == 2 and exact(consistent)
    assert any(m["training/rollout_probs_diff_max"] > 0 for m in baseline)  # negative control
    assert json.loads((tmp_path / "summary.json").read_text())
    assert any(m["actor/grad_norm"] > 0 for m in consistent)  # the weights moved, and the sync carried them


def test_ray_actors_colocated_tensor_parallel_across_two_nodes_keep_diff_zero(tmp_path, reward, cluster):
    done = subprocess.run([sys.executable, "-m", "onepath", "train", *TINY, "--out", str(tmp_path),
                           "--train.reward", reward, "--parallel.launcher", "ray", "--parallel.ray_address",
                           cluster.address, "--parallel.rollout", "tp", "--parallel.trainer", "fsdp"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    placed = {line.split(" on node ")[1].split()[0] for line in done.stdout.splitlines() if "(both) on node" in line}
    assert len(placed) == 2  # parallel.processes null: 2 actors, one a node
    history = metrics(tmp_path)
    assert len(history) == 2 and exact(history)


def test_ray_is_refused_under_torchrun_and_its_keys_without_it(monkeypatch):
    from onepath.config import load_run_config
    from onepath.train.run import run

    cfg = load_run_config(None, ["--parallel.launcher", "ray"])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(ValueError, match="parallel.launcher = 'ray' starts its own processes"):
        run(cfg)
    with pytest.raises(ValueError, match="parallel.processes = 2 applies to parallel.launcher ray"):
        load_run_config(None, ["--parallel.processes", "2"])
