"""Rollout and training on several devices, in different parallel layouts, with diff = 0.

Rollout layouts: `dp` (one engine replica per rank, each on its share of the prompts) or `single`
(rank 0's engine generates everything). Trainer layouts: `fsdp` (every rank owns 1/world of each
parameter and its AdamW state; the full weights are all-gathered into the compute model before each
forward: a copy, no reduction in the forward path; gradients are averaged across ranks in the
backward) or `single` (rank 0 trains). A token's log-prob is computed by the same kernels on every
device, so every pairing of layouts keeps diff = 0; weights reach the engines by an all-gather
(fsdp) or a broadcast from rank 0 (single) into the engines' existing storage.

The MoE model (`--model moe`) adds `ep` on either side: expert parallelism over every rank
(MoeDecoder.expert_parallel), each rank holding the replicated weights and its slice of the experts.
Rollout `ep`: one engine per rank on its share of the prompts, the engines stepping in lockstep
(generate_in_lockstep). Trainer `ep`: each rank trains on its share; replicated gradients are
averaged, an expert's gradient is already summed over every rank's tokens on its owner (the
all-to-all's backward) and is divided by the world to match. The all-to-alls only move rows, so the
EP degree moves no bit and the engine and the trainer may use different degrees.

Run: `python -m onepath.train.distributed --device cuda --world 2 --steps 3 --out results.json`
(`--model moe` for the MoE layouts).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from queue import Empty

import torch
import torch.distributed as dist

from onepath.consistency.diff import is_exact, rollout_diff
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.config import ModelConfig
from onepath.models import build_decoder
from onepath.models.dense import DenseDecoder
from onepath.models.moe import MoeDecoder
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from onepath.train.actor import Actor, Responses
from onepath.train.grpo import group_advantages, policy_loss

# NVLink multicast stays off, in this process and in every process it starts.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
LAYOUTS = {"dense": (("dp", "single"), ("fsdp", "single")),   # (rollout layouts, trainer layouts)
           "moe": (("ep", "dp", "single"), ("ep", "fsdp", "single"))}


def pairings(model: str = "dense") -> list[tuple[str, str]]:
    rollouts, trainers = LAYOUTS[model]
    return [(rollout, trainer) for rollout in rollouts for trainer in trainers]


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


class ExpertParallelActor(Actor):
    """EP actor for the MoE model: every rank holds the replicated weights and its experts."""

    def __init__(self, model: MoeDecoder, block_size: int, lr: float, max_grad_norm: float = 1.0):
        self.world = dist.get_world_size()
        super().__init__(model.expert_parallel(), block_size, lr=lr, max_grad_norm=max_grad_norm)
        self.experts = set(model.expert_slices())

    def update(self, loss: torch.Tensor) -> float:
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        named = list(self.model.named_parameters())
        for name, p in named:
            if p.grad is None:  # no token reached these experts: a zero gradient, and the all-reduces pair up
                p.grad = torch.zeros_like(p)
            if name not in self.experts:
                dist.all_reduce(p.grad)
            # an expert's gradient already sums every rank's tokens (the all-to-all's backward)
            p.grad /= self.world
        # clip_grad_norm_ over the whole model: replicated squares once, expert squares from every owner
        replicated = sum(p.grad.float().square().sum() for name, p in named if name not in self.experts)
        experts = torch.stack([p.grad.float().square().sum() for name, p in named if name in self.experts]).sum()
        dist.all_reduce(experts)
        grad_norm = (replicated + experts).sqrt()
        scale = torch.clamp(self.max_grad_norm / (grad_norm + 1e-6), max=1.0)
        for _, p in named:
            p.grad.mul_(scale.to(p.grad.dtype))
        self.optimizer.step()
        return float(grad_norm)


def model_config(device: str, model: str = "dense") -> ModelConfig:
    """The dense model, or with model="moe" a Qwen3-MoE-shaped one (8 experts top-2 on the CPU, 64
    experts top-8 on the GPU)."""
    moe = model == "moe"
    if model not in LAYOUTS:
        raise ValueError(f"model {model!r} is unknown: use one of {tuple(LAYOUTS)}")
    experts = {} if not moe else dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                                      norm_topk_prob=True) if device == "cpu" else \
        dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, norm_topk_prob=True)
    model_type = "qwen3_moe" if moe else "qwen3"
    if device == "cpu":
        return ModelConfig(vocab_size=53, hidden_size=48, intermediate_size=72 if moe else 136, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, model_type=model_type,
                           eos_token_id=2, **experts)
    return ModelConfig(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, model_type=model_type,
                       eos_token_id=2, tie_word_embeddings=True, **experts)


def build(config: ModelConfig, mode: str, device: str) -> DenseDecoder:
    model = build_decoder(config, Ops(ExecutionSpec.default(mode, "cuda" if device == "cuda" else "cpu")),
                         max_positions=1024)
    model.init_weights(seed=0, std=0.15 if device == "cpu" else 0.02)
    return model


def prompts_for(step: int, count: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(1, 200, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def response_budgets(step: int, count: int) -> list[int]:
    """max_tokens per prompt, uneven: ranks finish their shares after different numbers of engine steps."""
    return torch.randint(16, 49, (count,), generator=torch.Generator().manual_seed(2000 + step)).tolist()


def pseudo_rewards(completions: list[list[int]]) -> torch.Tensor:
    """A deterministic stand-in reward (share of even token ids): this run proves consistency, not learning."""
    return torch.tensor([sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in completions])


def run_pairing(rollout: str, trainer: str, mode: str, device: str, steps: int, prompts_per_step: int,
                group: int = 4, model: str = "dense", keep_weights: bool = False,
                progress: str | None = None) -> list[dict]:
    """`steps` RL steps; each step's report per rank. Rank 0's carries the digest of the trained
    weights and with keep_weights, at the last step, the weights themselves (flat FP32, numpy). With a
    `progress` path, rank 0 appends each step's report to it as a JSON line as soon as the step ends
    (a run cut short keeps its finished steps)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if "ep" in (rollout, trainer) and model != "moe":
        raise ValueError(f"layout ep (rollout={rollout}, trainer={trainer}) splits experts: use --model moe")
    config = model_config(device, model)
    has_engine = rollout in ("dp", "ep") or rank == 0
    trains = trainer in ("fsdp", "ep") or rank == 0
    engine = None
    if has_engine:
        # an EP forward's all-to-alls take their split sizes from the host: no CUDA graphs around them
        weights = build(config, mode, device)
        engine = LLMEngine(weights.expert_parallel() if rollout == "ep" else weights, num_blocks=4096,
                           block_size=16, scheduler=SchedulerConfig(max_model_len=1024),
                           cuda_graphs=None if rollout != "ep" else False)
    actor = None
    if trains:
        policy = build(config, mode, device)
        actors = {"fsdp": ShardedActor, "ep": ExpertParallelActor, "single": Actor}
        actor = actors[trainer](policy, 16, lr=1e-4)
    # a rank with neither an engine nor an actor takes part in no weight collective (single x single)
    holder = actor or engine
    names = [name for name, _ in holder.model.named_parameters()] if holder is not None else []
    history = []
    for step in range(steps):
        prompts = [p for p in prompts_for(step, prompts_per_step, config.vocab_size) for _ in range(group)]
        params = [SamplingParams(max_tokens=n, ignore_eos=True, seed=step)
                  for n in response_budgets(step, prompts_per_step) for _ in range(group)]
        ids = list(range(step * 10_000, step * 10_000 + len(prompts)))
        mine = [i for i in range(len(prompts)) if (rollout == "single" and rank == 0) or
                (rollout in ("dp", "ep") and (i // group) % world == rank)]
        start, engine_steps = time.perf_counter(), engine.stats.steps if has_engine else 0
        generate = generate_in_lockstep if rollout == "ep" else LLMEngine.generate
        local = generate(engine, [prompts[i] for i in mine], [params[i] for i in mine], [ids[i] for i in mine]) \
            if has_engine else []
        seconds = time.perf_counter() - start
        engine_steps = engine.stats.steps - engine_steps if has_engine else 0
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
        sync(engine, actor, rollout, trainer, names)
        digest, weights = trained_weights(actor, trainer, names, flat=keep_weights and step == steps - 1)
        kept = {"weights_vector": weights.numpy()} if weights is not None else {}
        reports = [None] * world
        dist.all_gather_object(reports, {"rank": rank, "exact": bool(metrics) and is_exact(metrics),
                                         "weights": digest, **kept,
                                         "trains": trains, "generated": sum(len(o.token_ids) for o in local),
                                         "engine_steps": engine_steps,
                                         "gen_seconds": seconds, **{k: float(v) for k, v in metrics.items()}})
        history.append({"step": step, "ranks": reports})
        if rank == 0:  # progress: a run that stalls shows where
            if progress:
                line = {"pairing": f"rollout={rollout},trainer={trainer}", "step": step,
                        "ranks": [{k: v for k, v in r.items() if k != "weights_vector"} for r in reports]}
                with open(progress, "a") as f:
                    f.write(json.dumps(line) + "\n")
            exact = all(r["exact"] for r in reports if r["trains"])
            print(f"rollout={rollout},trainer={trainer} step {step}: generated "
                  f"{sum(r['generated'] for r in reports)} tokens in {max(r['gen_seconds'] for r in reports):.1f} s, "
                  f"diff exactly 0: {exact}", file=sys.stderr, flush=True)
    return history


def generate_in_lockstep(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
                         request_ids: list[int]) -> list:
    """LLMEngine.generate for engines whose model is expert-parallel over every rank. Each sparse
    layer's all-to-alls pair up only if every rank runs the same number of forwards, so the engines
    step together: before each step the ranks agree whether any of them has work left, a rank with
    work runs one engine step (one forward), and a rank without runs the sparse layers on zero tokens
    (MoeDecoder.serve_experts), its experts serving the others' rows."""
    for prompt, p, rid in zip(prompts, params, request_ids):
        engine.add_request(prompt, p, rid)
    device = engine.model.device
    outputs = {}
    while True:
        busy = torch.tensor([1 if engine.has_unfinished() else 0], device=device)
        dist.all_reduce(busy)
        if not int(busy):
            break
        steps = engine.stats.steps
        if engine.has_unfinished():
            for seq in engine.step():
                outputs[seq.request_id] = engine.output(seq)
        if engine.stats.steps == steps:  # no forward this round (nothing left, or only a step to complete)
            engine.model.serve_experts()
    return [outputs[rid] for rid in request_ids]


@torch.no_grad()
def sync(engine: LLMEngine | None, actor: Actor | None, rollout: str, trainer: str, names: list[str]) -> None:
    """New weights into every engine's existing storage, in place. Every rank walks the same `names`,
    so the collectives pair up. Full weights come from the trainer: on every rank after an fsdp
    all-gather (and for the replicated weights of an ep trainer), by a broadcast from rank 0 when
    rank 0 alone trains and other ranks hold engines, by an all-gather of the owners' slices for the
    experts of an ep trainer. An ep engine keeps its slice of the experts; between an ep trainer and
    an ep engine (the same slices) the experts do not move at all."""
    rank = dist.get_rank()
    source = dict(actor.model.named_parameters()) if actor is not None else {}
    target = dict(engine.model.named_parameters()) if engine is not None else {}
    held = engine.model.expert_slices() if engine is not None and rollout == "ep" else {}
    trainer_experts = set(actor.model.expert_slices()) if trainer == "ep" else set()
    for name in names:
        if name in trainer_experts and rollout == "ep":  # both sides are EP over every rank
            target[name].copy_(source[name])
            continue
        if name in trainer_experts:
            parts = [torch.empty_like(source[name]) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, source[name])
            full = torch.cat(parts)
        elif trainer == "single" and rollout != "single":
            if rank == 0:
                full = source[name]
            elif name in held:  # this engine keeps a slice: the whole tensor lands in a buffer first
                full = target[name].new_empty((engine.model.config.num_experts, *target[name].shape[1:]))
            else:
                full = target[name]  # straight into the engine's storage
            dist.broadcast(full, src=0)
        else:
            full = source.get(name)
        if engine is not None and full is not None and full is not target[name]:
            target[name].copy_(full[held[name]] if name in held else full)
    if engine is not None:
        engine.weights_changed()


@torch.no_grad()
def trained_weights(actor: Actor | None, trainer: str, names: list[str],
                    flat: bool = False) -> tuple[str | None, torch.Tensor | None]:
    """On rank 0: the sha256 of the trained weights' bytes, in `names` order, each tensor in its own dtype
    (equal digests are bitwise equal weights), and with `flat` the weights flattened to FP32 (exact for
    BF16 and FP32); (None, None) on the other ranks. An ep trainer's experts are gathered from their owners.
    The hash reads each tensor once on the host, with no concatenated copy."""
    experts = set(actor.model.expert_slices()) if trainer == "ep" else set()
    params = dict(actor.model.named_parameters()) if actor is not None else {}
    rank0 = dist.get_rank() == 0
    sha, parts = hashlib.sha256(), []
    for name in names:
        tensor = params.get(name)
        if name in experts:
            gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, tensor)
            tensor = torch.cat(gathered)
        if rank0:
            host = tensor.detach().contiguous().cpu()
            sha.update(host.view(torch.uint8).numpy())
            if flat:
                parts.append(host.float().flatten())
    if not rank0:
        return None, None
    return sha.hexdigest(), (torch.cat(parts) if flat else None)


def worker(rank: int, world: int, device: str, mode: str, steps: int, prompts_per_step: int, port: int, queue,
           model: str = "dense", layouts: list[tuple[str, str]] | None = None, keep_weights: bool = False,
           progress: str | None = None):
    os.environ.update(NO_MULTICAST)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)
    # a collective that does not pair up fails after COLLECTIVE_TIMEOUT naming itself, rather than hang
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT,
                            device_id=torch.device("cuda", rank) if device == "cuda" else None)
    try:
        results = {}
        for rollout, trainer in layouts or pairings(model):
            results[f"rollout={rollout},trainer={trainer}"] = run_pairing(rollout, trainer, mode, device, steps,
                                                                          prompts_per_step, model=model,
                                                                          keep_weights=keep_weights,
                                                                          progress=progress)
        if rank == 0:
            queue.put(results)
        # nobody leaves while another rank still talks to it (gloo aborts a process whose peer vanished)
        dist.barrier()
    finally:
        # What reference cycles still hold is freed while the groups and the interpreter are whole, not during
        # the interpreter's exit, where one rank of the 4-process CPU test once aborted after every step had
        # passed ("terminate called without an active exception"). A guard: that abort did not recur in
        # reruns, so this is not a proven fix.
        gc.collect()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int = 2, device: str = "cpu", mode: str = "consistent", steps: int = 2,
        prompts_per_step: int = 4, port: int | None = None, model: str = "dense",
        layouts: list[tuple[str, str]] | None = None, keep_weights: bool = False,
        progress: str | None = None) -> dict:
    """Each (rollout, trainer) layout pair (default: every pairing for `model`) on `world` processes;
    returns the per-step reports of each (and appends them to `progress` as they end, see run_pairing)."""
    os.environ.update(NO_MULTICAST)
    port = port or free_port()
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    workers = torch.multiprocessing.start_processes(
        worker, args=(world, device, mode, steps, prompts_per_step, port, queue, model, layouts, keep_weights,
                      progress),
        nprocs=world, join=False, start_method="spawn")
    return collect(workers, queue)


def collect(workers, queue):
    """The result one worker puts on `queue`, then every worker joined. Read before the join completes
    (a put larger than the pipe waits for its reader); join raises a worker's error at once rather than
    leave this read waiting."""
    while True:
        try:
            results = queue.get(timeout=1)
            break
        except Empty:
            assert not workers.join(timeout=0), "the workers ended without results"
    while not workers.join():
        pass
    return results


def all_exact(results: dict) -> bool:
    return all(rank["exact"] for history in results.values() for step in history for rank in step["ranks"]
               if rank["trains"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--mode", default="consistent", choices=("consistent", "baseline"))
    p.add_argument("--model", default="dense", choices=tuple(LAYOUTS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    start = time.perf_counter()
    progress = None
    if args.out:  # each step as it ends, beside the final JSON: a run cut short keeps its finished steps
        progress = args.out + ".steps.jsonl"
        Path(progress).unlink(missing_ok=True)
    results = run(args.world, args.device, args.mode, args.steps, args.prompts_per_step, model=args.model,
                  progress=progress)
    record = {"command": "python -m onepath.train.distributed " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "world": args.world,
              "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "mode": args.mode,
              "model": args.model,
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
