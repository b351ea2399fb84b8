"""Tensor parallelism whose result does not depend on the TP degree (docs/tensor_parallel.md).

Every sharded linear is column-parallel: each rank runs the full-K GEMM for its own output columns
and never sums a partial product. Where Megatron's layout has a row-parallel layer (o_proj, an MLP's
down projection, an expert's down projection), the consistent path all-gathers that layer's input
(the heads' outputs, the SwiGLU product), runs the GEMM over the full K for its share of the output
columns and all-gathers the outputs. A column's bits are then the one-device GEMM's: its reduction is
the TP=1 kernel's own K order (on CUDA one ascending chain of 128-wide K blocks per output element in
every tile; on the CPU the library GEMM at a fixed row chunk, whose column bits do not depend on the
launch's width from MIN_CPU_COLUMNS columns on), and the collectives only move data. The baseline
path is the stock one: the row-parallel layer takes a K shard and all-reduces the partial sums, whose
order and rounding follow the TP degree.

Attention runs on the rank's heads (its KV cache holds their K/V only); a rank whose query heads share
one KV head holds a copy of it when the TP degree exceeds the KV heads. The embedding, norms and
routers are replicated, the LM head is column-parallel over the vocabulary (logits all-gathered, so
every rank samples the same tokens from the same keys). The swap is in place on a loaded model and
keeps Hugging Face's parameter names; `write` puts a full weight into the rank's storage, in place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from onepath.models.config import ModelConfig
from onepath.numerics.spec import ExecutionSpec

REDUCTIONS = ("gather", "all_reduce")
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the former from torch 2.13
# torch's CPU FP32 GEMM takes another kernel below 12 output columns, whose bits differ from the wide
# one's (tests/models/test_tensor_parallel.py): a CPU shard is never narrower than this
MIN_CPU_COLUMNS = 16
TP_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe")


@dataclass
class TensorParallel:
    """A TP group: this rank is `rank` of `size`. reduce: "gather" (consistent: the TP=1 bits) or
    "all_reduce" (baseline: partial sums of K shards, summed across ranks)."""
    group: dist.ProcessGroup | None
    rank: int
    size: int
    reduce: str = "gather"
    min_columns: int = 1
    # full parameter name -> [(module, attribute, full -> its local part)], filled by tensor_parallel(); the
    # tensor is looked up at each write (the engine later makes stacked layers' weights views of one tensor)
    copies: dict[str, list[tuple[nn.Module, str, Callable]]] = field(default_factory=dict)
    shapes: dict[str, torch.Size] = field(default_factory=dict)
    kv_heads: int = 0  # the KV heads this rank's cache holds

    @classmethod
    def over(cls, group: dist.ProcessGroup | None, spec: ExecutionSpec) -> "TensorParallel":
        return cls(group, dist.get_rank(group), dist.get_world_size(group),
                   "gather" if spec.mode == "consistent" else "all_reduce",
                   MIN_CPU_COLUMNS if spec.device == "cpu" else 1)

    def width(self, n: int) -> int:
        """Columns per rank of an n-column output split with padding: ceil(n / size), at least min_columns."""
        return max(-(-n // self.size), self.min_columns)

    def rows(self, n: int) -> list[int]:
        """This rank's rows of an n-row weight split with padding; -1 for a zero row past n."""
        w = self.width(n)
        return [i if i < n else -1 for i in range(self.rank * w, (self.rank + 1) * w)]

    def gather(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """Every rank's x [..., w] side by side in rank order, cut to n columns: [..., n]. Moves data only."""
        lead, w = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, w).contiguous()
        out = flat.new_empty(self.size * flat.shape[0], w)
        ALL_GATHER(out, flat, group=self.group)
        out = out.view(self.size, flat.shape[0], w).transpose(0, 1).reshape(*lead, self.size * w)
        return out[..., :n]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def row_parallel(self, gemm: Callable, x: torch.Tensor, k: int, n: int, bias: torch.Tensor | None = None):
        """A row-parallel layer on x [..., k / size] (this rank's columns of the input), gemm(x, bias) the
        rank's GEMM: gather: over the gathered input [..., k] for this rank's output columns (its shard of
        the bias), gathered to [..., n]; all_reduce: on the local K shard, summed over the ranks, then
        the whole bias."""
        if self.reduce == "gather":
            return self.gather(gemm(self.gather(x, k), bias), n)
        out = self.all_reduce(gemm(x, None))
        return out if bias is None else out + bias.to(out.dtype)

    def take(self, name: str, holder: nn.Module, attr: str, full_shape: torch.Size, dim: int, rows: list[int]):
        """Replace holder.attr (a full parameter) by its rows `rows` along dim (-1: zero), recorded in copies."""
        index = torch.tensor(rows)

        def local(full: torch.Tensor) -> torch.Tensor:
            idx = index.to(full.device)
            part = full.index_select(dim, idx.clamp(min=0))
            keep = (idx >= 0).view(*[-1 if d == dim else 1 for d in range(full.dim())])
            return torch.where(keep, part, torch.zeros((), dtype=full.dtype, device=full.device))

        old = getattr(holder, attr)
        if isinstance(old, nn.Parameter):
            setattr(holder, attr, nn.Parameter(local(old.detach()), requires_grad=old.requires_grad))
        else:  # a buffer
            setattr(holder, attr, local(old))
        self.shapes[name] = full_shape
        self.copies.setdefault(name, []).append((holder, attr, local))

    @torch.no_grad()
    def write(self, name: str, full: torch.Tensor) -> None:
        """The full weight `name` into every tensor of this rank that holds a part of it (copies), in place."""
        for holder, attr, local in self.copies[name]:
            getattr(holder, attr).copy_(local(full))


def spans(start: int, stop: int) -> list[int]:
    return list(range(start, stop))


def check_tensor_parallel(config: ModelConfig, spec: ExecutionSpec, size: int) -> None:
    """ValueError naming what keeps `size`-way TP from the TP=1 bits for this model and spec, and what to do."""
    if config.model_type not in TP_MODEL_TYPES:
        raise ValueError(f"parallel.rollout = 'tp' is implemented for {', '.join(TP_MODEL_TYPES)}, not "
                         f"{config.model_type}: use parallel.rollout dp or ep")
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if hq % size:
        raise ValueError(f"parallel.tp = {size} does not divide the {hq} attention heads: a rank runs whole "
                         "heads; use a TP degree that divides them")
    if hkv % size and size % hkv:
        raise ValueError(f"parallel.tp = {size} and {hkv} KV heads: the TP degree must divide the KV heads or "
                         "be a multiple of them (each rank then holds a copy of its query heads' KV head)")
    widths = {"a rank's query heads": hq // size * d, "a rank's KV heads": max(hkv // size, 1) * d}
    mlps = {"intermediate_size": config.intermediate_size}
    if config.is_moe:
        mlps["moe_intermediate_size"] = config.moe_intermediate_size
        if config.shared_expert_intermediate_size:
            mlps["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    for key, n in mlps.items():
        if n % size:
            raise ValueError(f"parallel.tp = {size} does not divide {key} = {n}: the SwiGLU product is split "
                             "evenly; use a TP degree that divides it")
        widths[f"{key} / {size}"] = n // size
    if spec.device == "cpu":
        narrow = {what: w for what, w in widths.items() if w < MIN_CPU_COLUMNS}
        if narrow:
            what, w = next(iter(narrow.items()))
            raise ValueError(f"parallel.tp = {size} leaves {what} {w} columns wide: on the CPU a GEMM narrower "
                             f"than {MIN_CPU_COLUMNS} columns runs another kernel, whose bits differ from the "
                             "full layer's; use a smaller TP degree")
    quantised = [op for op in ("linear", "lm_head", "expert") if op in spec.ops and
                 (spec.op(op).weight is not None or spec.op(op).act is not None)]
    if quantised:
        raise ValueError(f"parallel.rollout = 'tp' with quantised {quantised[0]} weights or activations: a shard's "
                         "scales and its input's codes must be the full layer's, which is not yet proved for "
                         "sharded layers; use parallel.rollout dp or ep, or an unquantised rollout (fp8_kv alone is fine)")


def tensor_parallel(model, group: dist.ProcessGroup | None = None, reduce: str | None = None) -> TensorParallel:
    """Shard `model` (its weights loaded) over `group` in place: the rank's heads, SwiGLU columns and
    output columns; returns the TensorParallel, also model.tp. reduce: None picks by the spec's mode."""
    spec = model.ops.spec
    tp = TensorParallel.over(group, spec)
    if reduce is not None:
        if reduce not in REDUCTIONS:
            raise ValueError(f"reduce {reduce!r} is unknown: use one of {REDUCTIONS}")
        tp.reduce = reduce
    check_tensor_parallel(model.config, spec, tp.size)
    r, size, gather = tp.rank, tp.size, tp.reduce == "gather"
    hidden, kv_heads = model.config.hidden_size, model.config.num_key_value_heads

    def output_rows(name, linear):  # a column-parallel output that is gathered: padded rows
        n = linear.weight.shape[0]
        tp.take(f"{name}.weight", linear, "weight", linear.weight.shape, 0, tp.rows(n))
        if linear.bias is not None:
            tp.take(f"{name}.bias", linear, "bias", linear.bias.shape, 0, tp.rows(n))

    def split(name, linear, rows, dim=0):
        tp.take(f"{name}.weight", linear, "weight", linear.weight.shape, dim, rows)
        if linear.bias is not None and dim == 0:
            tp.take(f"{name}.bias", linear, "bias", linear.bias.shape, 0, rows)

    def row_parallel(name, linear, k_rows):
        if gather:
            output_rows(name, linear)
        else:  # the K shard; the bias is added once, after the all-reduce
            split(name, linear, k_rows, dim=1)
        linear.tp, linear.k, linear.n = tp, len(k_rows) * size, hidden

    for name, m in list(model.named_modules()):
        if hasattr(m, "q_proj") and hasattr(m, "o_proj"):  # dense.Attention (this module sits below it)
            d, hq, hkv = m.head_dim, m.heads, m.kv_heads
            q_heads = hq // size
            kv = range(r * hkv // size, (r + 1) * hkv // size) if hkv >= size else [r * q_heads // (hq // hkv)]
            split(f"{name}.q_proj", m.q_proj, spans(r * q_heads * d, (r + 1) * q_heads * d))
            kv_rows = [h * d + j for h in kv for j in range(d)]
            split(f"{name}.k_proj", m.k_proj, kv_rows)
            split(f"{name}.v_proj", m.v_proj, kv_rows)
            row_parallel(f"{name}.o_proj", m.o_proj, spans(r * q_heads * d, (r + 1) * q_heads * d))
            m.heads, m.kv_heads = q_heads, len(kv)
            kv_heads = len(kv)
            if hasattr(m, "qkv_proj"):
                m.qkv_proj = type(m.qkv_proj)(m.ops, [m.q_proj, m.k_proj, m.v_proj])
        elif hasattr(m, "gate_proj") and hasattr(m, "down_proj"):  # dense.MLP
            i = m.gate_proj.weight.shape[0] // size
            split(f"{name}.gate_proj", m.gate_proj, spans(r * i, (r + 1) * i))
            split(f"{name}.up_proj", m.up_proj, spans(r * i, (r + 1) * i))
            row_parallel(f"{name}.down_proj", m.down_proj, spans(r * i, (r + 1) * i))
            if hasattr(m, "gate_up_proj"):
                m.gate_up_proj = type(m.gate_up_proj)(m.ops, [m.gate_proj, m.up_proj])
        elif isinstance(getattr(m, "gate_up_proj", None), nn.Parameter):  # moe.Experts
            two_i = m.gate_up_proj.shape[1]
            i = two_i // 2 // size
            mine = spans(r * i, (r + 1) * i)
            tp.take(f"{name}.gate_up_proj", m, "gate_up_proj", m.gate_up_proj.shape, 1,
                    mine + [two_i // 2 + j for j in mine])
            if gather:
                tp.take(f"{name}.down_proj", m, "down_proj", m.down_proj.shape, 1, tp.rows(hidden))
            else:
                tp.take(f"{name}.down_proj", m, "down_proj", m.down_proj.shape, 2, mine)
            m.tp, m.k, m.n = tp, i * size, hidden
    vocab = model.config.vocab_size
    if model.config.tie_word_embeddings:
        # the head's shard: a copy of the embedding's rows (a buffer, not a parameter), written at every sync
        embed = model.model.embed_tokens.weight
        model.register_buffer("tp_head_weight", embed.detach().clone(), persistent=False)
        tp.take("model.embed_tokens.weight", model, "tp_head_weight", embed.shape, 0, tp.rows(vocab))
        tp.copies["model.embed_tokens.weight"].insert(0, (model.model.embed_tokens, "weight", lambda full: full))
    else:
        tp.take("lm_head.weight", model.lm_head, "weight", model.lm_head.weight.shape, 0, tp.rows(vocab))
    tp.kv_heads = kv_heads
    model.tp = tp
    return tp
