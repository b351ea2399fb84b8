"""Tiny random models and prompts shared by the engine and trainer tests."""
import torch

from onepath.models import build_decoder
from onepath.models.config import ModelConfig
from onepath.models.dense import DenseDecoder
from onepath.numerics.spec import OPS, ExecutionSpec, OpSpec
from onepath.ops import Ops

VOCAB, EOS = 53, 2


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=136, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, model_type="qwen3",
                  max_position_embeddings=256, eos_token_id=EOS, tie_word_embeddings=False)
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_model(mode: str, seed: int = 0, std: float = 0.15, device: str = "cpu", max_positions: int = 256,
               quant: str | None = None, **overrides) -> DenseDecoder:
    """A random model with weights large enough that its distributions are far from uniform."""
    spec = ExecutionSpec.default(mode, device, quant=quant)
    model = DenseDecoder(tiny_config(**overrides), Ops(spec), max_positions=max_positions)
    model.init_weights(seed, std=std)
    return model


def tiny_moe_config(**overrides) -> ModelConfig:
    fields = dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                  intermediate_size=72, norm_topk_prob=True)
    fields.update(overrides)
    return tiny_config(**fields)


def tiny_moe_model(mode: str, seed: int = 0, std: float = 0.15, dtype: str = "float32", quant: str | None = None,
                   **overrides):
    """A random Qwen3-MoE-style model (8 experts, top-2) in `dtype` with FP32 log-probs; `quant` presets."""
    ops = {name: OpSpec(dtype=dtype if name != "logprobs" else "float32") for name in OPS}
    spec = ExecutionSpec(mode=mode, ops=ops)
    for preset in quant.split("+") if quant else ():
        spec = spec.with_quant(preset)
    model = build_decoder(tiny_moe_config(**overrides), Ops(spec), max_positions=256)
    model.init_weights(seed, std=std)
    return model


def random_prompts(gen: torch.Generator, count: int, low: int = 1, high: int = 40) -> list[list[int]]:
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def randomize(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Random values in every tensor of a (transformers) model: norms around 1, biases around 0, weights
    of unit-scale rows, so a swapped, skipped or mis-broadcast tensor shows in the logits (transformers
    inits norms to 1 and biases to 0, and std 0.02 leaves attention near uniform)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
    return model
