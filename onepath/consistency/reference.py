"""A float64 dense decoder in plain PyTorch: the independent yardstick of gate C7.

Written from the Hugging Face definitions of Llama / Qwen2 / Qwen3 / Mistral, not from onepath's
model, and calls none of onepath's ops: embedding lookup, RMSNorm, RoPE (`rotate_half` layout),
causal attention with GQA and Mistral's sliding window, SwiGLU, the LM head and a log-softmax,
over whole sequences (no KV cache). Only the RoPE inverse frequencies and their attention scaling
come from onepath (rope_scaling.inv_freq), so every rope_scaling type is covered. Which optional
tensors exist (biases, QK-norm) is read from the state dict, so the checkpoint decides.
"""
from __future__ import annotations

import torch

from onepath.models.config import ModelConfig
from onepath.models.rope_scaling import inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Float64Reference:
    """What C7 asks of a reference: `logits(tokens)` of a whole sequence and `params`, float64 leaves by name."""
    params: dict[str, torch.Tensor]

    def logits(self, tokens: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def completion_logprobs(self, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
        """log p(completion[i] | prompt + completion[:i]) under softmax(logits / temperature), float64."""
        logits = self.logits(list(prompt) + list(completion[:-1]))[len(prompt) - 1:]
        logp = torch.log_softmax(logits / temperature, dim=-1)
        return logp.gather(-1, torch.tensor(completion, dtype=torch.long)[:, None])[:, 0]

    def grads(self) -> dict[str, torch.Tensor]:
        return {name: (t.grad if t.grad is not None else torch.zeros_like(t)) for name, t in self.params.items()}


class ReferenceDecoder(Float64Reference):
    """Parameters are float64 leaves named as in the checkpoint; `grads()` returns their gradients."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor]):
        self.config = config
        self.params = {name: t.detach().cpu().to(torch.float64).clone().requires_grad_(True)
                       for name, t in state.items() if t.is_floating_point()}
        inv, self.rope_scaling = inv_freq(config)
        self.inv_freq = inv.to(torch.float64)

    def linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        y = x @ self.params[prefix + ".weight"].T
        bias = self.params.get(prefix + ".bias")
        return y if bias is None else y + bias

    def attention(self, x: torch.Tensor, prefix: str, cos, sin, mask) -> torch.Tensor:
        c, n = self.config, x.shape[0]
        q = self.linear(x, prefix + ".q_proj").view(n, c.num_attention_heads, c.head_dim)
        k = self.linear(x, prefix + ".k_proj").view(n, c.num_key_value_heads, c.head_dim)
        v = self.linear(x, prefix + ".v_proj").view(n, c.num_key_value_heads, c.head_dim)
        if prefix + ".q_norm.weight" in self.params:
            q = rms_norm(q, self.params[prefix + ".q_norm.weight"], c.rms_norm_eps)
            k = rms_norm(k, self.params[prefix + ".k_norm.weight"], c.rms_norm_eps)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * c.head_dim ** -0.5
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        o = torch.einsum("hqk,khd->qhd", weights, v).reshape(n, c.num_attention_heads * c.head_dim)
        return self.linear(o, prefix + ".o_proj")

    def mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        gate = self.linear(x, prefix + ".gate_proj")
        return self.linear(gate * torch.sigmoid(gate) * self.linear(x, prefix + ".up_proj"), prefix + ".down_proj")

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab] float64 logits of a whole sequence from position 0."""
        c, p = self.config, self.params
        n = len(tokens)
        x = p["model.embed_tokens.weight"][torch.tensor(tokens, dtype=torch.long)]
        freqs = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos() * self.rope_scaling, angles.sin() * self.rope_scaling
        i = torch.arange(n)
        causal = i[None, :] <= i[:, None]
        for layer in range(c.num_hidden_layers):
            prefix = f"model.layers.{layer}"
            window = c.attention_window(layer)
            mask = causal if window is None else causal & (i[None, :] > i[:, None] - window)
            x = x + self.attention(rms_norm(x, p[prefix + ".input_layernorm.weight"], c.rms_norm_eps),
                                   prefix + ".self_attn", cos, sin, mask)
            x = x + self.mlp(rms_norm(x, p[prefix + ".post_attention_layernorm.weight"], c.rms_norm_eps),
                             prefix + ".mlp")
        x = rms_norm(x, p["model.norm.weight"], c.rms_norm_eps)
        head = p["model.embed_tokens.weight"] if c.tie_word_embeddings else p["lm_head.weight"]
        return x @ head.T
