"""The small engine the engine tests run, and the bitwise comparison of two of its outputs."""
import torch

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig


def engine(model, num_blocks: int = 128, enable_prefix_caching: bool | None = None, **scheduler) -> LLMEngine:
    """enable_prefix_caching None: the engine's default (on, off for a model with per-sequence state)."""
    return LLMEngine(model, num_blocks=num_blocks, block_size=16, enable_prefix_caching=enable_prefix_caching,
                     scheduler=SchedulerConfig(max_model_len=128, **scheduler))


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


def chunking_runs(model, prompts: list[list[int]], params: SamplingParams, chunks: tuple[int, ...],
                  small_cache: int) -> list[bool]:
    """Whether the outputs equal the whole prefill's with prefill chunks of each size, and with a cache of
    small_cache blocks, so tiny that it preempts (the victims' tokens are recomputed by a fresh prefill)."""
    ids = list(range(len(prompts)))
    whole = engine(model).generate(prompts, params, request_ids=ids)
    runs = [engine(model, prefill_chunk_size=c).generate(prompts, params, request_ids=ids) for c in chunks]
    small = engine(model, num_blocks=small_cache)
    runs.append(small.generate(prompts, params, request_ids=ids))
    assert small.scheduler.num_preemptions > 0
    return [all(same(a, b) for a, b in zip(whole, run)) for run in runs]
