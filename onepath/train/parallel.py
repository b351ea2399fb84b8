"""The RL loop on several processes (`torchrun --nproc-per-node N -m onepath train ...`): the process
group, the actors that split the trainer's state, the EP engines' lockstep generation and the weight
sync into the engines' storage. RunConfig.parallel picks the layouts (see config.ParallelSection).

A token's log-prob is computed by the same kernels on every rank, so every pairing of layouts keeps
diff = 0: the forward path only moves data (all-gather of fsdp shards, the experts' all-to-alls, a
broadcast of the weights) and never reduces across ranks; gradients are summed across ranks in the
backward. Each rank's loss is its rows' share of the step's token-mean (divided by all the step's
valid tokens), so the summed gradients are the step's, as on one process up to the summation order.
"""
from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.models.checkpoint import load_config
from onepath.models.config import MOE_MODEL_TYPES
from onepath.models.moe import split_experts
from onepath.models.tensor_parallel import check_tensor_parallel
from onepath.numerics.spec import ExecutionSpec
from onepath.train.actor import Actor

# NVLink multicast stays off, in this process and in every process it starts.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# a collective that does not pair up fails after this long, naming itself, rather than hang
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class World:
    """This process's place: rank of size, the layouts (on one process both are single), the rollout's
    TP degree, and how many processes train when the sides are disaggregated (0: colocated, every
    process has both sides; T > 0: ranks 0..T-1 train, the others roll out)."""
    rank: int = 0
    size: int = 1
    rollout: str = "single"
    trainer: str = "single"
    tp: int = 1
    trainers: int = 0

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def rollout_ranks(self) -> range:
        return range(self.trainers, self.size)

    @property
    def trainer_ranks(self) -> range:
        return range(self.trainers or self.size)

    @property
    def has_engine(self) -> bool:
        ranks = self.rollout_ranks
        return self.rank in ranks and (self.rollout != "single" or self.rank == ranks[0])

    @property
    def leads_rollout(self) -> bool:
        """Whether this rank's engine outputs are its rows' (every rank of a TP group holds the same ones)."""
        return self.has_engine and (self.rank - self.rollout_ranks.start) % self.tp == 0

    @property
    def trains(self) -> bool:
        return self.rank in self.trainer_ranks and (self.trainer != "single" or self.first)

    def rollout_share(self, count: int, group: int) -> list[int]:
        ranks = self.rollout_ranks
        if self.rollout == "single" or self.rank not in ranks:
            return list(range(count)) if self.rank == ranks[0] else []
        return self._share(count, group, (self.rank - ranks.start) // self.tp, len(ranks) // self.tp)

    def trainer_share(self, count: int, group: int) -> list[int]:
        if self.trainer == "single" or self.rank not in self.trainer_ranks:
            return list(range(count)) if self.first else []
        return self._share(count, group, self.rank, len(self.trainer_ranks))

    @staticmethod
    def _share(count: int, group: int, index: int, parts: int) -> list[int]:
        """Rows 0..count-1 in groups of `group` (a prompt's samples stay together), group g to part g % parts."""
        return [i for i in range(count) if (i // group) % parts == index]

    def groups(self) -> "Groups":
        """The process groups of this world, made once (every rank makes every group, in one order)."""
        if self not in _GROUPS:
            _GROUPS[self] = Groups.make(self)
        return _GROUPS[self]

    def gather(self, obj) -> list:
        """Every rank's obj, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


@dataclass(frozen=True)
class Groups:
    """trainer: the training ranks (None: every rank); tp: this rank's rollout TP group; sync: rank 0 and
    every engine rank, over which a broadcast brings the engines the weights (None: every rank)."""
    trainer: dist.ProcessGroup | None = None
    tp: dist.ProcessGroup | None = None
    sync: dist.ProcessGroup | None = None

    @classmethod
    def make(cls, world: World) -> "Groups":
        def group(ranks: list[int]):
            return None if len(ranks) == world.size else dist.new_group(ranks)

        trainer = group(list(world.trainer_ranks)) if world.size > 1 else None
        tp = None
        if world.rollout == "tp" and world.size > 1:
            ranks = world.rollout_ranks
            for start in range(ranks.start, ranks.stop, world.tp):
                made = group(list(range(start, start + world.tp)))
                if world.rank in range(start, start + world.tp):
                    tp = made
        engines = [r for r in range(world.size) if replace(world, rank=r).has_engine]
        sync = group(sorted({0, *engines})) if world.size > 1 else None
        return cls(trainer, tp, sync)


_GROUPS: dict[World, Groups] = {}


def start(device: str) -> tuple[int, int]:
    """(rank, world size) from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT), the process group started when there are several: gloo on the CPU, nccl on CUDA."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return 0, 1
    os.environ.update(NO_MULTICAST)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT,
                            device_id=torch.device("cuda", local) if device == "cuda" else None)
    return dist.get_rank(), dist.get_world_size()


def stop() -> None:
    if dist.is_initialized():
        gc.collect()  # what reference cycles hold is freed while the group is whole
        dist.barrier()  # nobody leaves while another rank still talks to it
        dist.destroy_process_group()


def world_for(cfg, rank: int, size: int) -> World:
    """The World of this run, or ValueError naming a layout the model or the run cannot take."""
    p = cfg.parallel
    if size == 1:
        return World()
    ep = [side for side in ("rollout", "trainer") if getattr(p, side) == "ep"]
    if ep:
        model = load_config(cfg.model.path) if cfg.model.path else cfg.model
        experts = model.num_experts if model.model_type in MOE_MODEL_TYPES else 0
        if not experts:
            raise ValueError(f"parallel.{ep[0]} = 'ep' splits the experts, but the model ({model.model_type}) is "
                             "dense: use parallel.rollout dp / parallel.trainer fsdp")
        if experts % size:
            raise ValueError(f"parallel.{ep[0]} = 'ep' on {size} processes: {experts} experts do not split evenly; "
                             f"run a number of processes that divides {experts}")
    if cfg.rollout.env is not None and (p.rollout, p.trainer, p.rollout_processes) != ("single", "single", 0):
        raise ValueError(f"rollout.env = {cfg.rollout.env!r} runs its episodes on one process: use parallel.rollout "
                         "single and parallel.trainer single, or no env")
    if p.rollout_processes >= size:
        raise ValueError(f"parallel.rollout_processes = {p.rollout_processes} on {size} processes leaves none to "
                         f"train: use at most {size - 1}, or 0 to colocate the sides")
    rollout_ranks = p.rollout_processes or size
    trainer_ranks = size - p.rollout_processes
    tp = 1
    if p.rollout == "tp":
        tp = p.tp or rollout_ranks
        if tp < 2 or rollout_ranks % tp:
            raise ValueError(f"parallel.rollout = 'tp' with parallel.tp = {tp} on {rollout_ranks} rollout processes: "
                             "the TP degree must be >= 2 and divide them; set parallel.tp")
        model = load_config(cfg.model.path) if cfg.model.path else cfg.model.architecture()
        for mode in ("consistent", "baseline") if cfg.mode == "both" else (cfg.mode,):
            check_tensor_parallel(model, ExecutionSpec.default(mode, cfg.device, quant=cfg.quant), tp)
    if p.trainer == "ep":
        if cfg.train.prompts_per_step < size:
            raise ValueError(f"parallel.trainer = 'ep' on {size} processes needs a prompt per rank: raise "
                             f"train.prompts_per_step (= {cfg.train.prompts_per_step}) to at least {size}")
        if cfg.train.micro_batch_tokens:
            raise ValueError("parallel.trainer = 'ep' runs one forward per rank and step (the all-to-alls pair up): "
                             f"set train.micro_batch_tokens (= {cfg.train.micro_batch_tokens}) to null")
    if p.trainer == "fsdp" and trainer_ranks == 1:
        raise ValueError("parallel.trainer = 'fsdp' on one training process: use parallel.trainer single, or "
                         "lower parallel.rollout_processes")
    return World(rank, size, p.rollout, p.trainer, tp, trainer_ranks if p.rollout_processes else 0)


def shard_of(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank's contiguous 1/size of the flattened tensor, the last shard zero-padded."""
    flat = full.detach().flatten()
    n = -(-flat.numel() // size)
    padded = torch.cat([flat, flat.new_zeros(n * size - flat.numel())])
    return padded[rank * n:(rank + 1) * n].clone()


def all_gathered(tensor: torch.Tensor, size: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's `tensor` (of `group`'s `size` ranks), concatenated along dim 0 in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts)


def scaled_to_norm(trained: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The gradients scaled as clip_grad_norm_ scales them, by the whole gradient's `norm`; returns it."""
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for t in trained:
        t.grad.mul_(scale.to(t.grad.dtype))
    return norm


class ShardedActor(Actor):
    """fsdp: the optimizer owns this rank's flat shard of every parameter (in the master dtype when
    set) and its AdamW state; the full weights are all-gathered into the model after each step."""

    def __init__(self, model, block_size: int, *args, master_dtype: torch.dtype | None = None,
                 group: dist.ProcessGroup | None = None, **kwargs):
        super().__init__(model, block_size, *args, **kwargs)
        self.group = group  # the training ranks (None: every rank)
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.shapes = {name: p.shape for name, p in model.named_parameters()}
        self.trained = {name: torch.nn.Parameter(shard_of(p.to(master_dtype or p.dtype), self.rank, self.size))
                        for name, p in model.named_parameters()}
        self.sharded_master = master_dtype is not None and any(p.dtype != master_dtype for p in model.parameters())
        self.optimizer, self.schedule = self.make_optimizer(list(self.trained.values()))

    def reduce_gradients(self) -> None:
        pass  # the full gradients are summed in gradients_onto_trained, then sharded

    def gradients_onto_trained(self) -> list[torch.Tensor]:
        for name, p in self.model.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = None
            dist.all_reduce(grad, group=self.group)
            self.trained[name].grad = shard_of(grad.to(self.trained[name].dtype), self.rank, self.size)
        return list(self.trained.values())

    def clip(self, trained: list[torch.Tensor]) -> torch.Tensor:
        # the norm of the whole gradient: the shards' squares summed over the ranks (the padding is 0)
        squares = torch.stack([t.grad.float().square().sum() for t in trained]).sum()
        dist.all_reduce(squares, group=self.group)
        return scaled_to_norm(trained, squares.sqrt(), self.max_grad_norm)

    @torch.no_grad()
    def publish(self) -> None:
        for name, p in self.model.named_parameters():
            p.copy_(self.to_full(name, self.trained[name]))

    def to_full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        shape = self.shapes[name]
        return all_gathered(tensor, self.size, self.group)[:shape.numel()].view(shape)

    def to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return shard_of(full, self.rank, self.size)

    @property
    def has_master(self) -> bool:
        return self.sharded_master

    def master_state(self) -> dict[str, torch.Tensor] | None:
        if not self.sharded_master:
            return None
        return {name: self.to_full(name, t).cpu() for name, t in self.trained.items()}


class ExpertParallelActor(Actor):
    """ep: every rank holds the replicated weights and its slice of the experts, and trains on its
    share of the rows. Replicated gradients are summed over the ranks; an expert's gradient already
    sums every rank's tokens on its owner (the all-to-all's backward)."""

    def __init__(self, model, block_size: int, *args, **kwargs):
        super().__init__(model.expert_parallel(), block_size, *args, **kwargs)
        self.size = dist.get_world_size()
        self.experts = model.expert_slices()

    def reduce_gradients(self) -> None:
        for name, p in self.model.named_parameters():
            if p.grad is None:  # no token reached these experts: a zero gradient, and the all-reduces pair up
                p.grad = torch.zeros_like(p)
            if name not in self.experts:
                dist.all_reduce(p.grad)

    def clip(self, trained: list[torch.Tensor]) -> torch.Tensor:
        # replicated squares once, expert squares from every owner
        squares = [t.grad.float().square().sum() for t in trained]
        replicated = sum(s for name, s in zip(self.names, squares) if name not in self.experts)
        experts = torch.stack([s for name, s in zip(self.names, squares) if name in self.experts]).sum()
        dist.all_reduce(experts)
        return scaled_to_norm(trained, (replicated + experts).sqrt(), self.max_grad_norm)

    def to_full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return all_gathered(tensor, self.size) if name in self.experts else tensor

    def to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full[self.experts[name]] if name in self.experts else full

    def full_weights(self) -> dict[str, torch.Tensor]:
        state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        for name, p in self.model.named_parameters():
            if name in self.experts:
                state[name] = self.to_full(name, p).cpu()
        return split_experts(state)


ACTORS = {"single": Actor, "fsdp": ShardedActor, "ep": ExpertParallelActor}


def actor_for(world: World, model, *args, **kwargs) -> Actor:
    """The trainer layout's actor over `model`; fsdp shards over the training ranks."""
    if world.trainer == "fsdp":
        kwargs["group"] = world.groups().trainer
    return ACTORS[world.trainer](model, *args, **kwargs)


def tensor_parallel_engine_model(model, world: World, settings: dict) -> None:
    """Shard an engine's model over this rank's TP group, in place. Every rank of the group must run the
    same steps: its KV cache gets the group's smallest block count (CUDA sizes it from each device's free
    memory), and its steps run eagerly (collectives inside CUDA graphs are not yet proved here)."""
    group = world.groups().tp
    model.tensor_parallel(group)
    settings["cuda_graphs"] = False
    if settings.get("num_blocks") is None and model.device.type == "cuda":
        from onepath.engine import memory
        blocks = memory.kv_blocks_for(model, settings["scheduler"], settings["block_size"],
                                      settings["gpu_memory_utilization"])
        fewest = torch.tensor([blocks], device=model.device)
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=group)
        settings["num_blocks"] = int(fewest)


def generate_in_lockstep(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                         request_ids: list[int]) -> list:
    """LLMEngine.generate for engines whose model is expert-parallel over every rank. Each sparse
    layer's all-to-alls pair up only if every rank runs the same number of forwards, so the engines
    step together: before each step the ranks agree whether any of them has work left, a rank with
    work runs one engine step (one forward), and a rank without runs the sparse layers on zero tokens
    (MoeDecoder.serve_experts), its experts serving the others' rows."""
    params = params if isinstance(params, list) else [params] * len(prompts)
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
def sync_weights(engine: LLMEngine | None, actor: Actor | None, world: World, names: list[str]) -> None:
    """New weights into every engine's existing storage, in place. Every rank walks the same `names`,
    so the collectives pair up. Full weights come from the trainer: on every training rank after an fsdp
    all-gather (and for the replicated weights of an ep trainer), by an all-gather of the owners' slices
    for the experts of an ep trainer, and by a broadcast from rank 0 over the sync group when an engine
    rank holds no full weights of its own (rank 0 alone trains, or the sides are disaggregated). An ep
    engine keeps its slice of the experts, a tp engine its shards (models/tensor_parallel.py); between an
    ep trainer and an ep engine (the same slices) the experts do not move at all."""
    if world.size == 1:
        engine.update_weights(actor.model.named_parameters())
        return
    source = dict(actor.model.named_parameters()) if actor is not None else {}
    target = dict(engine.model.named_parameters()) if engine is not None else {}
    held = engine.model.expert_slices() if engine is not None and world.rollout == "ep" else {}
    tp = engine.model.tp if engine is not None else None
    trainer_experts = set(actor.model.expert_slices()) if world.trainer == "ep" else set()
    # the ranks that hold full weights after the step: rank 0, or every training rank of fsdp / ep
    full_holders = set(world.trainer_ranks) if world.trainer != "single" else {0}
    engines = {r for r in range(world.size) if replace(world, rank=r).has_engine}
    broadcast = not engines <= full_holders
    in_sync = world.first or world.has_engine
    group = world.groups().sync
    for name in names:
        if name in trainer_experts and world.rollout == "ep":  # both sides are EP over every rank
            target[name].copy_(source[name])
            continue
        full = all_gathered(source[name], world.size) if name in trainer_experts else source.get(name)
        if broadcast and in_sync:
            if not world.first:
                full = receiving_buffer(engine, name, target[name], held, tp)
            dist.broadcast(full, src=0, group=group)
        if engine is None or full is None or full is target[name]:
            continue
        if tp is not None and name in tp.copies:
            tp.write(name, full)
        else:
            target[name].copy_(full[held[name]] if name in held else full)
    if engine is not None:
        engine.weights_changed()


def receiving_buffer(engine: LLMEngine, name: str, storage: torch.Tensor, held: dict, tp) -> torch.Tensor:
    """Where an engine rank receives the full weight `name`: straight into its storage, or a buffer of the
    full shape when it keeps a slice (ep) or shards (tp) of it."""
    if name in held:
        return storage.new_empty((engine.model.config.num_experts, *storage.shape[1:]))
    if tp is not None and name in tp.shapes:
        return storage.new_empty(tp.shapes[name])
    return storage
