"""The backward through router and experts is correct: the gradients of a sparse block (both expert
layouts, Qwen2-MoE's gated shared expert) equal a float64 plain-torch implementation's, and the
whole model's gradients equal transformers' Qwen3-MoE run in float64. Top-k selection has no
gradient; it flows through the selected (renormalised) router probabilities."""
import pytest
import torch
import torch.nn.functional as F

from onepath.models.batch import ForwardBatch
from onepath.models.config import ModelConfig
from onepath.models.kv_cache import KVCache
from tests.tiny import tiny_moe_model
from tests.models.test_moe_vs_transformers import hf_model, ours, sequences

RTOL, ATOL = 1e-4, 1e-6  # FP32 against float64: a few ulps of each term, summed


def reference_block(x, gate, gate_up, down, k, normalize, shared=None):
    """The sparse block in plain float64 torch: softmax, top-k, every (token, slot) pair's expert by einsum."""
    probs = torch.softmax(x @ gate.T, dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    g, u = torch.einsum("th,tkih->tki", x, gate_up[experts]).chunk(2, dim=-1)
    y = torch.einsum("tki,tkhi->tkh", F.silu(g) * u, down[experts])
    out = (weights.unsqueeze(-1) * y).sum(1)
    if shared is not None:
        s_gate, s_up, s_down, s_router = shared
        out = out + torch.sigmoid(x @ s_router.T) * ((F.silu(x @ s_gate.T) * (x @ s_up.T)) @ s_down.T)
    return out, experts


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_block_gradients_match_float64_reference(kind, layout):
    extra = dict(shared_expert_intermediate_size=24, norm_topk_prob=False) if kind == "qwen2_moe" else {}
    block = tiny_moe_model("consistent", seed=1, model_type=kind, **extra).model.layers[0].mlp
    block.layout = layout
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 48, generator=g, requires_grad=True)
    cotangent = torch.randn(37, 48, generator=g)
    (block(x) * cotangent).sum().backward()
    params = [block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]
    shared = None
    if kind == "qwen2_moe":
        se = block.shared_expert
        shared = [se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight, block.shared_expert_gate.weight]
        params += shared
    leaves = [p.detach().double().requires_grad_() for p in [x] + params]
    out, experts = reference_block(leaves[0], *leaves[1:4], block.gate.k, block.gate.normalize,
                                   leaves[4:] if shared else None)
    with torch.no_grad():
        assert torch.equal(experts, block.gate(x)[1]), "the float64 reference routed differently"
    (out * cotangent.double()).sum().backward()
    for ours_, ref in zip([x] + params, leaves):
        assert ours_.grad is not None and ours_.grad.abs().sum() > 0
        torch.testing.assert_close(ours_.grad, ref.grad.float(), rtol=RTOL, atol=ATOL)


def test_model_gradients_match_transformers_in_float64():
    # the eager experts loop runs in float64 (the default grouped_mm does not)
    ref = hf_model("qwen3_moe_normalised", experts_implementation="eager")
    model = ours(ModelConfig.from_dict(ref.config.to_dict()), ref.state_dict())
    ref.double()
    seqs = sequences(ref.config.vocab_size)
    g = torch.Generator().manual_seed(3)
    cotangents = [torch.randn(len(s), ref.config.vocab_size, generator=g) for s in seqs]
    sum(((ref(torch.tensor([s])).logits[0]) * c.double()).sum() for s, c in zip(seqs, cotangents)).backward()
    batch, num_blocks = ForwardBatch.for_sequences(seqs, 16)
    logits = model.compute_logits(model(batch, KVCache(model.config, num_blocks, 16, torch.float32)))
    (logits * torch.cat(cotangents)).sum().backward()
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        scale = want[name].grad.abs().max().item()
        torch.testing.assert_close(p.grad, want[name].grad.float(), rtol=RTOL, atol=1e-5 * scale,
                                   msg=lambda m: f"{name}: {m}")
