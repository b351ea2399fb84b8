"""Dense decoder of the Llama / Qwen2 / Qwen3 family, written once against `ops`.

GQA, RoPE (all scaling types of rope_scaling.py), RMSNorm, SwiGLU, optional QK-norm (Qwen3) and
attention bias (Qwen2), sliding-window attention per layer (ModelConfig.attention_window), tied or
untied embeddings. Parameter names are Hugging Face's, so a
checkpoint's state dict loads as is. The engine and the trainer run this same module; the
ExecutionSpec inside `ops` is the only switch between numerics.
"""
from __future__ import annotations

import torch
from torch import nn

from onepath.models.batch import ForwardBatch
from onepath.models.config import ModelConfig
from onepath.models.kv_cache import BLOCK_SIZE, KVCache
from onepath.models.rope_scaling import cos_sin_table
from onepath.models.tensor_parallel import TensorParallel, tensor_parallel
from onepath.ops import Ops


class Linear(nn.Module):
    # a row-parallel layer of a tensor-parallel model: its TensorParallel, full input and output sizes
    tp: TensorParallel | None = None

    def __init__(self, ops: Ops, in_features: int, out_features: int, bias: bool, dtype):
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None

    def forward(self, x):
        return self.project(self.ops.linear, x, self.bias)

    def expert_down(self, x):
        """ops.expert_down over this layer's weight, no bias: FP32 out (an MoE's shared expert joins the FP32 sum)."""
        return self.project(self.ops.expert_down, x, None)

    def project(self, op, x, bias):
        if self.tp is None:
            return op(x, self.weight, bias)
        return self.tp.row_parallel(lambda h, b: op(h, self.weight, b), x, self.k, self.n, bias)


class StackedLinear(nn.Module):
    """One GEMM for the Linear layers that read the same input (q/k/v, gate/up): their weights stacked
    along N, their outputs side by side (`sizes` columns each). A speed-up only: on CUDA a column's bits
    do not depend on N, and both sides run this site. The layers keep their parameters; the trainer
    stacks them at each forward (differentiable), the engine's `share_storage()` makes them views of
    one stacked tensor (docs/models.md)."""

    def __init__(self, ops: Ops, parts: list[Linear]):
        super().__init__()
        self.ops = ops
        self.parts = tuple(parts)  # not submodules: the parameters stay the layers' own
        self.sizes = [part.weight.shape[0] for part in parts]
        self.weight = self.bias = None  # the stacked storage, after share_storage()

    def share_storage(self) -> None:
        """Make the layers' weights (and biases) views of one stacked tensor each, with their values."""
        if self.weight is not None:
            return
        for attr in ("weight", "bias"):
            if getattr(self.parts[0], attr) is None:
                continue
            stacked = torch.cat([getattr(part, attr).detach() for part in self.parts])
            for part, view in zip(self.parts, stacked.split(self.sizes)):
                setattr(part, attr, nn.Parameter(view, requires_grad=getattr(part, attr).requires_grad))
            setattr(self, attr, stacked)

    def stacked(self, attr: str) -> torch.Tensor | None:
        if getattr(self.parts[0], attr) is None:
            return None
        shared = getattr(self, attr)
        if shared is not None and not torch.is_grad_enabled():
            return shared
        return torch.cat([getattr(part, attr) for part in self.parts])

    def forward(self, x):
        """[..., sum of the layers' outputs]: the layers' outputs side by side (split by self.sizes)."""
        return self.ops.linear(x, self.stacked("weight"), self.stacked("bias"))


def stack_projections(ops: Ops, sizes: list[int]) -> bool:
    """Whether the layers that share an input (output sizes `sizes`) run as one StackedLinear: on CUDA, for
    unquantised linears, and for block-FP8 weights whose blocks each lie within one layer (every size a
    multiple of the block's rows), so the stacked weight's codes and scales are the layers' own and each
    token's activation codes do not depend on N. Not NVFP4: its global scale is the whole tensor's amax."""
    return ops.can_stack(sizes)


class RMSNorm(nn.Module):
    def __init__(self, ops: Ops, size: int, eps: float, dtype):
        super().__init__()
        self.ops, self.eps = ops, eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x):
        return self.ops.rmsnorm(x, self.weight, self.eps)

    def add(self, x, residual):
        """(self(x + residual), x + residual)."""
        return self.ops.add_rmsnorm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, ops: Ops, config: ModelConfig, dtype, layer: int):
        super().__init__()
        self.ops = ops
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = config.has_attention_bias
        self.q_proj = Linear(ops, config.hidden_size, self.heads * self.head_dim, bias, dtype)
        self.k_proj = Linear(ops, config.hidden_size, self.kv_heads * self.head_dim, bias, dtype)
        self.v_proj = Linear(ops, config.hidden_size, self.kv_heads * self.head_dim, bias, dtype)
        self.o_proj = Linear(ops, self.heads * self.head_dim, config.hidden_size, config.o_proj_bias, dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(ops, self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(ops, self.head_dim, config.rms_norm_eps, dtype)
        self.sliding_window = config.attention_window(layer)
        self.scale = self.head_dim ** -0.5
        if stack_projections(ops, [self.heads * self.head_dim] + [self.kv_heads * self.head_dim] * 2):
            self.qkv_proj = StackedLinear(ops, [self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x, batch: ForwardBatch, k_cache, v_cache, cos, sin):
        t = x.shape[0]
        if hasattr(self, "qkv_proj"):
            q, k, v = self.stacked_qkv(x, batch, cos, sin)
        else:
            q = self.q_proj(x).view(t, self.heads, self.head_dim)
            k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
            v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
            if hasattr(self, "q_norm"):
                q, k = self.q_norm(q), self.k_norm(k)
            q = self.ops.rope(q, batch.positions, cos, sin)
            k = self.ops.rope(k, batch.positions, cos, sin)
        o = self.ops.attention(q, k, v, k_cache, v_cache, batch.attn, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(t, self.heads * self.head_dim))

    def stacked_qkv(self, x, batch: ForwardBatch, cos, sin):
        """q, k, v from one GEMM; q and k normalised (QK-norm) and rotated together, in one launch: views
        of the stacked outputs, as the unstacked layers would give them."""
        t, qk_heads = x.shape[0], self.heads + self.kv_heads
        qkv = self.qkv_proj(x)
        qk = qkv[:, :qk_heads * self.head_dim].view(t, qk_heads, self.head_dim)
        v = qkv[:, qk_heads * self.head_dim:].view(t, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            qk = self.ops.qk_norm_rope(qk, self.q_norm.weight, self.k_norm.weight, self.heads, self.q_norm.eps,
                                       batch.positions, cos, sin)
        else:
            qk = self.ops.rope(qk, batch.positions, cos, sin)
        return qk[:, :self.heads], qk[:, self.heads:], v


class MLP(nn.Module):
    def __init__(self, ops: Ops, config: ModelConfig, dtype):
        super().__init__()
        self.ops = ops
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(ops, h, i, bias, dtype)
        self.up_proj = Linear(ops, h, i, bias, dtype)
        self.down_proj = Linear(ops, i, h, bias, dtype)
        if stack_projections(ops, [i, i]):
            self.gate_up_proj = StackedLinear(ops, [self.gate_proj, self.up_proj])

    def forward(self, x):
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).split(self.gate_up_proj.sizes, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.ops.silu_mul(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, ops: Ops, config: ModelConfig, dtype, mlp: nn.Module, layer: int):
        super().__init__()
        self.self_attn = Attention(ops, config, dtype, layer)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(ops, config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(ops, config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x, batch, k_cache, v_cache, cos, sin):
        attn = self.self_attn(self.input_layernorm(x), batch, k_cache, v_cache, cos, sin)
        normed, x = self.post_attention_layernorm.add(attn, x)   # x + attn, one launch with the norm
        return x + self.mlp(normed)


class Backbone(nn.Module):
    def __init__(self, ops: Ops, config: ModelConfig, dtype, make_mlp):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(ops, config, dtype, make_mlp(i), i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(ops, config.hidden_size, config.rms_norm_eps, dtype)


class DenseDecoder(nn.Module):
    # the forward reads no size on the host: the engine may capture it in a CUDA graph
    capturable = True
    # no state per sequence beyond its K/V: the engine gives it no state slots
    has_recurrent_state = False
    tp: TensorParallel | None = None  # set by tensor_parallel()

    def __init__(self, config: ModelConfig, ops: Ops, max_positions: int | None = None):
        super().__init__()
        dtype = ops.spec.dtype
        self.config, self.ops = config, ops
        self.model = Backbone(ops, config, dtype, self.make_mlp)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        cos, sin = cos_sin_table(config, max_positions or config.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if cos.device.type != "meta":  # built under torch.device("meta"): shapes only, nothing to move
            self.to(ops.spec.device)

    def share_projection_storage(self) -> None:
        """The engine's model: each StackedLinear's layers become views of one stacked weight, which its
        forwards without autograd read with no copy."""
        for module in self.modules():
            if isinstance(module, StackedLinear):
                module.share_storage()

    def make_mlp(self, layer: int) -> nn.Module:
        """Layer `layer`'s MLP (a subclass gives sparse layers their experts)."""
        return MLP(self.ops, self.config, self.ops.spec.dtype)

    @property
    def device(self) -> torch.device:
        return self.rope_cos.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.tp is not None and self.config.tie_word_embeddings:
            return self.tp_head_weight  # this rank's vocabulary rows of the tied embedding, kept in step
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    @property
    def kv_heads(self) -> int:
        """KV heads this model's cache holds: all of them, or a tensor-parallel rank's."""
        return self.config.num_key_value_heads if self.tp is None else self.tp.kv_heads

    def make_cache(self, num_blocks: int, block_size: int, num_slots: int = 0) -> KVCache:
        """The paged K/V of num_blocks blocks in the dtype and attention.kv format of the spec, on the model's device,
        this model's KV heads (a tensor-parallel rank's)."""
        if num_slots:
            raise ValueError(f"{type(self).__name__} keeps no state per sequence, so its cache has no state slots: "
                             f"pass num_slots=0, not {num_slots}")
        return KVCache(self.config, num_blocks, block_size, self.ops.spec.dtype, self.device, kv=self.ops.kv_quant,
                       kv_heads=self.kv_heads)

    def cache_bytes_per_token(self, block_size: int = BLOCK_SIZE) -> int:
        """K and V of one token over all layers in make_cache's format, FP8 scales included."""
        return KVCache.bytes_per_token(self.config, self.ops.spec.dtype, self.ops.kv_quant, self.kv_heads)

    def cache_bytes_per_slot(self) -> int:
        """One state slot's bytes: none (no state slots)."""
        return 0

    def tensor_parallel(self, group=None, reduce: str | None = None) -> "DenseDecoder":
        """Shard this model's heads, SwiGLU columns and output columns over `group` (None: every process),
        in place, after the weights are loaded (models/tensor_parallel.py)."""
        tensor_parallel(self, group, reduce)
        return self

    def forward(self, batch: ForwardBatch, cache: KVCache, layer_fn=None) -> torch.Tensor:
        """Hidden states after the final norm, one row per token of the batch: [T, hidden].
        layer_fn(layer, *args), when given, runs each decoder layer in place of layer(*args): the
        trainer's activation recomputation wraps it so; the values must be layer(*args)'s."""
        x = self.ops.embedding(batch.input_ids, self.model.embed_tokens.weight, self.config.padding_idx)
        for i, layer in enumerate(self.model.layers):
            args = (x, batch, cache.k[i], cache.v[i], self.rope_cos, self.rope_sin)
            x = layer(*args) if layer_fn is None else layer_fn(layer, *args)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ops.lm_head(hidden, self.lm_head_weight)
        return logits if self.tp is None else self.tp.gather(logits, self.config.vocab_size)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        expected = set(self.state_dict())
        missing = sorted(expected - set(state))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, first {missing[:3]}: it does not match config.json")
        unexpected = sorted(k for k in set(state) - expected if not k.endswith("rotary_emb.inv_freq"))
        if unexpected and unexpected != ["lm_head.weight"]:
            raise ValueError(f"checkpoint has {len(unexpected)} tensors this model does not, first {unexpected[:3]}")
        with torch.no_grad():
            for name, tensor in self.state_dict().items():
                if tuple(state[name].shape) != tuple(tensor.shape):
                    raise ValueError(f"tensor {name} has shape {tuple(state[name].shape)}, config.json implies {tuple(tensor.shape)}")
                tensor.copy_(state[name])

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.state_dict().items()}
