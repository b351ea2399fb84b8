"""KV-cache sizing from a GPU memory fraction, and the engine's memory report.

As in vLLM: one profiling forward at the scheduler's largest step (max_num_batched_tokens tokens,
then the LM head and the sampler over max_num_seqs rows) measures the activation peak; the cache
gets what is left of `gpu_memory_utilization` x the device's memory once the memory in use now
(weights, other processes), that peak and a hybrid model's recurrent state slots (one per running
sequence, models/state_cache.py) are taken out.
"""
from __future__ import annotations

import torch

from onepath.engine.scheduler import SchedulerConfig
from onepath.models.batch import ForwardBatch
from onepath.models.dense import DenseDecoder
from onepath.models.kv_cache import KVCache
from onepath.ops.sampling import sample_key

GIB = 1 << 30


@torch.no_grad()
def activation_peak(model: DenseDecoder, config: SchedulerConfig, block_size: int) -> int:
    """Bytes the largest step allocates above what is allocated now (its own K/V included)."""
    device = model.device
    tokens = config.max_num_batched_tokens
    length = config.max_model_len - 1
    lengths = [length] * (tokens // length) + ([tokens % length] if tokens % length else [])
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    batch, num_blocks = ForwardBatch.for_sequences([[0] * n for n in lengths], block_size, device)
    cache = model.make_cache(num_blocks, block_size)
    hidden = model(batch, cache)
    rows = min(config.max_num_seqs, hidden.shape[0])
    logits = model.compute_logits(hidden[:rows])
    temperature = torch.ones(rows, device=device)
    # the engine's sampler with a top-k / top-p mask: its sort is the step's largest temporary
    keep = model.ops.sampling_mask(logits, temperature, torch.full((rows,), 50, device=device),
                                   torch.full((rows,), 0.9, device=device))
    model.ops.sample_with_logprobs(logits, temperature, [sample_key(0, i, 0) for i in range(rows)], keep)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def state_bytes(model: DenseDecoder, state_slots: int) -> int:
    """The per-sequence state of `state_slots` running sequences and the scratch slot (a hybrid's recurrent state,
    DeepSeek-V4's rings; 0 without state slots)."""
    return (state_slots + 1) * model.cache_bytes_per_slot() if state_slots else 0


def kv_blocks_for(model: DenseDecoder, config: SchedulerConfig, block_size: int, utilization: float,
                  state_slots: int = 0) -> int:
    """KV-cache blocks that fit in `utilization` of the device's memory next to the model, its peak step and
    its recurrent state slots."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization {utilization} must be in (0, 1], e.g. 0.9")
    device = model.device
    peak = activation_peak(model, config, block_size)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # the scheduler's state slots and the scratch slot the padding rows of captured graphs use (ModelRunner)
    budget = total * utilization - (total - free) - peak - state_bytes(model, state_slots)
    per_block = model.cache_bytes_per_token(block_size) * block_size
    blocks = int(budget // per_block)
    needed = -(-config.max_model_len // block_size)
    if blocks < needed:
        raise ValueError(f"gpu_memory_utilization {utilization} leaves {max(budget, 0) / GIB:.2f} GiB for the KV "
                         f"cache ({total / GIB:.1f} GiB device, {(total - free) / GIB:.1f} GiB in use, "
                         f"{peak / GIB:.2f} GiB step peak): one sequence of max_model_len {config.max_model_len} "
                         f"needs {needed * per_block / GIB:.2f} GiB; raise the fraction or lower max_model_len "
                         "or max_num_batched_tokens")
    return blocks


def report(model: DenseDecoder, cache: KVCache, utilization: float | None) -> dict:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = model.cache_bytes_per_token(cache.block_size)
    out = {"weights_gib": weights / GIB, "kv_cache_gib": per_token * cache.num_blocks * cache.block_size / GIB,
           "num_blocks": cache.num_blocks - 1, "block_size": cache.block_size, "kv_bytes_per_token": per_token,
           "kv_tokens": (cache.num_blocks - 1) * cache.block_size}
    if cache.num_slots:
        out.update(state_cache_gib=state_bytes(model, cache.num_slots) / GIB, state_slots=cache.num_slots)
    if model.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(model.device)
        out.update(gpu_memory_utilization=utilization, device_gib=total / GIB, in_use_gib=(total - free) / GIB)
    return out
