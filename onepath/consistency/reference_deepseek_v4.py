"""A float64 DeepSeek-V4 in plain PyTorch: gate C7's yardstick for that family.

Written from transformers' DeepseekV4ForCausalLM, not from onepath's model, and calls none of onepath's ops: mHC
(the streams normalised and mixed into pre / post / comb, Sinkhorn-Knopp columns first), shared-KV attention with
interleaved partial RoPE undone on the output, per-head sinks, the sliding window, the compressors (gated pooling
of each window; CSA's overlap with the previous window), the lightning indexer and its top-k (ties to the larger
entry, as the contract says), the grouped low-rank output projection, hash and top-k routing with the clamped
SwiGLU experts and the shared expert, over one whole sequence (no cache). Only the RoPE inverse frequencies and the
checkpoint's names come from onepath (rope_scaling.frequencies, deepseek_v4_names.from_checkpoint).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from onepath.consistency.reference import Float64Reference
from onepath.models.deepseek_v4_config import CSA, SLIDING, DeepseekV4Config
from onepath.models.deepseek_v4_names import from_checkpoint
from onepath.models.rope_scaling import frequencies

F64 = torch.float64


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ReferenceDeepseekV4(Float64Reference):
    """Parameters are float64 leaves named as the model's own (in-memory) parameters; `grads()` returns their
    gradients."""

    def __init__(self, config: DeepseekV4Config, state: dict[str, torch.Tensor]):
        self.config = c = config
        state = from_checkpoint(state, config)
        self.params = {name: t.detach().cpu().to(F64).clone().requires_grad_(True)
                       for name, t in state.items() if t.is_floating_point()}
        self.buffers = {name: t for name, t in state.items() if not t.is_floating_point()}
        self.rope_tables = {label: frequencies(c.rope(label), c.rope_dim, c.max_position_embeddings)
                            for label in ("main", "compress")}

    def p(self, name: str) -> torch.Tensor:
        return self.params[name]

    def rope(self, x: torch.Tensor, positions: torch.Tensor, label: str, sign: float = 1.0) -> torch.Tensor:
        """x [S, ..., D]: the trailing rope_dim channels rotated in adjacent pairs at `positions` [S]."""
        inv, scaling = self.rope_tables[label]
        angles = positions.to(F64)[:, None] * inv.to(F64)[None]
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
        cos, sin = (angles.cos() * scaling).view(shape), (sign * angles.sin() * scaling).view(shape)
        d = self.config.rope_dim
        nope, pairs = x[..., :x.shape[-1] - d], x[..., x.shape[-1] - d:].unflatten(-1, (-1, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.cat([nope, torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)], dim=-1)

    def hyper(self, streams: torch.Tensor, prefix: str):
        c, n = self.config, self.config.hc_mult
        mixes = rms(streams.flatten(1), c.rms_norm_eps) @ self.p(prefix + ".fn").T
        base, scale = self.p(prefix + ".base"), self.p(prefix + ".scale")
        pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + c.hc_eps
        post = 2 * torch.sigmoid(mixes[:, n:2 * n] * scale[1] + base[n:2 * n])
        comb = torch.softmax((mixes[:, 2 * n:] * scale[2] + base[2 * n:]).view(-1, n, n), dim=-1) + c.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + c.hc_eps)
        for _ in range(c.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + c.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + c.hc_eps)
        return post, comb, (pre[..., None] * streams).sum(1)

    def compress(self, x: torch.Tensor, prefix: str, rate: int, dim: int, overlap: bool) -> torch.Tensor:
        """Every closed window's entry [W, dim], normalised and rotated at the window's first position."""
        windows = x.shape[0] // rate
        kv = (x @ self.p(prefix + ".kv_proj.weight").T)[:windows * rate].view(windows, rate, -1)
        gate = (x @ self.p(prefix + ".gate_proj.weight").T)[:windows * rate].view(windows, rate, -1)
        gate = gate + self.p(prefix + ".position_bias")
        if overlap:  # the previous window's first halves, then this window's second halves
            prev_kv = torch.cat([torch.zeros_like(kv[:1, :, :dim]), kv[:-1, :, :dim]])
            prev_gate = torch.cat([torch.full_like(gate[:1, :, :dim], -math.inf), gate[:-1, :, :dim]])
            kv = torch.cat([prev_kv, kv[:, :, dim:]], dim=1)
            gate = torch.cat([prev_gate, gate[:, :, dim:]], dim=1)
        pooled = (kv * torch.softmax(gate, dim=1)).sum(1)
        entries = rms(pooled, self.config.rms_norm_eps) * self.p(prefix + ".kv_norm.weight")
        return self.rope(entries, torch.arange(windows) * rate, "compress")

    def indexer(self, x, q_residual, positions, prefix: str, rate: int) -> list[list[int]]:
        c = self.config
        keys = self.compress(x, prefix, rate, c.index_head_dim, overlap=True)
        q = (q_residual @ self.p(prefix + ".q_b_proj.weight").T).view(x.shape[0], c.index_n_heads, -1)
        q = self.rope(q, positions, "compress")
        w = (x @ self.p(prefix + ".scorer.weights_proj.weight").T) * c.index_n_heads ** -0.5
        scores = (torch.relu(torch.einsum("shd,ed->she", q, keys)) * c.index_head_dim ** -0.5 * w[..., None]).sum(1)
        picked, values = [], scores.detach()
        for t in range(x.shape[0]):
            seen = (t + 1) // rate
            order = sorted(range(seen), key=lambda e: (float(values[t, e]), e), reverse=True)[:c.index_topk]
            picked.append(sorted(order, reverse=True))
        return picked

    def attention(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        c, prefix = self.config, f"model.layers.{layer}.self_attn"
        s, h, d = x.shape[0], c.num_attention_heads, c.head_dim
        kind = c.layer_types[layer]
        label = "main" if kind == SLIDING else "compress"
        positions = torch.arange(s)
        q_residual = rms(x @ self.p(prefix + ".q_a_proj.weight").T, c.rms_norm_eps)
        q_residual = q_residual * self.p(prefix + ".q_a_norm.weight")
        q = rms((q_residual @ self.p(prefix + ".q_b_proj.weight").T).view(s, h, d), c.rms_norm_eps)
        q = self.rope(q, positions, label)
        kv = rms(x @ self.p(prefix + ".kv_proj.weight").T, c.rms_norm_eps) * self.p(prefix + ".kv_norm.weight")
        kv = self.rope(kv, positions, label)
        entries, picked = None, None
        if kind != SLIDING:
            rate = c.compress_rates[kind]
            entries = self.compress(x, prefix + ".compressor", rate, d, overlap=kind == CSA)
            if kind == CSA:
                picked = self.indexer(x, q_residual, positions, prefix + ".compressor.indexer", rate)
        outs = []
        for t in range(s):
            keys = [kv[j] for j in range(max(0, t - c.sliding_window + 1), t + 1)]
            if entries is not None:
                seen = picked[t] if picked is not None else range((t + 1) // c.compress_rates[kind])
                keys += [entries[e] for e in seen]
            k = torch.stack(keys)
            logits = torch.cat([(q[t] @ k.T) * d ** -0.5, self.p(prefix + ".sinks")[:, None]], dim=-1)
            outs.append(torch.softmax(logits, dim=-1)[:, :-1] @ k)
        o = self.rope(torch.stack(outs), positions, label, sign=-1.0)
        groups = c.o_groups
        weight = self.p(prefix + ".o_a_proj.weight").view(groups, -1, h * d // groups)
        mixed = torch.einsum("sgk,grk->sgr", o.reshape(s, groups, -1), weight).reshape(s, -1)
        return mixed @ self.p(prefix + ".o_b_proj.weight").T

    def swiglu(self, x, gate_w, up_w, down_w):
        limit = self.config.swiglu_limit
        gate, up = (x @ gate_w.T).clamp(max=limit), (x @ up_w.T).clamp(min=-limit, max=limit)
        return (F.silu(gate) * up) @ down_w.T

    def moe(self, x: torch.Tensor, ids: torch.Tensor, layer: int) -> torch.Tensor:
        c, prefix = self.config, f"model.layers.{layer}.mlp"
        logits = x @ self.p(prefix + ".gate.weight").T
        scores = {"sqrtsoftplus": lambda v: F.softplus(v).sqrt(), "sigmoid": torch.sigmoid,
                  "softmax": lambda v: torch.softmax(v, dim=-1)}[c.scoring_func](logits)
        if c.mlp_layer_types[layer] == "hash_moe":
            experts = self.buffers[prefix + ".gate.tid2eid"][ids]
        else:
            experts = torch.topk(scores + self.p(prefix + ".gate.e_score_correction_bias"), c.num_experts_per_tok,
                                 dim=-1).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
        gate_up, down = self.p(prefix + ".experts.gate_up_proj"), self.p(prefix + ".experts.down_proj")
        inter = down.shape[-1]
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for slot, e in enumerate(experts[t].tolist()):
                out[t] = out[t] + weights[t, slot] * self.swiglu(x[t], gate_up[e, :inter], gate_up[e, inter:], down[e])
        shared = prefix + ".shared_experts"
        return out + self.swiglu(x, self.p(shared + ".gate_proj.weight"), self.p(shared + ".up_proj.weight"),
                                 self.p(shared + ".down_proj.weight"))

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab] float64 logits of a whole sequence from position 0."""
        c = self.config
        ids = torch.tensor(tokens, dtype=torch.long)
        streams = self.p("model.embed_tokens.weight")[ids][:, None].expand(-1, c.hc_mult, -1)
        for layer in range(c.num_hidden_layers):
            prefix = f"model.layers.{layer}"
            for hc, norm, block in (("attn_hc", "input_layernorm", lambda v: self.attention(v, layer)),
                                    ("ffn_hc", "post_attention_layernorm", lambda v: self.moe(v, ids, layer))):
                post, comb, collapsed = self.hyper(streams, f"{prefix}.{hc}")
                out = block(rms(collapsed, c.rms_norm_eps) * self.p(f"{prefix}.{norm}.weight"))
                streams = post[..., None] * out[:, None] + torch.einsum("sjk,sjd->skd", comb, streams)
        mixes = rms(streams.flatten(1), c.rms_norm_eps) @ self.p("model.hc_head.hc_fn").T
        pre = torch.sigmoid(mixes * self.p("model.hc_head.hc_scale") + self.p("model.hc_head.hc_base")) + c.hc_eps
        hidden = rms((pre[..., None] * streams).sum(1), c.rms_norm_eps) * self.p("model.norm.weight")
        head = self.p("model.embed_tokens.weight") if c.tie_word_embeddings else self.p("lm_head.weight")
        return hidden @ head.T
