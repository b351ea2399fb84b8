"""The rollout benchmark's models (random weights) and workloads (random token ids, seeded).

qwen3-30b-a3b-12l is Qwen3-30B-A3B's shape (128 experts, top-8, untied LM head) cut from 48 layers to
12: about 8.1B parameters, 15 GiB in BF16, so one H200 holds it with room for the KV cache.
nemotron-3-nano-13l is NVIDIA-Nemotron-3-Nano-30B-A3B's published shape (hidden 2688; Mamba-2 of 64 heads of 64, 8
groups, state 128, chunk 128; GQA 32 / 2 heads of 128; 128 relu2 experts of 1856, top-6, a shared expert of 3712,
routed_scaling_factor 2.5) with the first 13 layers of its 52-layer pattern (MEMEM*EMEMEM*: 6 Mamba-2, 5 MoE, 2
attention): about 7.4B parameters, 14 GiB in BF16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onepath.models.config import ModelConfig

QWEN3 = dict(model_type="qwen3", vocab_size=151936, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
             rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True,
             eos_token_id=151645)
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# DeepSeek-V4-Flash's config.json (hidden 4096, 64 heads of 512 sharing one KV head, q_lora_rank 1024, o_groups 8 x
# o_lora_rank 1024, 64 indexer heads of 128 picking 512 entries, window 128, CSA at 4 and HCA at 128, mHC with 4
# streams, 256 experts of 2048, 6 routed and one shared, 3 hash layers, vocab 129280)
DEEPSEEK_V4_FLASH = dict(model_type="deepseek_v4", vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048,
                         num_hidden_layers=43, num_attention_heads=64, head_dim=512, q_lora_rank=1024,
                         partial_rotary_factor=64 / 512, num_experts_per_tok=6, n_routed_experts=256,
                         routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", hc_mult=4, hc_sinkhorn_iters=20,
                         sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128,
                         index_topk=512, swiglu_limit=10.0, max_position_embeddings=1048576,
                         compress_rates={CSA: 4, HCA: 128}, eos_token_id=1)
QWEN3_MOE = dict(QWEN3, model_type="qwen3_moe", num_attention_heads=32, num_key_value_heads=4, num_experts=128,
                 num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False)
NEMOTRON_3_NANO = dict(model_type="nemotron_h", vocab_size=131072, hidden_size=2688, intermediate_size=1856,
                       num_attention_heads=32, num_key_value_heads=2, head_dim=128, mamba_num_heads=64,
                       mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, chunk_size=128,
                       n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
                       moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5, norm_topk_prob=True,
                       n_group=1, topk_group=1, layer_norm_epsilon=1e-5, mamba_ssm_cache_dtype="float32",
                       max_position_embeddings=262144, tie_word_embeddings=False, eos_token_id=2)
NEMOTRON_3_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
MODELS = {
    "qwen3-0.6b": dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28),
    "qwen3-1.7b": dict(QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28),
    "tiny": dict(QWEN3, vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=2),
    "qwen3-30b-a3b-12l": dict(QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                              num_hidden_layers=12),
    "tiny-moe": dict(QWEN3_MOE, vocab_size=512, hidden_size=64, intermediate_size=192, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                     num_experts_per_tok=2, eos_token_id=2),
    "nemotron-3-nano-13l": dict(NEMOTRON_3_NANO, hybrid_override_pattern=NEMOTRON_3_NANO_PATTERN[:13]),
    "tiny-hybrid": dict(NEMOTRON_3_NANO, vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                        head_dim=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
                        chunk_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        moe_shared_expert_intermediate_size=64, hybrid_override_pattern="MEM*"),
    # DeepSeek-V4-Flash's layer shapes (onepath/bench/deepseek_v4.py) cut to 4 layers (HCA, CSA, HCA, CSA) and 32
    # experts: about 3.6B parameters, so one GPU holds it with room for the cache
    "deepseek-v4-flash-4l": dict(DEEPSEEK_V4_FLASH, num_hidden_layers=4, n_routed_experts=32,
                                 layer_types=[HCA, CSA, HCA, CSA]),
    "tiny-deepseek-v4": dict(DEEPSEEK_V4_FLASH, vocab_size=512, hidden_size=64, moe_intermediate_size=32,
                             num_hidden_layers=3, num_attention_heads=4, head_dim=32, q_lora_rank=32, o_lora_rank=16,
                             o_groups=2, n_routed_experts=8, num_experts_per_tok=2, index_n_heads=4,
                             index_head_dim=16, index_topk=8, sliding_window=16, hc_mult=2, hc_sinkhorn_iters=5,
                             layer_types=[SLIDING, CSA, HCA], compress_rates={CSA: 4, HCA: 16},
                             max_position_embeddings=8192, eos_token_id=2),
}


def model_config(name: str) -> ModelConfig:
    if name not in MODELS:
        raise ValueError(f"model {name!r} is unknown: use one of {sorted(MODELS)}")
    raw = MODELS[name]
    # a family with a config of its own (Nemotron-H, DeepSeek-V4) is built from its config.json fields
    return ModelConfig.from_dict(raw) if raw["model_type"] in ("nemotron_h", "deepseek_v4") else ModelConfig(**raw)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: int
    prompt_len: tuple[int, int]  # inclusive range, uniform
    output_len: tuple[int, int]

    @property
    def fixed(self) -> bool:
        return self.prompt_len[0] == self.prompt_len[1] and self.output_len[0] == self.output_len[1]

    def scaled(self, requests: int | None, scale: float) -> "Workload":
        """Fewer requests and lengths times `scale` (at least 1 token): the same shape, small enough for a CPU."""
        def length(n: int) -> int:
            return max(1, round(n * scale))
        return Workload(self.name, requests or self.requests, (length(self.prompt_len[0]), length(self.prompt_len[1])),
                        (length(self.output_len[0]), length(self.output_len[1])))

    def sample(self, vocab_size: int, seed: int) -> tuple[list[list[int]], list[int]]:
        """Prompts (random token ids) and output lengths, one per request."""
        g = torch.Generator().manual_seed(seed)
        prompt_lens = torch.randint(self.prompt_len[0], self.prompt_len[1] + 1, (self.requests,), generator=g)
        output_lens = torch.randint(self.output_len[0], self.output_len[1] + 1, (self.requests,), generator=g)
        tokens = torch.randint(0, vocab_size, (int(prompt_lens.sum()),), generator=g)
        return [t.tolist() for t in tokens.split(prompt_lens.tolist())], output_lens.tolist()


# the longest last: a run cut short by a time limit still has the other two
WORKLOADS = {
    "fixed-1000": Workload("fixed-1000", 256, (150, 150), (1000, 1000)),
    "ragged": Workload("ragged", 256, (100, 1024), (100, 1024)),
    "fixed-3000": Workload("fixed-3000", 256, (150, 150), (3000, 3000)),
}


def workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"workload {name!r} is unknown: use one of {sorted(WORKLOADS)}")
    return WORKLOADS[name]
