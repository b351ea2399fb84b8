"""Tiny random models and prompts shared by the engine and trainer tests."""
import torch

from onepath.models.config import ModelConfig
from onepath.models.dense import DenseDecoder
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops

VOCAB, EOS = 53, 2


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=136, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, model_type="qwen3",
                  max_position_embeddings=256, eos_token_id=EOS, tie_word_embeddings=False)
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_model(mode: str, seed: int = 0, std: float = 0.15, device: str = "cpu", max_positions: int = 256,
               **overrides) -> DenseDecoder:
    """A random model with weights large enough that its distributions are far from uniform."""
    model = DenseDecoder(tiny_config(**overrides), Ops(ExecutionSpec.default(mode, device)), max_positions=max_positions)
    model.init_weights(seed, std=std)
    return model


def random_prompts(gen: torch.Generator, count: int, low: int = 1, high: int = 40) -> list[list[int]]:
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]
