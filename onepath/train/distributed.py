"""Rollout and training on several devices, in different parallel layouts, with diff = 0.

Rollout layouts: `dp` (one engine replica per rank, each on its share of the prompts) or `single`
(rank 0's engine generates everything). Trainer layouts: `fsdp` (every rank owns 1/world of each
parameter and its AdamW state; the full weights are all-gathered into the compute model before each
forward: a copy, no reduction in the forward path; gradients are averaged across ranks in the
backward) or `single` (rank 0 trains). A token's log-prob is computed by the same kernels on every
device, so every pairing of layouts keeps diff = 0; weights reach the engines by an all-gather
(fsdp) or a broadcast from rank 0 (single) into the engines' existing storage.

Run: `python -m onepath.train.distributed --device cuda --world 2 --steps 3 --out results.json`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from onepath.consistency.diff import is_exact, rollout_diff
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.config import ModelConfig
from onepath.models import build_decoder
from onepath.models.dense import DenseDecoder
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from onepath.train.actor import Actor, Responses
from onepath.train.grpo import group_advantages, policy_loss

# NVLink multicast stays off, in this process and in every process it starts.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ROLLOUT_LAYOUTS = ("dp", "single")
TRAINER_LAYOUTS = ("fsdp", "single")


class ShardedActor(Actor):
    """FSDP-style actor: the optimizer owns this rank's flat shard of every parameter."""

    def __init__(self, model: DenseDecoder, block_size: int, lr: float, max_grad_norm: float = 1.0):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.shards = {}
        for name, p in model.named_parameters():
            flat = p.detach().flatten()
            size = -(-flat.numel() // self.world)
            padded = torch.cat([flat, flat.new_zeros(size * self.world - flat.numel())])
            self.shards[name] = torch.nn.Parameter(padded[self.rank * size:(self.rank + 1) * size].clone())
        super().__init__(model, block_size, lr=lr, max_grad_norm=max_grad_norm)
        self.optimizer = torch.optim.AdamW(self.shards.values(), lr=lr, weight_decay=0.0)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)

    @torch.no_grad()
    def gather(self) -> None:
        """All-gather the shards into the compute model's parameters, in place."""
        for name, p in self.model.named_parameters():
            shard = self.shards[name].detach()
            parts = [torch.empty_like(shard) for _ in range(self.world)]
            dist.all_gather(parts, shard)
            p.copy_(torch.cat(parts)[:p.numel()].view_as(p))

    def update(self, loss: torch.Tensor) -> float:
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:
            dist.all_reduce(p.grad)
            p.grad /= self.world
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        for name, p in self.model.named_parameters():
            grad = p.grad.flatten() if p.grad is not None else torch.zeros_like(p).flatten()
            size = self.shards[name].numel()
            padded = torch.cat([grad, grad.new_zeros(size * self.world - grad.numel())])
            self.shards[name].grad = padded[self.rank * size:(self.rank + 1) * size].clone()
        self.optimizer.step()
        self.gather()
        return float(grad_norm)


def model_config(device: str) -> ModelConfig:
    if device == "cpu":
        return ModelConfig(vocab_size=53, hidden_size=48, intermediate_size=136, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, model_type="qwen3", eos_token_id=2)
    return ModelConfig(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, model_type="qwen3",
                       eos_token_id=2, tie_word_embeddings=True)


def build(config: ModelConfig, mode: str, device: str) -> DenseDecoder:
    model = build_decoder(config, Ops(ExecutionSpec.default(mode, "cuda" if device == "cuda" else "cpu")),
                         max_positions=1024)
    model.init_weights(seed=0, std=0.15 if device == "cpu" else 0.02)
    return model


def prompts_for(step: int, count: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(1, 200, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def pseudo_rewards(completions: list[list[int]]) -> torch.Tensor:
    """A deterministic stand-in reward (share of even token ids): this run proves consistency, not learning."""
    return torch.tensor([sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in completions])


def run_pairing(rollout: str, trainer: str, mode: str, device: str, steps: int, prompts_per_step: int,
                group: int = 4) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = model_config(device)
    has_engine = rollout == "dp" or rank == 0
    trains = trainer == "fsdp" or rank == 0
    engine = LLMEngine(build(config, mode, device), num_blocks=4096, block_size=16,
                       scheduler=SchedulerConfig(max_model_len=1024)) if has_engine else None
    actor = None
    if trains:
        policy = build(config, mode, device)
        actor = ShardedActor(policy, 16, lr=1e-4) if trainer == "fsdp" else Actor(policy, 16, lr=1e-4)
    history = []
    for step in range(steps):
        prompts = [p for p in prompts_for(step, prompts_per_step, config.vocab_size) for _ in range(group)]
        params = [SamplingParams(max_tokens=48, ignore_eos=True, seed=step) for _ in prompts]
        ids = list(range(step * 10_000, step * 10_000 + len(prompts)))
        mine = [i for i in range(len(prompts)) if (rollout == "single" and rank == 0) or
                (rollout == "dp" and (i // group) % world == rank)]
        start = time.perf_counter()
        local = engine.generate([prompts[i] for i in mine], [params[i] for i in mine], [ids[i] for i in mine]) \
            if has_engine else []
        seconds = time.perf_counter() - start
        gathered = [None] * world
        dist.all_gather_object(gathered, [(i, o.prompt_token_ids, o.token_ids, o.logprobs) for i, o in zip(mine, local)])
        outputs = sorted((row for part in gathered for row in part), key=lambda row: row[0])
        share = [row for row in outputs if trainer == "single" or (row[0] // group) % world == rank]
        metrics = {}
        if trains:
            r = Responses.build([row[1] for row in share], [row[2] for row in share],
                                [params[row[0]] for row in share], [row[3] for row in share])
            lp, _ = actor.logprobs(r)
            mask = r.mask.to(lp.device)
            metrics = rollout_diff(r.rollout_logprobs.to(lp.device), lp.detach(), mask)
            rewards = pseudo_rewards([row[2] for row in share])
            advantages = group_advantages(rewards, group).to(lp.device)
            loss, _ = policy_loss(lp, lp.detach(), advantages, mask, 0.2)
            actor.update(loss)
        sync(engine, actor, rollout, trainer)
        reports = [None] * world
        dist.all_gather_object(reports, {"rank": rank, "exact": bool(metrics) and is_exact(metrics),
                                         "trains": trains, "generated": sum(len(o.token_ids) for o in local),
                                         "gen_seconds": seconds, **{k: float(v) for k, v in metrics.items()}})
        history.append({"step": step, "ranks": reports})
    return history


@torch.no_grad()
def sync(engine: LLMEngine | None, actor: Actor | None, rollout: str, trainer: str) -> None:
    """New weights into every engine's existing storage: locally after an fsdp all-gather, by a
    broadcast from rank 0 when one rank trains and every rank holds a replica."""
    if engine is None:
        return
    if trainer == "fsdp" or dist.get_rank() == 0:
        engine.update_weights(actor.model.named_parameters())
    if trainer == "single" and rollout == "dp":
        for _, p in engine.model.named_parameters():
            dist.broadcast(p.data, src=0)
        engine.weights_changed()


def worker(rank: int, world: int, device: str, mode: str, steps: int, prompts_per_step: int, port: int, queue):
    os.environ.update(NO_MULTICAST)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank) if device == "cuda" else None)
    try:
        results = {}
        for rollout in ROLLOUT_LAYOUTS:
            for trainer in TRAINER_LAYOUTS:
                results[f"rollout={rollout},trainer={trainer}"] = run_pairing(rollout, trainer, mode, device, steps,
                                                                              prompts_per_step)
        if rank == 0:
            queue.put(results)
        # nobody leaves while another rank still talks to it (gloo aborts a process whose peer vanished)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int = 2, device: str = "cpu", mode: str = "consistent", steps: int = 2,
        prompts_per_step: int = 4, port: int | None = None) -> dict:
    """Every pairing of rollout and trainer layouts on `world` processes; returns the per-step reports."""
    os.environ.update(NO_MULTICAST)
    port = port or free_port()
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    torch.multiprocessing.start_processes(worker, args=(world, device, mode, steps, prompts_per_step, port, queue),
                                          nprocs=world, join=True, start_method="spawn")
    return queue.get()


def all_exact(results: dict) -> bool:
    return all(rank["exact"] for history in results.values() for step in history for rank in step["ranks"]
               if rank["trains"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--mode", default="consistent", choices=("consistent", "baseline"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    start = time.perf_counter()
    results = run(args.world, args.device, args.mode, args.steps, args.prompts_per_step)
    record = {"command": "python -m onepath.train.distributed " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "world": args.world,
              "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "mode": args.mode,
              "torch": torch.__version__, "wall_seconds": time.perf_counter() - start,
              "all_diff_exactly_0": all_exact(results), "pairings": results}
    for name, history in results.items():
        for step in history:
            trainers = [r for r in step["ranks"] if r["trains"]]
            worst = max(r["training/rollout_probs_diff_max"] for r in trainers)
            tok_s = sum(r["generated"] for r in step["ranks"]) / max(max(r["gen_seconds"] for r in step["ranks"]), 1e-9)
            print(f"{name:<32} step {step['step']}  max|dp| {worst:.3g}  exact {all(r['exact'] for r in trainers)}  "
                  f"rollout tok/s {tok_s:.0f}")
    print(f"all pairings diff exactly 0: {record['all_diff_exactly_0']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if record["all_diff_exactly_0"] or args.mode == "baseline" else 1


if __name__ == "__main__":
    sys.exit(main())
