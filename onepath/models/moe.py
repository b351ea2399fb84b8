"""Mixture-of-experts decoder of the Qwen3-MoE / Qwen2-MoE family, written once against `ops`.

Attention, norms and embeddings are dense.py's; a sparse layer's MLP is a SparseMoeBlock with
transformers' parameter names. Each step keeps a token's bits independent of its batch, the phase,
the expert layout (contiguous for the trainer and prefill, masked for decode) and the EP degree:
routing in FP32 with ties to the larger expert, expert outputs in FP32, combined on the token in slot
order and rounded once. So the trainer recomputes the rollout's routing (no routing replay). The
design, layout by layout: docs/models.md.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from onepath.models.batch import ForwardBatch
from onepath.models.config import ModelConfig
from onepath.models.dense import MLP, DenseDecoder, Linear
from onepath.models.kv_cache import BLOCK_SIZE
from onepath.ops import Ops

CAPACITY = 16           # rows per expert chunk of the masked layout
MASKED_MAX_TOKENS = 64  # forwards of at most this many tokens (decode steps) run the masked layout
LAYOUTS = ("contiguous", "masked")


def slot_sum(x: torch.Tensor) -> torch.Tensor:
    """x[:, 0] + x[:, 1] + ... in slot order: elementwise adds, no reduction kernel to pick an order."""
    acc = x[:, 0]
    for j in range(1, x.shape[1]):
        acc = acc + x[:, j]
    return acc


def dispatch(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of experts [T, k], flattened, in the order that packs them by expert
    (token order inside an expert), and each expert's number of pairs, on experts' device: counted by
    scatter_add, not bincount, whose output size needs the largest id on the host (a sync per layer)."""
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return torch.argsort(flat, stable=True), counts


def unpermute(packed: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return packed.index_select(0, inverse)


def experts_contiguous(mlp: Callable, x: torch.Tensor, experts: torch.Tensor, num_experts: int,
                       grouped: Callable | None = None) -> torch.Tensor:
    """Expert outputs [T, k, H] of each token's k experts, the pairs packed by expert, mlp(e, rows)
    once per expert over its rows; or grouped(rows, counts) once over all of them, the counts left on
    the device (no host sync)."""
    t, k = experts.shape
    order, counts = dispatch(experts, num_experts)
    rows = x.index_select(0, order // k)
    if grouped is not None:
        packed = grouped(rows, counts)
    else:
        packed = torch.cat([mlp(e, part) for e, part in enumerate(rows.split(counts.tolist())) if part.shape[0]])
    return unpermute(packed, order).view(t, k, -1)


def max_chunks(pairs: int, num_experts: int, capacity: int) -> int:
    """The most fixed-capacity chunks `pairs` (token, slot) pairs can fill: one pair in each of
    min(num_experts, pairs) experts, the rest in whole chunks. A function of the batch size only."""
    spread = min(num_experts, pairs)
    return spread + (pairs - spread) // capacity


def experts_masked(mlp: Callable, x: torch.Tensor, experts: torch.Tensor, num_experts: int,
                   capacity: int = CAPACITY, grouped: Callable | None = None) -> torch.Tensor:
    """Expert outputs [T, k, H] as experts_contiguous's, from a buffer of fixed-capacity chunks: an
    expert with n pairs owns ceil(n / capacity) chunks, zero rows fill the last, and mlp(e, chunk)
    runs over all `capacity` rows of each chunk; or grouped(buffer, rows per expert) once, the counts
    left on the device (no host sync). The buffer holds max_chunks chunks whatever the routing, so its
    shape is a function of T (a CUDA graph replays it under any routing); its unused tail is never run
    by mlp and never read back from grouped, which may leave those rows unwritten."""
    t, k = experts.shape
    order, counts = dispatch(experts, num_experts)
    chunk_counts = (counts + capacity - 1) // capacity
    exclusive = lambda values: torch.cumsum(values, 0) - values
    first_pair = exclusive(counts)
    first_row = exclusive(chunk_counts) * capacity
    owner = experts.reshape(-1)[order]
    # the buffer row of each packed pair: its expert's first row plus its rank among the expert's pairs
    row = first_row[owner] + torch.arange(order.numel(), device=x.device) - first_pair[owner]
    rows = max_chunks(order.numel(), num_experts, capacity) * capacity
    buffer = x.new_zeros(rows, x.shape[-1]).index_copy(0, row, x.index_select(0, order // k))
    if grouped is not None:
        out = grouped(buffer, chunk_counts * capacity)
    else:
        chunks = chunk_counts.tolist()  # the per-chunk loop needs its chunks' owners on the host
        owners = [e for e, n in enumerate(chunks) for _ in range(n)]
        out = torch.cat([mlp(e, chunk) for e, chunk in zip(owners, buffer.split(capacity))])
    return unpermute(out.index_select(0, row), order).view(t, k, -1)


@dataclass(frozen=True)
class ExpertParallel:
    """An EP group: this rank is `rank` of `size` and owns experts `local`, a contiguous range of
    num_experts / size."""
    group: dist.ProcessGroup | None
    rank: int
    size: int
    num_experts: int

    @classmethod
    def over(cls, num_experts: int, group: dist.ProcessGroup | None = None) -> "ExpertParallel":
        size = dist.get_world_size(group)
        if num_experts % size:
            raise ValueError(f"num_experts {num_experts} is not a multiple of the EP degree {size}: "
                             "use an EP group whose size divides the number of experts")
        return cls(group, dist.get_rank(group), size, num_experts)

    @property
    def local(self) -> range:
        n = self.num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)


class AllToAll(torch.autograd.Function):
    """Rows [in_splits[r] for each rank r] out, [out_splits[r]] in; the gradient goes back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def experts_parallel(run: Callable, x: torch.Tensor, experts: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """Expert outputs [T, k, H] FP32 of this rank's tokens, each (token, slot) row computed by its
    expert's owner: run(rows, row_experts [N, 1]) -> [N, 1, H] over the rows this rank receives.
    Every rank of the group must call it at each sparse layer, with or without tokens."""
    t, k = experts.shape
    order, counts = dispatch(experts, ep.num_experts)  # packed by expert, so by owner too
    send = counts.view(ep.size, -1)  # [owner, its local expert]
    recv = torch.empty_like(send)  # [source rank, my local expert]
    dist.all_to_all_single(recv, send, group=ep.group)
    in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    rows = AllToAll.apply(x.index_select(0, order // k), out_splits, in_splits, ep.group)
    owned = torch.tensor(list(ep.local) * ep.size, device=x.device).repeat_interleave(recv.flatten())
    y = run(rows, owned[:, None])[:, 0]
    back = AllToAll.apply(y, in_splits, out_splits, ep.group)
    return unpermute(back, order).view(t, k, x.shape[-1])


class Router(nn.Module):
    """mlp.gate: x -> (weights [T, k] FP32, experts [T, k]), slots in descending probability."""

    def __init__(self, ops: Ops, config: ModelConfig, dtype):
        super().__init__()
        self.ops = ops
        self.k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=dtype))

    def forward(self, x):
        probs = self.ops.softmax(self.ops.router(x, self.weight))
        # top-k selection is not differentiable; the gradient flows through the selected probabilities
        weights, experts = self.ops.topk(probs, self.k)
        if self.normalize:
            weights = weights / slot_sum(weights).unsqueeze(-1)
        return weights, experts


class Experts(nn.Module):
    """mlp.experts: every expert's SwiGLU MLP, stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, ops: Ops, config: ModelConfig, dtype):
        super().__init__()
        self.ops, self.num_experts = ops, config.num_experts
        self.limit = getattr(config, "swiglu_limit", None)  # DeepSeek-V4 clamps gate and up (ops.silu_mul)
        self.first = 0  # the global index of gate_up_proj[0]: its EP rank's first expert
        self.tp = None  # a tensor-parallel model's TensorParallel: this rank holds its SwiGLU columns
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=dtype))

    def mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert `expert` on rows [n, H] -> [n, H] FP32."""
        gate, up = self.ops.linear(rows, self.gate_up_proj[expert - self.first]).chunk(2, dim=-1)
        down = self.down_proj[expert - self.first]
        return self.down(lambda h: self.ops.expert_down(h, down), self.ops.silu_mul(gate, up, self.limit))

    def grouped_mlp(self, rows: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """Every expert on its rows of rows [n, H], packed by expert (counts[e] rows of global expert
        e, all of them this rank's) -> [n, H] FP32: one grouped GEMM per projection."""
        local = counts[self.first:self.first + self.gate_up_proj.shape[0]]
        gate, up = self.ops.grouped_linear(rows, self.gate_up_proj, local).chunk(2, dim=-1)
        return self.down(lambda h: self.ops.grouped_expert_down(h, self.down_proj, local),
                         self.ops.silu_mul(gate, up, self.limit))

    def down(self, gemm, h: torch.Tensor) -> torch.Tensor:
        """The down projection gemm(h); tensor-parallel (models/tensor_parallel.py): h is the rank's SwiGLU columns."""
        return gemm(h) if self.tp is None else self.tp.row_parallel(lambda x, _: gemm(x), h, self.k, self.n)

    @property
    def counts_on_device(self) -> bool:
        """Whether both projections are grouped launches that read the expert counts on the device: then
        a forward makes no host sync and its shapes follow T only (a CUDA graph can hold it)."""
        return all(self.ops.grouped_on_device(w) for w in (self.gate_up_proj, self.down_proj))

    def keep(self, local: range) -> None:
        """Drop every expert outside `local` (an EP rank's own)."""
        picked = slice(local.start - self.first, local.stop - self.first)
        self.gate_up_proj = nn.Parameter(self.gate_up_proj.detach()[picked].clone())
        self.down_proj = nn.Parameter(self.down_proj.detach()[picked].clone())
        self.first = local.start

    def forward(self, x, experts, layout: str = "contiguous", capacity: int = CAPACITY):
        """FP32 outputs [T, k, H] of each token's experts."""
        if x.shape[0] == 0:
            return x.new_zeros(0, experts.shape[-1], x.shape[-1], dtype=torch.float32)
        grouped = self.grouped_mlp if self.ops.grouped_experts else None
        if layout == "masked":
            return experts_masked(self.mlp, x, experts, self.num_experts, capacity, grouped)
        if layout == "contiguous":
            return experts_contiguous(self.mlp, x, experts, self.num_experts, grouped)
        raise ValueError(f"expert layout {layout!r} is unknown: use one of {LAYOUTS}")


class SparseMoeBlock(nn.Module):
    def __init__(self, ops: Ops, config: ModelConfig, dtype):
        super().__init__()
        self.ops = ops
        self.gate = Router(ops, config, dtype)
        self.experts = Experts(ops, config, dtype)
        if config.shared_expert_intermediate_size:
            shared = replace(config, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert = MLP(ops, shared, dtype)
            self.shared_expert_gate = Linear(ops, config.hidden_size, 1, False, dtype)
        self.capacity, self.masked_max_tokens = CAPACITY, MASKED_MAX_TOKENS
        self.layout: str | None = None  # None: masked up to masked_max_tokens tokens, else contiguous
        self.ep: ExpertParallel | None = None

    def expert_parallel(self, ep: ExpertParallel) -> None:
        self.experts.keep(ep.local)
        self.ep = ep

    def forward(self, x):
        weights, experts = self.gate(x)
        layout = self.layout or ("masked" if x.shape[0] <= self.masked_max_tokens else "contiguous")
        run = lambda rows, chosen: self.experts(rows, chosen, layout, self.capacity)
        y = run(x, experts) if self.ep is None else experts_parallel(run, x, experts, self.ep)
        out = slot_sum(weights.unsqueeze(-1) * y)
        if hasattr(self, "shared_expert"):
            se = self.shared_expert
            # the shared MLP's own forward would round its output; it joins the FP32 sum unrounded
            shared = se.down_proj.expert_down(self.ops.silu_mul(se.gate_proj(x), se.up_proj(x)))
            out = out + self.ops.sigmoid(self.shared_expert_gate(x)) * shared
        return out.to(x.dtype)


class MoeDecoder(DenseDecoder):
    """DenseDecoder whose sparse layers (config.is_sparse_layer) carry a SparseMoeBlock as their MLP."""

    @property
    def capturable(self) -> bool:
        """Whether decode steps may run in CUDA graphs: every sparse layer's experts read their counts on
        the device (grouped launches, quantised or not; on the CPU, loops read them on the host) and none
        is expert-parallel (its all-to-alls take their split sizes on the host)."""
        return all(m.ep is None and m.experts.counts_on_device for m in self.modules() if isinstance(m, SparseMoeBlock))

    def __init__(self, config: ModelConfig, ops: Ops, max_positions: int | None = None):
        if not config.is_moe:
            raise ValueError(f"model_type {config.model_type!r} is dense: build it with DenseDecoder")
        super().__init__(config, ops, max_positions)

    def make_mlp(self, layer: int) -> nn.Module:
        if self.config.is_sparse_layer(layer):
            return SparseMoeBlock(self.ops, self.config, self.ops.spec.dtype)
        return MLP(self.ops, self.config, self.ops.spec.dtype)

    def expert_parallel(self, group: dist.ProcessGroup | None = None) -> "MoeDecoder":
        """Keep only this rank's experts of `group` (None: every process) in each sparse layer and run
        them expert-parallel. Call it after the weights are loaded; the model then holds a slice."""
        ep = ExpertParallel.over(self.config.num_experts, group)
        for m in self.modules():
            if isinstance(m, SparseMoeBlock):
                m.expert_parallel(ep)
        return self

    @torch.no_grad()
    def serve_experts(self) -> None:
        """Each sparse layer on zero tokens, in layer order: an EP rank with no forward of its own runs
        this while the others run theirs, so every all-to-all pairs up and its experts serve their rows.
        Attention and the dense layers talk to no other rank and are skipped."""
        x = torch.zeros(0, self.config.hidden_size, dtype=self.ops.spec.dtype, device=self.device)
        for m in self.modules():
            if isinstance(m, SparseMoeBlock):
                m(x)

    def expert_slices(self) -> dict[str, slice]:
        """The global experts each expert weight (mlp.experts.gate_up_proj, .down_proj) holds along its
        first dimension: all of them, or after expert_parallel() this rank's own."""
        slices = {}
        for name, m in self.named_modules():
            if isinstance(m, Experts):
                for weight in ("gate_up_proj", "down_proj"):
                    slices[f"{name}.{weight}"] = slice(m.first, m.first + getattr(m, weight).shape[0])
        return slices

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """From the hub layout (mlp.experts.{i}.gate_proj.weight, ...) or the fused one
        (mlp.experts.gate_up_proj, as transformers 5 holds it in memory and our state_dict names it)."""
        super().load_hf_state_dict(fuse_experts(state))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The hub layout: a gate/up/down projection per expert, as the published Qwen3-MoE checkpoints
        and transformers' save_pretrained write it (from_pretrained fuses it on load)."""
        if any(m.ep for m in self.modules() if isinstance(m, SparseMoeBlock)):
            raise ValueError("this model is expert-parallel and holds only its rank's experts: "
                             "write checkpoints from a model without expert_parallel()")
        return split_experts(super().hf_state_dict())


EXPERT_KEY = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, groups = {}, {}
    for name, tensor in state.items():
        m = EXPERT_KEY.fullmatch(name)
        if m:
            groups.setdefault(m[1], {})[int(m[2]), m[3]] = tensor
        else:
            out[name] = tensor
    for prefix, parts in groups.items():
        n = 1 + max(i for i, _ in parts)
        missing = [f"{prefix}.{i}.{p}.weight" for i in range(n) for p in PROJECTIONS if (i, p) not in parts]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} expert tensors, first {missing[:3]}: "
                             "every expert needs gate_proj, up_proj and down_proj")
        stacked = {p: torch.stack([parts[i, p] for i in range(n)]) for p in PROJECTIONS}
        out[f"{prefix}.gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1)
        out[f"{prefix}.down_proj"] = stacked["down_proj"]
    return out


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            gate, up = tensor.chunk(2, dim=1)
            for i in range(tensor.shape[0]):
                out[f"{prefix}.{i}.gate_proj.weight"] = gate[i].clone()
                out[f"{prefix}.{i}.up_proj.weight"] = up[i].clone()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for i in range(tensor.shape[0]):
                out[f"{prefix}.{i}.down_proj.weight"] = tensor[i].clone()
        else:
            out[name] = tensor
    return out


class RoutingRecorder:
    """Records what every Router of `model` chose in the forwards run inside the `with`: after each
    forward, take() gives the experts [rows, sparse layers, k] of that forward's rows."""

    def __init__(self, model: nn.Module):
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.choices: list[torch.Tensor] = []
        self.hooks = []

    def __enter__(self) -> "RoutingRecorder":
        self.choices = []
        self.hooks = [r.register_forward_hook(lambda _m, _x, out: self.choices.append(out[1].detach()))
                      for r in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()

    def take(self) -> torch.Tensor:
        """The last forward's experts [T, sparse layers, k] on the CPU; the record starts afresh."""
        if len(self.choices) != len(self.routers):
            raise RuntimeError(f"recorded {len(self.choices)} router calls for {len(self.routers)} routers: "
                               "take() once after each forward")
        out = torch.stack(self.choices, 1).cpu()
        self.choices = []
        return out


def expert_choices(model: MoeDecoder, sequences: list[list[int]], block_size: int = BLOCK_SIZE) -> list[torch.Tensor]:
    """Each sparse layer's experts [T, k] for the tokens of `sequences`, run whole in one forward."""
    batch, num_blocks = ForwardBatch.for_sequences(sequences, block_size, model.device)
    cache = model.make_cache(num_blocks, block_size)
    with RoutingRecorder(model) as recorder, torch.no_grad():
        model(batch, cache)
        return list(recorder.take().unbind(1))


def routing_agreement(rollout: list[torch.Tensor | None], trainer: list[torch.Tensor]) -> dict[str, float]:
    """Per sequence, the engine's experts [positions, layers, k] (-1 where it computed none: prefix-cache
    hits) and the trainer's for the same positions: the share of compared tokens whose every sparse
    layer chose the same experts in the same slots (no routing replay: 1.0, exactly)."""
    same = compared = 0
    for engine, train in zip(rollout, trainer):
        if engine is None:
            continue
        if engine.shape != train.shape:
            raise ValueError(f"rollout routing {tuple(engine.shape)} and trainer routing {tuple(train.shape)} "
                             "cover other positions: record both over prompt + completion[:-1]")
        seen = (engine >= 0).all(-1).all(-1)
        compared += int(seen.sum())
        same += int(((engine == train).all(-1).all(-1) & seen).sum())
    return {"moe/routing_agreement": same / compared if compared else 1.0, "moe/routing_compared_tokens": compared}


def routing_changes(before: MoeDecoder, after: MoeDecoder, sequences: list[list[int]],
                    block_size: int = BLOCK_SIZE) -> dict[str, float]:
    """How many tokens choose another expert set (slot order ignored) under `after`'s weights than
    under `before`'s: the diagnostic of how far an update moves routing (a step of several updates
    samples with the first weights and trains the later ones on other experts)."""
    pairs = zip(expert_choices(before, sequences, block_size), expert_choices(after, sequences, block_size))
    per_layer = [(a.sort(-1).values != b.sort(-1).values).any(-1) for a, b in pairs]
    tokens = sum(map(len, sequences))
    moved = torch.stack(per_layer) if per_layer else torch.zeros(0, tokens, dtype=torch.bool)  # [layers, T]
    changed = int(moved.any(0).sum())
    return {"moe/tokens": tokens, "moe/routing_changed_tokens": changed,
            "moe/routing_changed_frac": changed / max(tokens, 1),
            "moe/routing_changed_token_layers_frac": float(moved.float().mean()) if moved.numel() else 0.0}
