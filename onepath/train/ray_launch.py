"""`onepath train` on a Ray cluster (parallel.launcher ray): the run's processes are Ray actors.

The driver (the `onepath train` process) joins or starts a Ray cluster, reserves one bundle per process
(a GPU each on CUDA, a CPU each on the CPU) in placement groups: one group for every process when the
sides are colocated, one for the trainer's and one for the engines' when parallel.rollout_processes
disaggregates them (two resource sets, packed each on as few nodes as they fit). Each actor runs the
same loop torchrun's processes run (train/run.py), with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
pointing at rank 0's actor: the process group is NCCL on CUDA and gloo on the CPU, and the weights
reach the engines by its broadcast into their existing storage (train/parallel.py sync_weights), so
captured graphs stay valid. Rank 0 writes the run directory: on several machines it must be shared.
"""
from __future__ import annotations

import os
import socket
from typing import Callable

from onepath.config import RunConfig
from onepath.train.parallel import world_for

WORKER_ENV = "ONEPATH_RAY_RANK"  # set in each actor: run.run then trains instead of launching


def require_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("parallel.launcher ray needs Ray: pip install 'onepath[ray]' (or pip install ray), or use "
                          "parallel.launcher torchrun") from None
    return ray


class RankWorker:
    """One process of the run, as a Ray actor."""

    def node(self) -> tuple[str, str]:
        """(node id, IP address) of the node this actor runs on."""
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, loop: Callable, raw: dict, rank: int, size: int, address: str, port: int, resume: bool,
            progress: bool, cwd: str) -> int:
        if os.path.isdir(cwd):
            os.chdir(cwd)  # the driver's relative paths (--out, data files) mean the same here
        os.environ.update({WORKER_ENV: str(rank), "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": "0",
                           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": address, "MASTER_PORT": str(port)})
        return loop(RunConfig.from_dict(raw), resume=resume, progress=progress and rank == 0)


def launch(cfg: RunConfig, loop: Callable, resume: bool = False, progress: bool = True) -> int:
    """Start cfg.parallel.processes actors, each running loop(cfg, resume, progress) (train/run.py's run);
    the exit status of rank 0's."""
    ray = require_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    p = cfg.parallel
    size = p.processes or 2
    world_for(cfg, 0, size)  # a layout the model or the run cannot take is refused before Ray starts
    started = not ray.is_initialized()
    if started:
        ray.init(address=p.ray_address, include_dashboard=False, logging_level="WARNING")
    resource = {"GPU": 1} if cfg.device == "cuda" else {"CPU": 1}
    sides = [size - p.rollout_processes, p.rollout_processes] if p.rollout_processes else [size]
    groups = [placement_group([dict(resource)] * n, strategy="PACK") for n in sides]
    actors = []
    try:
        for group in groups:
            if not group.wait(timeout_seconds=300):
                raise RuntimeError(f"the Ray cluster has no room for {len(group.bundle_specs)} bundles of {resource} "
                                   f"(ray status shows its resources): lower parallel.processes, or add nodes")
        worker = ray.remote(RankWorker)
        options = {"num_gpus": 1} if cfg.device == "cuda" else {"num_cpus": 1}
        for group, n in zip(groups, sides):
            for i in range(n):
                strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)
                actors.append(worker.options(scheduling_strategy=strategy, **options).remote())
        nodes = ray.get([a.node.remote() for a in actors])
        port = ray.get(actors[0].free_port.remote())
        roles = ["both" if not p.rollout_processes else "trainer" if r < sides[0] else "rollout" for r in range(size)]
        for rank, ((node, ip), role) in enumerate(zip(nodes, roles)):
            print(f"ray: rank {rank} ({role}) on node {node[:12]} at {ip}", flush=True)
        raw = cfg.to_dict()
        codes = ray.get([a.run.remote(loop, raw, rank, size, nodes[0][1], port, resume, progress, os.getcwd())
                         for rank, a in enumerate(actors)])
        return codes[0]
    finally:
        for a in actors:
            ray.kill(a)
        for group in groups:
            remove_placement_group(group)
        if started:
            ray.shutdown()
