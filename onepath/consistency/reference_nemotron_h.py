"""A float64 Nemotron-H in plain PyTorch: gate C7's independent yardstick for the hybrid.

Written from Hugging Face's NemotronH definitions, not from onepath's model, and calls none of onepath's ops:
the Mamba-2 mixer as its one-step recurrence, token by token (in_proj -> z, xBC, dt; causal depthwise conv1d and
SiLU; dt through dt_bias, softplus and time_step_limit; state = exp(dt A) state + dt x B^T, y = C . state + D x; the
gated RMSNorm by groups; out_proj), attention without positional encoding (GQA, causal), the relu2 MLP, and the MoE
block (sigmoid router, e_score_correction_bias for the choice among the topk_group best of n_group groups,
renormalised and scaled weights, relu2 experts between the optional latent projections, the shared expert). Whole
sequences from position 0. Parameters are float64 leaves under the model's own names (its state_dict).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onepath.consistency.reference import ReferenceDecoder, rms_norm


class ReferenceNemotronH(ReferenceDecoder):
    def __init__(self, config, state: dict[str, torch.Tensor]):
        self.config = config
        self.params = {name: t.detach().cpu().to(torch.float64).clone().requires_grad_(True)
                       for name, t in state.items() if t.is_floating_point()}

    def mamba(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        c, p = self.config, self.params
        n, heads, dim, groups, size = x.shape[0], c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size
        inner = heads * dim
        z, xbc, dt = self.linear(x, prefix + ".in_proj").split([inner, c.conv_dim, heads], dim=-1)
        w, taps = p[prefix + ".conv1d.weight"], p[prefix + ".conv1d.weight"].shape[-1]
        bias = p.get(prefix + ".conv1d.bias")
        xbc = F.silu(F.conv1d(xbc.T[None], w, bias, padding=taps - 1, groups=c.conv_dim)[0, :, :n].T)
        xs, B, C = xbc.split([inner, groups * size, groups * size], dim=-1)
        xs = xs.view(n, heads, dim)
        B = B.view(n, groups, size).repeat_interleave(heads // groups, dim=1)
        C = C.view(n, groups, size).repeat_interleave(heads // groups, dim=1)
        dt = F.softplus(dt + p[prefix + ".dt_bias"]).clamp(*c.time_step_limit)
        A, D = -torch.exp(p[prefix + ".A_log"]), p[prefix + ".D"]
        state, ys = x.new_zeros(heads, dim, size), []
        for t in range(n):
            state = torch.exp(dt[t] * A)[:, None, None] * state + (dt[t][:, None] * xs[t])[..., None] * B[t][:, None]
            ys.append((state * C[t][:, None]).sum(-1) + D[:, None] * xs[t])
        gated = torch.stack(ys).reshape(n, inner) * F.silu(z)
        g = gated.view(n, groups, inner // groups)
        normed = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + c.layer_norm_epsilon)).view(n, inner)
        return self.linear(p[prefix + ".norm.weight"] * normed, prefix + ".out_proj")

    def attention(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        c, n = self.config, x.shape[0]
        q = self.linear(x, prefix + ".q_proj").view(n, c.num_attention_heads, c.head_dim)
        k = self.linear(x, prefix + ".k_proj").view(n, c.num_key_value_heads, c.head_dim)
        v = self.linear(x, prefix + ".v_proj").view(n, c.num_key_value_heads, c.head_dim)
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * c.head_dim ** -0.5
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        o = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1), v)
        return self.linear(o.reshape(n, -1), prefix + ".o_proj")

    def relu2(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return self.linear(torch.relu(self.linear(x, prefix + ".up_proj")) ** 2, prefix + ".down_proj")

    def moe(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        c, p = self.config, self.params
        scores = torch.sigmoid(x @ p[prefix + ".gate.weight"].T)
        choice = scores + p[prefix + ".gate.e_score_correction_bias"]
        per_group = c.n_routed_experts // c.n_group
        group_scores = choice.view(-1, c.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
        kept = torch.zeros_like(group_scores).scatter(1, group_scores.topk(c.topk_group, dim=-1)[1], 1.0).bool()
        choice = choice.masked_fill(~kept.repeat_interleave(per_group, dim=1), float("-inf"))
        chosen = choice.topk(c.num_experts_per_tok, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * c.routed_scaling_factor
        latent = prefix + ".fc1_latent_proj.weight" in p
        h = self.linear(x, prefix + ".fc1_latent_proj") if latent else x
        up, down = p[prefix + ".experts.up_proj"], p[prefix + ".experts.down_proj"]
        routed = torch.zeros_like(h)
        for slot in range(chosen.shape[1]):
            e = chosen[:, slot]
            hidden = torch.relu(torch.einsum("td,tid->ti", h, up[e])) ** 2
            routed = routed + weights[:, slot, None] * torch.einsum("ti,tdi->td", hidden, down[e])
        if latent:
            routed = self.linear(routed, prefix + ".fc2_latent_proj")
        return routed + self.relu2(x, prefix + ".shared_experts")

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab] float64 logits of a whole sequence from position 0."""
        c, p = self.config, self.params
        x = p["model.embeddings.weight"][torch.tensor(tokens, dtype=torch.long)]
        mixers = {"linear_attention": self.mamba, "full_attention": self.attention, "mlp": self.relu2,
                  "moe": self.moe}
        for layer, kind in enumerate(c.layers_block_type):
            prefix = f"model.layers.{layer}"
            x = x + mixers[kind](rms_norm(x, p[prefix + ".norm.weight"], c.layer_norm_epsilon), prefix + ".mixer")
        return rms_norm(x, p["model.norm_f.weight"], c.layer_norm_epsilon) @ p["lm_head.weight"].T
