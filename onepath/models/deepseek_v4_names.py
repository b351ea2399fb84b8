"""DeepSeek-V4 tensor names: DeepSeek's checkpoint layout <-> transformers' (and onepath's) module names.

A published checkpoint names its tensors as DeepSeek's reference code does (`layers.3.attn.wq_a.weight`,
`layers.3.ffn.experts.7.w1.weight`, `embed.weight`, `head.weight`, `hc_head_fn`); transformers' save_pretrained
writes the same layer names under `model.` (`model.layers.3.attn.wq_a.weight`), keeps `model.embed_tokens`,
`model.norm` and `model.hc_head.*`, and writes `head.weight`. from_pretrained renames them to its modules. Here
both directions are one table, LAYER, of a layer's tensors; the experts are split per expert on disk and
stacked in memory ([E, 2I, H] gate | up, [E, H, I] down), as models/moe.py holds them.
"""
from __future__ import annotations

import re

import torch

LAYER = {
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"{hc}_hc.{part}": f"hc_{hc}_{part}" for hc in ("attn", "ffn") for part in ("fn", "base", "scale")},
    **{f"mlp.shared_experts.{proj}.{kind}": f"ffn.shared_experts.{w}.{kind}"
       for proj, w in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3")) for kind in ("weight", "bias")},
}
FROM_DISK = {disk: memory for memory, disk in LAYER.items()}
# top-level tensors: memory name -> (the name transformers writes, DeepSeek's own)
TOP = {"model.embed_tokens.weight": ("model.embed_tokens.weight", "embed.weight"),
       "model.norm.weight": ("model.norm.weight", "norm.weight"),
       "lm_head.weight": ("head.weight", "head.weight"),
       **{f"model.hc_head.hc_{p}": (f"model.hc_head.hc_{p}", f"hc_head_{p}") for p in ("fn", "base", "scale")}}
TOP_FROM_DISK = {name: memory for memory, names in TOP.items() for name in names}
LAYER_KEY = re.compile(r"(?:model\.)?layers\.(\d+)\.(.+)")
EXPERT_KEY = re.compile(r"ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight")
FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory names -> the layout transformers' save_pretrained writes."""
    out = {}
    for name, tensor in state.items():
        m = LAYER_KEY.fullmatch(name)
        if m is None:
            out[TOP.get(name, (name,))[0]] = tensor
            continue
        prefix, rest = f"model.layers.{m[1]}.", m[2]
        if rest == "mlp.experts.gate_up_proj":
            for e, (w1, w3) in enumerate(zip(*tensor.chunk(2, dim=1))):
                out[f"{prefix}ffn.experts.{e}.w1.weight"] = w1.clone()
                out[f"{prefix}ffn.experts.{e}.w3.weight"] = w3.clone()
        elif rest == "mlp.experts.down_proj":
            for e, w2 in enumerate(tensor):
                out[f"{prefix}ffn.experts.{e}.w2.weight"] = w2.clone()
        else:
            out[prefix + LAYER.get(rest, rest)] = tensor
    return out


def from_checkpoint(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """DeepSeek's names (with or without model.), transformers' or in-memory ones -> in-memory names; the
    multi-token-prediction layers (mtp.*, which transformers does not build either) are left out."""
    out, experts = {}, {}
    for name, tensor in state.items():
        if name.startswith(("mtp.", "model.mtp.")):
            continue
        m = LAYER_KEY.fullmatch(name)
        if m is None:
            out[TOP_FROM_DISK.get(name, name)] = tensor
            continue
        layer, rest = int(m[1]), m[2]
        e = EXPERT_KEY.fullmatch(rest)
        if e:
            experts.setdefault(layer, {})[int(e[1]), e[2]] = tensor
        else:
            out[f"model.layers.{layer}.{FROM_DISK.get(rest, rest)}"] = tensor
    for layer, parts in experts.items():
        n = config.n_routed_experts
        missing = [f"layers.{layer}.ffn.experts.{i}.{w}.weight" for i in range(n) for w in ("w1", "w2", "w3")
                   if (i, w) not in parts]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} expert tensors, first {missing[:3]}: every one of "
                             f"n_routed_experts = {n} experts needs w1, w2 and w3")
        stacked = {w: torch.stack([parts[i, w] for i in range(n)]) for w in ("w1", "w2", "w3")}
        out[f"model.layers.{layer}.{FUSED[0]}"] = torch.cat([stacked["w1"], stacked["w3"]], dim=1)
        out[f"model.layers.{layer}.{FUSED[1]}"] = stacked["w2"]
    return out
