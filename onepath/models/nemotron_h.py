"""Nemotron-H: Mamba-2, attention, MLP and MoE layers by pattern, written once against `ops`.

Each layer is x + mixer(rmsnorm(x)), the mixer by config.layers_block_type:
- linear_attention: Mamba-2. in_proj -> (z, xBC, dt); causal conv1d + SiLU over xBC (ops.causal_conv1d, its state per
  sequence); the scan (ops.ssd: A = -exp(A_log), dt through dt_bias, softplus and time_step_limit, D's skip, B and C
  shared by n_groups groups of heads) in the spec's fixed chunks; the gated RMSNorm by group with z
  (ops.gated_rmsnorm); out_proj. in_proj and out_proj are module class "mamba_proj" in the ExecutionSpec.
- full_attention: GQA without positional encoding over the paged KV cache (ops.attention).
- mlp: up_proj, relu2, down_proj.
- moe: a sigmoid router with e_score_correction_bias for the choice, n_group / topk_group group pruning, the chosen
  experts' scores renormalised (norm_topk_prob) and scaled (routed_scaling_factor); relu2 experts (module class
  "expert") on moe.py's dispatch and layouts, combined in FP32 in slot order; the optional latent projections around
  them; one shared expert on the layer's input.
Parameter names are transformers' in-memory ones (model.layers.N.mixer...); checkpoints are read and written in the
hub layout (backbone.*, one up/down projection per expert), as transformers' from_pretrained / save_pretrained.
Design: docs/models.md.
"""
from __future__ import annotations

import math
import re

import torch
from torch import nn

from onepath.models.batch import ForwardBatch
from onepath.models.config import NemotronHConfig
from onepath.models.dense import DenseDecoder, Linear, RMSNorm, StackedLinear, stack_projections
from onepath.models.kv_cache import BLOCK_SIZE, KVCache
from onepath.models.moe import CAPACITY, MASKED_MAX_TOKENS, Router, experts_contiguous, experts_masked, slot_sum
from onepath.models.state_cache import HybridCache, StateCache
from onepath.numerics.spec import DTYPES, SSD_CHUNK
from onepath.ops import Ops
from onepath.ops.spans import SeqSpans


class ModuleLinear(Linear):
    """A Linear whose formats are its module class's in the spec (MODULE_OPS: "mamba_proj", ...)."""

    def __init__(self, ops: Ops, op: str, in_features: int, out_features: int, bias: bool, dtype):
        super().__init__(ops, in_features, out_features, bias, dtype)
        self.op = op

    def forward(self, x):
        return self.ops.linear(x, self.weight, self.bias, op=self.op)


class Mamba2Mixer(nn.Module):
    def __init__(self, ops: Ops, config: NemotronHConfig, dtype):
        super().__init__()
        self.ops, c = ops, config
        self.heads, self.head_dim, self.groups, self.state_size = (c.mamba_num_heads, c.mamba_head_dim, c.n_groups,
                                                                   c.ssm_state_size)
        self.inner, self.conv_dim = c.mamba_intermediate_size, c.conv_dim
        self.eps, self.dt_limit = c.layer_norm_epsilon, tuple(c.time_step_limit)
        self.state_dtype = DTYPES[c.mamba_ssm_cache_dtype]
        self.in_proj = ModuleLinear(ops, "mamba_proj", c.hidden_size, self.inner + self.conv_dim + self.heads,
                                    c.use_bias, dtype)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, c.conv_kernel, dtype=dtype))
        self.conv1d.bias = nn.Parameter(torch.zeros(self.conv_dim, dtype=dtype)) if c.use_conv_bias else None
        self.dt_bias = nn.Parameter(torch.ones(self.heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(self.heads, dtype=dtype))
        self.D = nn.Parameter(torch.ones(self.heads, dtype=dtype))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.inner, dtype=dtype))
        self.out_proj = ModuleLinear(ops, "mamba_proj", self.inner, c.hidden_size, c.use_bias, dtype)

    def forward(self, x, spans: SeqSpans, conv_state=None, ssd_state=None):
        t, gn = x.shape[0], self.groups * self.state_size
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.heads], dim=-1)
        xbc = self.ops.causal_conv1d(xbc, self.conv1d.weight[:, 0], self.conv1d.bias, spans, conv_state)
        xs, b, c = xbc.split([self.inner, gn, gn], dim=-1)
        y = self.ops.ssd(xs.reshape(t, self.heads, self.head_dim), dt, b.reshape(t, self.groups, self.state_size),
                         c.reshape(t, self.groups, self.state_size), self.A_log, self.D, self.dt_bias, spans,
                         ssd_state, self.dt_limit, self.state_dtype)
        y = self.ops.gated_rmsnorm(y.reshape(t, self.inner), z, self.norm.weight, self.eps, self.inner // self.groups)
        return self.out_proj(y)


class Attention(nn.Module):
    """GQA without positional encoding (Nemotron-H's attention layers) over the paged KV cache."""

    def __init__(self, ops: Ops, config: NemotronHConfig, dtype):
        super().__init__()
        self.ops = ops
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        self.q_proj = Linear(ops, h, self.heads * self.head_dim, False, dtype)
        self.k_proj = Linear(ops, h, self.kv_heads * self.head_dim, False, dtype)
        self.v_proj = Linear(ops, h, self.kv_heads * self.head_dim, False, dtype)
        self.o_proj = Linear(ops, self.heads * self.head_dim, h, False, dtype)
        self.scale = self.head_dim ** -0.5
        if stack_projections(ops, [self.heads * self.head_dim] + [self.kv_heads * self.head_dim] * 2):
            self.qkv_proj = StackedLinear(ops, [self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x, batch: ForwardBatch, k_cache, v_cache):
        t = x.shape[0]
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        o = self.ops.attention(q.reshape(t, self.heads, self.head_dim), k.reshape(t, self.kv_heads, self.head_dim),
                               v.reshape(t, self.kv_heads, self.head_dim), k_cache, v_cache, batch.attn, self.scale)
        return self.o_proj(o.reshape(t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, ops: Ops, config: NemotronHConfig, dtype, intermediate_size: int | None = None):
        super().__init__()
        self.ops = ops
        i = intermediate_size or config.intermediate_size
        self.up_proj = Linear(ops, config.hidden_size, i, config.mlp_bias, dtype)
        self.down_proj = Linear(ops, i, config.hidden_size, config.mlp_bias, dtype)

    def forward(self, x):
        return self.down_proj(self.ops.relu2(self.up_proj(x)))


class TopkRouter(Router):
    """mixer.gate: x -> (weights [T, k] FP32, experts [T, k]): sigmoid scores, the choice by scores plus
    e_score_correction_bias among the topk_group best groups (a group's score: its two best), slots in descending
    choice order (ties to the larger expert); the weights are the chosen experts' scores, renormalised when
    norm_topk_prob, times routed_scaling_factor. A Router, so RoutingRecorder sees its choices."""

    def __init__(self, ops: Ops, config: NemotronHConfig, dtype):
        nn.Module.__init__(self)
        self.ops = ops
        self.k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob
        self.groups, self.topk_group, self.scaling = config.n_group, config.topk_group, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=dtype))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x):
        scores = self.ops.sigmoid(self.ops.router(x.float(), self.weight.float()))
        choice = scores + self.e_score_correction_bias
        if self.groups > 1:
            t, e = choice.shape
            best = self.ops.topk(choice.view(t, self.groups, e // self.groups), 2)[0]
            _, kept = self.ops.topk(best[..., 0] + best[..., 1], self.topk_group)
            keep = torch.zeros(t, self.groups, dtype=torch.bool, device=x.device).scatter(1, kept, True)
            choice = choice.masked_fill(~keep.repeat_interleave(e // self.groups, dim=1), -math.inf)
        # top-k selection is not differentiable; the gradient flows through the chosen experts' scores
        _, experts = self.ops.topk(choice, self.k)
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (slot_sum(weights) + 1e-20).unsqueeze(-1)
        return weights * self.scaling, experts


class Experts(nn.Module):
    """mixer.experts: every expert's relu2 MLP, stacked: up_proj [E, I, D], down_proj [E, D, I] (D: hidden_size, or
    moe_latent_size when set)."""

    def __init__(self, ops: Ops, config: NemotronHConfig, dtype):
        super().__init__()
        self.ops, self.num_experts = ops, config.n_routed_experts
        d, i = config.moe_latent_size or config.hidden_size, config.moe_intermediate_size
        self.up_proj = nn.Parameter(torch.empty(self.num_experts, i, d, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, d, i, dtype=dtype))

    @property
    def counts_on_device(self) -> bool:
        """Both projections are grouped launches that read the expert counts on the device (no host sync)."""
        return self.ops.grouped_kernel("expert") and all(self.ops.grouped_on_device(w)
                                                         for w in (self.up_proj, self.down_proj))

    def mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert `expert` on rows [n, D] -> [n, D] FP32."""
        up = self.ops.linear(rows, self.up_proj[expert], op="expert")
        return self.ops.expert_down(self.ops.relu2(up), self.down_proj[expert], op="expert")

    def grouped_mlp(self, rows: torch.Tensor, counts) -> torch.Tensor:
        up = self.ops.grouped_linear(rows, self.up_proj, counts, op="expert")
        return self.ops.grouped_expert_down(self.ops.relu2(up), self.down_proj, counts, op="expert")

    def forward(self, x, experts, layout: str, capacity: int = CAPACITY):
        grouped = self.grouped_mlp if self.ops.grouped_kernel("expert") else None
        if layout == "masked":
            return experts_masked(self.mlp, x, experts, self.num_experts, capacity, grouped)
        return experts_contiguous(self.mlp, x, experts, self.num_experts, grouped)


class MoE(nn.Module):
    def __init__(self, ops: Ops, config: NemotronHConfig, dtype):
        super().__init__()
        self.gate = TopkRouter(ops, config, dtype)
        self.experts = Experts(ops, config, dtype)
        self.shared_experts = MLP(ops, config, dtype, config.moe_shared_expert_intermediate_size)
        if config.moe_latent_size is not None:
            self.fc1_latent_proj = Linear(ops, config.hidden_size, config.moe_latent_size, config.mlp_bias, dtype)
            self.fc2_latent_proj = Linear(ops, config.moe_latent_size, config.hidden_size, config.mlp_bias, dtype)
        self.capacity, self.masked_max_tokens = CAPACITY, MASKED_MAX_TOKENS
        self.layout: str | None = None  # None: masked up to masked_max_tokens tokens, else contiguous

    def forward(self, x):
        weights, experts = self.gate(x)
        latent = hasattr(self, "fc1_latent_proj")
        h = self.fc1_latent_proj(x) if latent else x
        layout = self.layout or ("masked" if x.shape[0] <= self.masked_max_tokens else "contiguous")
        if x.shape[0]:
            routed = slot_sum(weights.unsqueeze(-1) * self.experts(h, experts, layout, self.capacity)).to(x.dtype)
        else:
            routed = h.new_zeros(h.shape)
        if latent:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


class Block(nn.Module):
    def __init__(self, ops: Ops, config: NemotronHConfig, dtype, layer: int):
        super().__init__()
        self.kind = config.layers_block_type[layer]
        self.norm = RMSNorm(ops, config.hidden_size, config.layer_norm_epsilon, dtype)
        self.mixer = {"linear_attention": Mamba2Mixer, "full_attention": Attention, "mlp": MLP,
                      "moe": MoE}[self.kind](ops, config, dtype)

    def forward(self, x, batch: ForwardBatch, spans: SeqSpans, k_cache, v_cache, conv_state, ssd_state):
        h = self.norm(x)
        if self.kind == "linear_attention":
            h = self.mixer(h, spans, conv_state, ssd_state)
        elif self.kind == "full_attention":
            h = self.mixer(h, batch, k_cache, v_cache)
        else:
            h = self.mixer(h)
        return x + h


class NemotronHDecoder(nn.Module):
    # the engine keeps each running sequence's Mamba state in a slot beside the paged KV (HybridCache)
    has_recurrent_state = True

    def __init__(self, config: NemotronHConfig, ops: Ops, max_positions: int | None = None):
        super().__init__()
        if not isinstance(config, NemotronHConfig):
            raise ValueError(f"model_type {config.model_type!r} is not a Nemotron-H config: build it with "
                             "build_decoder")
        check_chunk(config, ops)
        dtype = ops.spec.dtype
        self.config, self.ops = config, ops
        self.model = nn.Module()
        self.model.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.model.layers = nn.ModuleList(Block(ops, config, dtype, i) for i in range(config.num_hidden_layers))
        self.model.norm_f = RMSNorm(ops, config.hidden_size, config.layer_norm_epsilon, dtype)
        self.lm_head = nn.Module()
        self.lm_head.weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        if self.lm_head.weight.device.type != "meta":
            self.to(ops.spec.device)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def capturable(self) -> bool:
        """Whether decode steps may run in CUDA graphs: the recurrent ops read a static decode batch's positions and
        slots on the device (SeqSpans.decode), and every MoE layer's experts read their counts there (grouped
        launches; on the CPU, loops read them on the host)."""
        return all(m.counts_on_device for m in self.modules() if isinstance(m, Experts))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def share_projection_storage(self) -> None:
        for module in self.modules():
            if isinstance(module, StackedLinear):
                module.share_storage()

    def make_cache(self, num_blocks: int, block_size: int, num_slots: int = 0) -> KVCache:
        """The attention layers' paged K/V in the spec's dtype and attention.kv format, on the model's device, and
        with num_slots the Mamba layers' state of num_slots running sequences and the scratch slot (HybridCache);
        num_slots=0: whole sequences from position 0, no state kept (the trainer's)."""
        dtype, kv = self.ops.spec.dtype, self.ops.kv_quant
        if not num_slots:
            return KVCache(self.config, num_blocks, block_size, dtype, self.device, kv=kv)
        return HybridCache(self.config, num_blocks, block_size, dtype, num_slots, scan_chunk(self.ops), self.device, kv)

    def cache_bytes_per_token(self, block_size: int = BLOCK_SIZE) -> int:
        """K and V of one token over the attention layers, FP8 scales included."""
        return KVCache.bytes_per_token(self.config, self.ops.spec.dtype, self.ops.kv_quant)

    def cache_bytes_per_slot(self) -> int:
        """One running sequence's state over the Mamba layers."""
        return StateCache.bytes_per_slot(self.config, self.ops.spec.dtype, scan_chunk(self.ops))

    def forward(self, batch: ForwardBatch, cache: KVCache, layer_fn=None) -> torch.Tensor:
        """Hidden states after the final norm [T, hidden]. With a HybridCache the Mamba layers continue each
        sequence's state from its slot (batch.state_slots, default 0, 1, ...) and keep it there; with a plain
        KVCache every sequence must start at position 0 and no state is kept (the trainer)."""
        states = cache.states if isinstance(cache, HybridCache) else None
        if isinstance(batch.state_slots, torch.Tensor):  # a static decode batch: positions and slots on the device
            spans = SeqSpans.decode(batch.attn.positions, batch.state_slots)
        else:
            slots = None if states is None else (batch.state_slots or list(range(batch.attn.num_seqs)))
            spans = SeqSpans.of(batch.attn.cu_seqlens, batch.attn.context_lens, slots, batch.input_ids.device)
        x = self.ops.embedding(batch.input_ids, self.model.embeddings.weight)
        for i, layer in enumerate(self.model.layers):
            conv, ssd = (None, None) if states is None else (states.conv[i], states.ssd[i])
            args = (x, batch, spans, cache.k[i], cache.v[i], conv, ssd)
            x = layer(*args) if layer_fn is None else layer_fn(layer, *args)
        return self.model.norm_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.lm_head(hidden, self.lm_head.weight)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Random weights whose scan is far from trivial: A = -(1 .. 16), dt in [time_step_min, time_step_max]
        (log-uniform, as transformers draws it), D = 1, norms 1, biases 0, the rest N(0, std)."""
        g = torch.Generator().manual_seed(seed)
        c = self.config
        lo, hi = math.log(c.extra.get("time_step_min", 1e-3)), math.log(c.extra.get("time_step_max", 0.1))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("A_log"):
                    p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=g)))
                elif name.endswith("dt_bias"):
                    dt = torch.exp(lo + (hi - lo) * torch.rand(p.shape, generator=g))
                    p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
                elif name.endswith(".D") or name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """From the hub layout (backbone.*, mixer.experts.{i}.up_proj.weight) or transformers' in-memory one
        (model.*, mixer.experts.up_proj [E, I, D]); multi-token-prediction tensors (mtp.*) are skipped."""
        DenseDecoder.load_hf_state_dict(self, fuse_experts(renamed(state, "backbone.", "model.")))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The hub layout, as transformers' save_pretrained writes it."""
        state = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        return split_experts(renamed(state, "model.", "backbone."))


def scan_chunk(ops: Ops) -> int:
    """The scan's chunk (the spec's ssd.chunk, SSD_CHUNK by default): the state cache keeps its open chunk."""
    return ops.spec.op("ssd").chunk or SSD_CHUNK


def check_chunk(config: NemotronHConfig, ops: Ops) -> None:
    """The scan runs in the spec's chunks (ssd.chunk); the checkpoint's chunk_size must divide them, so every boundary
    of the spec's scan is one of the checkpoint's own scan too."""
    if "linear_attention" not in config.layers_block_type:
        return
    tile = scan_chunk(ops)
    if tile % config.chunk_size:
        raise ValueError(f"chunk_size {config.chunk_size} does not divide the spec's ssd.chunk {tile}: use a spec "
                         f"whose ssd.chunk is a multiple of it (e.g. --spec ssd.chunk="
                         f"{config.chunk_size * max(1, -(-tile // config.chunk_size))})")


def renamed(state: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    return {new + k[len(old):] if k.startswith(old) else k: v for k, v in state.items() if not k.startswith("mtp.")}


EXPERT_KEY = re.compile(r"(.+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight")


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, groups = {}, {}
    for name, tensor in state.items():
        m = EXPERT_KEY.fullmatch(name)
        if m:
            groups.setdefault((m[1], m[3]), {})[int(m[2])] = tensor
        else:
            out[name] = tensor
    for (prefix, proj), parts in groups.items():
        missing = [f"{prefix}.{i}.{proj}.weight" for i in range(1 + max(parts)) if i not in parts]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} expert tensors, first {missing[:3]}: every expert "
                             "needs up_proj and down_proj")
        out[f"{prefix}.{proj}"] = torch.stack([parts[i] for i in range(len(parts))])
    return out


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        m = re.fullmatch(r"(.+\.mixer\.experts)\.(up_proj|down_proj)", name)
        if m:
            out.update({f"{m[1]}.{i}.{m[2]}.weight": tensor[i].clone() for i in range(tensor.shape[0])})
        else:
            out[name] = tensor
    return out
