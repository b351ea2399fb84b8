"""Hugging Face transformers `generate` on the same weights and prompts: the stock reference point.

SDPA attention, left padding, sampling at temperature 1 with top-k and top-p off, and
min_new_tokens = max_new_tokens so every request gets exactly its output length, as ignore_eos
gives the engine. Written against transformers 4.5x and 5.x alike.
"""
from __future__ import annotations

import time

import torch

from onepath.models.config import ModelConfig
from onepath.models.moe import fuse_experts
from onepath.models.nemotron_h import fuse_experts as fuse_hybrid_experts
from onepath.models.nemotron_h import renamed


def hf_model(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str):
    import transformers

    raw = {k: v for k, v in config.to_dict().items()
           if v is not None and k not in ("model_type", "architectures", "torch_dtype", "dtype")}
    if config.model_type == "nemotron_h":  # the hybrid: its limits as floats, its state in transformers' layout
        raw["time_step_limit"] = tuple(config.time_step_limit)
        state = fuse_hybrid_experts(renamed(state, "backbone.", "model."))
    hf_config = transformers.AutoConfig.for_model(config.model_type, **raw)
    with torch.device(device):  # build in place: a 2B-parameter CPU init would take longer than the run
        model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    model.to(device=device, dtype=dtype).eval()
    if any(k.endswith(".mlp.experts.gate_up_proj") for k in model.state_dict()):
        state = fuse_experts(state)  # transformers 5 holds the MoE experts fused; the state is the hub layout
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
        raise ValueError(f"transformers' {type(model).__name__} does not take onepath's weights: missing "
                         f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    return model


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int, seed: int) -> dict:
    """Generate max_new_tokens for every prompt in one batch; wall seconds around the call."""
    device = model.device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention_mask[i, width - len(p):] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    torch.manual_seed(seed)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0,
                         top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         use_cache=True, pad_token_id=pad_token_id)
    _sync(device)
    seconds = time.perf_counter() - start
    generated = (out.shape[1] - width) * len(prompts)
    if out.shape[1] - width != max_new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens per request, asked for "
                           f"{max_new_tokens}: min_new_tokens was not honoured")
    return dict(requests=len(prompts), seconds=seconds, generated_tokens=generated,
                prompt_tokens=sum(len(p) for p in prompts), tokens_per_s=generated / seconds,
                total_tokens_per_s=(generated + sum(len(p) for p in prompts)) / seconds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
