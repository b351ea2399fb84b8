"""What onepath does with each config.json field of a supported family: every field transformers defines
for it (and the few its modeling code reads with getattr) is implemented, refused unless harmless, or
listed here as not changing the math, with the reason. tests/models/test_config_fields.py walks
transformers' own configs against these tables.

IMPLEMENTED  read by ModelConfig and applied as transformers applies it (tested against transformers)
REFUSED      refused at load unless the value is the harmless one given (FAMILY_REFUSED: one family's own;
             a field a family implements is not refused for it: DeepSeek-V4's partial_rotary_factor)
NO_MATH      neither the logits nor the gradients onepath computes depend on it
A field of none of them is not one transformers reads for that family: ignored as transformers ignores
it, with a warning (`unclassified`).
"""
from __future__ import annotations

DENSE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
HYBRID_MODEL_TYPES = ("nemotron_h",)  # Mamba-2 / attention / MLP / MoE layers by pattern (models/nemotron_h.py)

# pad_token_id: the embedding's padding_idx (no value changes; that row's lookups add nothing to its gradient)
SHAPE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
         "pad_token_id")
# rope_parameters (transformers 5); rope_theta and rope_scaling: the names transformers 4 wrote, read by its
# standardisation into rope_parameters, as is a top-level original_max_position_embeddings (rope_scaling.py)
ROPE = ("rope_parameters", "rope_theta", "rope_scaling", "original_max_position_embeddings")
WINDOW = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
       "mlp_only_layers")

IMPLEMENTED: dict[str, tuple[str, ...]] = {
    "llama": SHAPE + ROPE + ("attention_bias", "mlp_bias"),
    "mistral": SHAPE + ROPE + ("sliding_window",),
    "qwen2": SHAPE + ROPE + WINDOW,
    "qwen3": SHAPE + ROPE + WINDOW + ("attention_bias",),
    "qwen2_moe": SHAPE + ROPE + WINDOW + MOE + ("shared_expert_intermediate_size", "qkv_bias"),
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map)
    "qwen3_moe": SHAPE + ROPE + ("use_sliding_window", "sliding_window", "attention_bias") + MOE
                 + ("num_local_experts",),
    # the layer pattern under its three names (hybrid_override_pattern: the published files' "M*-E" string;
    # layer_types: transformers' attribute_map), the Mamba-2 mixer, attention without positional encoding, the
    # relu2 MLP, the sigmoid-routed MoE; mamba_* are the legacy names transformers still reads
    "nemotron_h": ("model_type", "vocab_size", "hidden_size", "layers_block_type", "hybrid_override_pattern",
                   "layer_types", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                   "intermediate_size", "mlp_bias", "layer_norm_epsilon", "mamba_num_heads",
                   "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "use_conv_bias", "chunk_size",
                   "time_step_limit", "mamba_ssm_cache_dtype", "use_bias", "n_routed_experts", "num_local_experts",
                   "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
                   "moe_latent_size", "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob",
                   "mamba_n_groups", "mamba_d_conv", "mamba_conv_bias", "mamba_chunk_size", "mamba_dt_limit"),
}

# DeepSeek-V4 (deepseek_v4.py, deepseek_v4_config.py); intermediate_size and num_local_experts are transformers'
# attribute_map names of moe_intermediate_size and n_routed_experts; the legacy names of published checkpoints
# (compress_ratios, compress_rate_csa / _hca, num_hash_layers, qk_rope_head_dim, rope_scaling) fold into the
# modern fields as transformers' __post_init__ folds them
DEEPSEEK_V4 = ("model_type", "vocab_size", "hidden_size", "moe_intermediate_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank", "num_experts_per_tok",
               "n_routed_experts", "num_local_experts", "scoring_func", "routed_scaling_factor",
               "max_position_embeddings", "rope_theta", "rope_parameters", "partial_rotary_factor", "layer_types",
               "compress_rates", "compress_rope_theta", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "mlp_layer_types",
               "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim",
               "index_topk", "rms_norm_eps", "pad_token_id", "tie_word_embeddings", "mlp_bias",
               "compress_ratios", "compress_rate_csa", "compress_rate_hca", "num_hash_layers", "qk_rope_head_dim",
               "rope_scaling")
IMPLEMENTED["deepseek_v4"] = DEEPSEEK_V4

REFUSED: dict[str, tuple[object, str]] = {
    "hidden_act": ("silu", "the decoders' MLP is SwiGLU; only 'silu' is implemented"),
    "attention_dropout": (0.0, "onepath's trainer applies no dropout (transformers' inference applies none "
                               "either): set it to 0.0"),
    "partial_rotary_factor": (1.0, "the decoders rotate the whole head: remove it from config.json"),
    "quantization_config": (None, "onepath loads unquantised weights and quantises them by its ExecutionSpec "
                                  "(--quant): load the BF16/FP32 checkpoint instead"),
}

NO_MATH: dict[str, str] = {
    "_name_or_path": "where the config was loaded from",
    "architectures": "the class name; model_type picks the decoder",
    "transformers_version": "which transformers wrote the file",
    "dtype": "the storage dtype: the ExecutionSpec's dtype is the compute dtype and the weights are cast to it",
    "torch_dtype": "transformers 4's name for dtype",
    "use_cache": "transformers' generate option; the engine always keeps a paged KV cache",
    "output_attentions": "a transformers forward option (return attention weights)",
    "output_hidden_states": "a transformers forward option (return every layer's hidden states)",
    "return_dict": "a transformers forward option (output as a dataclass)",
    "chunk_size_feed_forward": "the decoder forwards of these families never chunk their MLP by it",
    "is_encoder_decoder": "read by transformers' generate, not by a decoder-only forward",
    "id2label": "labels of a sequence-classification head, not of the causal LM",
    "label2id": "labels of a sequence-classification head, not of the causal LM",
    "problem_type": "the loss of a sequence-classification head, not of the causal LM",
    "initializer_range": "the std of transformers' random init; a checkpoint's weights replace it",
    "bos_token_id": "a token id for the tokenizer and generate; the forward does not read it",
    "eos_token_id": "a stop token for the engine (ModelConfig.eos_token_ids); the forward does not read it",
    "pretraining_tp": "transformers 5's Llama forward no longer reads it",
    "output_router_logits": "adds the router load-balancing loss to transformers' supervised loss; onepath's RL "
                            "loss has none and the logits do not change",
    "router_aux_loss_coef": "the weight of that load-balancing loss (output_router_logits)",
}
# Fields a family's published config.json carries that its transformers config does not define, or that its
# transformers forward does not read
FAMILY_NO_MATH: dict[str, dict[str, str]] = {
    "qwen3_moe": {"max_window_layers": "Qwen3MoeConfig does not define it: with use_sliding_window transformers "
                                       "windows every layer, and so does onepath"},
    "nemotron_h": {
        "num_hidden_layers": "the layer count is the pattern's length; transformers ignores this field (a mismatch "
                             "is warned about)",
        "num_logits_to_keep": "transformers' generate option (logits of the last rows only)",
        "pad_token_id": "a token id for the tokenizer and generate: transformers' NemotronH embedding has no "
                        "padding_idx, so the pad row is trained like any other",
        "use_mamba_kernels": "deprecated in transformers, no effect there",
        "expand": "the mixer's width is mamba_num_heads * mamba_head_dim; transformers does not read expand",
        "mamba_expand": "the legacy name of expand",
        "time_step_min": "the range of transformers' random dt_bias init; a checkpoint's dt_bias replaces it",
        "time_step_max": "the range of transformers' random dt_bias init",
        "time_step_floor": "the floor of transformers' random dt_bias init",
        "mamba_dt_min": "the legacy name of time_step_min", "mamba_dt_max": "the legacy name of time_step_max",
        "mamba_dt_init_floor": "the legacy name of time_step_floor",
        "rescale_prenorm_residual": "scales transformers' random init of out_proj",
        "moe_shared_expert_overlap": "Megatron's schedule of the shared expert beside the routed ones",
        "num_nextn_predict_layers": "multi-token-prediction layers for speculative decoding: transformers builds "
                                    "none and neither does onepath; their mtp.* tensors are skipped at load",
        "mtp_layers_block_type": "the layer kinds of those MTP layers",
        "mtp_hybrid_override_pattern": "the legacy name of mtp_layers_block_type",
    },
    "deepseek_v4": {
        "num_nextn_predict_layers": "the multi-token-prediction layers of the published checkpoint: transformers "
                                    "builds none and neither does onepath (their mtp.* tensors are skipped at load)",
        "topk_method": "DeepSeek's name for its router's selection: transformers' DeepSeek-V4 always ranks the "
                       "scores plus e_score_correction_bias, as onepath does",
        "expert_dtype": "the experts' storage format inside quantization_config, which onepath refuses; alone it "
                        "changes nothing",
    },
}
# A family's own refusals beyond REFUSED: the field's harmless value and why
FAMILY_REFUSED: dict[str, dict[str, tuple[object, str]]] = {
    "nemotron_h": {
        "tie_word_embeddings": (False, "transformers' NemotronH never ties the LM head to the embeddings (its "
                                       "lm_head is its own tensor): set it to false"),
        "sliding_window": (None, "transformers' NemotronH attends to the whole prefix whatever the window; onepath "
                                 "does not guess: set it to null"),
        "attention_bias": (False, "transformers' NemotronH attention has no biases"),
        "mamba_proj_bias": (False, "transformers' NemotronH takes the Mamba projections' bias from use_bias"),
        "residual_in_fp32": (False, "the residual stream stays in the model's dtype, as in transformers' NemotronH"),
        "hidden_dropout": (0.0, "onepath's trainer applies no dropout: set it to 0.0"),
        "mamba_hidden_act": ("silu", "the Mamba-2 conv activation is SiLU (ops/conv1d.py)"),
        "mlp_hidden_act": ("relu2", "the MLP and the experts are relu2 (ops/relu2.py)"),
        "n_shared_experts": (1, "transformers' NemotronH builds one shared expert"),
    },
    "deepseek_v4": {
        "num_key_value_heads": (1, "DeepSeek-V4 reads one shared KV head as K and V; transformers ignores other "
                                   "values"),
        "n_shared_experts": (1, "transformers' DeepSeek-V4 builds one shared expert of moe_intermediate_size"),
        "norm_topk_prob": (True, "DeepSeek-V4 always renormalises the top-k router weights (transformers ignores "
                                 "false)"),
        "attention_bias": (False, "DeepSeek-V4's projections carry no bias (transformers ignores true)"),
        "router_jitter_noise": (0.0, "onepath's router adds no noise, and transformers' DeepSeek-V4 none either"),
    },
}

# transformers' default of a field a config.json may leave out, where it is not ModelConfig's own: an absent
# field reads as transformers reads it (a Mistral file without sliding_window windows at 4096 there)
FAMILY_DEFAULTS: dict[str, dict[str, object]] = {
    "llama": {},
    "mistral": dict(num_key_value_heads=8, max_position_embeddings=131072, sliding_window=4096),
    "qwen2": dict(num_key_value_heads=32, max_position_embeddings=32768, sliding_window=4096),
    "qwen3": dict(num_key_value_heads=32, head_dim=128, max_position_embeddings=32768, sliding_window=4096),
    "qwen2_moe": dict(num_key_value_heads=16, max_position_embeddings=32768, sliding_window=4096, num_experts=60,
                      num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632),
    "qwen3_moe": dict(num_key_value_heads=4, max_position_embeddings=32768, sliding_window=4096, num_experts=128,
                      num_experts_per_tok=8, moe_intermediate_size=768),
    "nemotron_h": {},  # NemotronHConfig's own defaults are transformers'

}


def classify(model_type: str, field: str) -> str | None:
    """"implemented", "refused", "no_math", or None for a field `model_type`'s decoder neither reads nor lists."""
    if field in IMPLEMENTED[model_type]:
        return "implemented"
    if field in REFUSED or field in FAMILY_REFUSED.get(model_type, {}):
        return "refused"
    if field in NO_MATH or field in FAMILY_NO_MATH.get(model_type, {}):
        return "no_math"
    return None


def unclassified(model_type: str, raw: dict) -> list[str]:
    return sorted(k for k in raw if classify(model_type, k) is None)


def refusals(raw: dict) -> list[str]:
    """Why `raw` (a config.json) cannot load: one line per field set to other than its harmless value."""
    family = raw.get("model_type")
    table = {**{f: r for f, r in REFUSED.items() if f not in IMPLEMENTED.get(family, ())},
             **FAMILY_REFUSED.get(family, {})}
    out = []
    for field, (harmless, why) in table.items():
        if field in raw and raw[field] != harmless and not (harmless is None and raw[field] in ({}, None)):
            out.append(f"{field} = {raw[field]!r} is not supported ({why})")
    return out
