"""Small random DeepSeek-V4 models shared by the DeepSeek-V4 tests: transformers' module with random weights, onepath's
decoder loaded from it, and the forward of both."""
from dataclasses import replace

import torch
from torch import nn
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4

from onepath.models import build_decoder
from onepath.models.batch import ForwardBatch
from onepath.models.config import ModelConfig
from onepath.ops import ExecutionSpec, Ops
from tests import tiny

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
TINY = dict(vocab_size=61, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
            head_dim=16, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=4, layer_types=[SLIDING, CSA, HCA],
            compress_rates={CSA: 4, HCA: 8}, hc_mult=2, sliding_window=8, o_groups=2, o_lora_rank=8,
            index_n_heads=4, index_head_dim=8, index_topk=3, mlp_layer_types=["hash_moe", "moe", "moe"],
            partial_rotary_factor=0.5, max_position_embeddings=256)
LENGTHS = (1, 9, 23, 40)
MAX_POSITIONS = 64
BLOCK = 16


def randomize(model: nn.Module, seed: int = 1) -> nn.Module:
    """tests.tiny.randomize's values in every parameter (sinks, position biases and mHC scales included, which
    transformers' init leaves degenerate), a hash table of distinct experts per token, a non-zero router bias."""
    tiny.randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(experts, generator=g)[:b.shape[1]] for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


def ties_to_larger_position(monkeypatch):
    """transformers leaves the indexer's ties to torch.topk (ReLU scores tie at exactly 0); the contract gives them
    to the larger position. Adding position * 1e-30 to its scores breaks exact ties so, and moves no other one."""
    forward = modeling_deepseek_v4.DeepseekV4IndexerScorer.forward

    def scored(self, *args):
        out = forward(self, *args)
        return out + torch.arange(out.shape[-1], dtype=out.dtype) * 1e-30
    monkeypatch.setattr(modeling_deepseek_v4.DeepseekV4IndexerScorer, "forward", scored)


def softmax_scoring(monkeypatch):
    """transformers' ACT2FN has no "softmax" (its DeepSeek-V4 router fails to build with it): the test gives it
    the router's softmax over the experts."""
    monkeypatch.setitem(modeling_deepseek_v4.ACT2FN, "softmax", (nn.Softmax, {"dim": -1}))


def transformers_model(edits: dict, seed: int = 1) -> DeepseekV4ForCausalLM:
    config = DeepseekV4Config(**{**TINY, **edits})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return randomize(DeepseekV4ForCausalLM(config).eval(), seed)


def sequences(vocab: int, lengths=LENGTHS, seed: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def transformers_logits(hf, seqs) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])


def spec(mode: str = "consistent", quant: str | None = None, dtype: str = "float32") -> ExecutionSpec:
    """The CPU's FP32 spec, or (bfloat16) the GPU's default spec (BF16, its tiles) run on the CPU."""
    if dtype == "float32":
        return ExecutionSpec.default(mode, quant=quant)
    return replace(ExecutionSpec.default(mode, "cuda", quant=quant), device="cpu")


def onepath_model(hf, mode: str = "consistent", quant: str | None = None, max_positions: int = MAX_POSITIONS,
                  dtype: str = "float32"):
    config = ModelConfig.from_dict(hf.config.to_dict())
    model = build_decoder(config, Ops(spec(mode, quant, dtype)), max_positions=max_positions)
    model.load_hf_state_dict(hf.state_dict())
    return model


def onepath_logits(model, seqs) -> torch.Tensor:
    batch, num_blocks = ForwardBatch.for_sequences(seqs, BLOCK)
    with torch.no_grad():
        return model.compute_logits(model(batch, model.make_cache(num_blocks, BLOCK)))
