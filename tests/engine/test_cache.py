"""One way to build a model's cache (model.make_cache): the engine's cache of each model kind holds one block past the
block manager's and, with per-sequence state, the scheduler's slots and one scratch slot past them (`scratch_slot`,
never handed out), which a static decode batch's padding rows take; memory.state_bytes counts exactly the state
tensors the cache holds; the trainer's cache of the same model keeps no state."""
import pytest
import torch

from onepath.engine import memory
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.model_runner import DecodeGraphs
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.batch import SeqChunk
from onepath.models.deepseek_v4_cache import DeepseekV4Cache
from onepath.models.kv_cache import KVCache
from onepath.models.state_cache import HybridCache
from onepath.numerics.quant import FP8Tensor
from tests.models.test_nemotron_h_phases import tiny_model as tiny_hybrid
from tests.tiny import tiny_model
from tests.tiny_deepseek_v4 import onepath_model, transformers_model

BLOCKS, SLOTS, MAX_LEN = 11, 3, 48


def deepseek_v4(quant=None):
    return onepath_model(transformers_model({}), quant=quant)


KINDS = {"dense": (lambda: tiny_model("consistent"), KVCache),
         "hybrid": (tiny_hybrid, HybridCache),
         "deepseek_v4": (deepseek_v4, DeepseekV4Cache),
         "deepseek_v4 fp8_kv": (lambda: deepseek_v4("fp8_kv"), DeepseekV4Cache)}


def state_tensors(cache) -> list:
    """Every tensor of the cache's per-sequence state (one row per slot)."""
    if isinstance(cache, HybridCache):
        states = cache.states
        return [c for c in states.conv if c is not None] + \
            [t for s in states.ssd if s is not None for t in (s.ssm, s.x, s.dt, s.B)]
    if isinstance(cache, DeepseekV4Cache):
        return [t for layer in cache.layers for t in (layer.kv, layer.state, layer.index_state) if t is not None]
    return []


def parts(t) -> tuple[torch.Tensor, ...]:
    return (t.codes, t.scales) if isinstance(t, FP8Tensor) else (t,)


@pytest.mark.parametrize("kind", KINDS)
def test_the_engine_cache_holds_the_scratch_block_and_slot(kind):
    build, cache_type = KINDS[kind]
    model = build()
    engine = LLMEngine(model, num_blocks=BLOCKS, block_size=16, cuda_graphs=False,
                       scheduler=SchedulerConfig(max_model_len=MAX_LEN, max_num_seqs=SLOTS))
    cache, slots = engine.runner.cache, SLOTS if model.has_recurrent_state else 0
    assert type(cache) is cache_type and cache.block_size == 16
    assert cache.num_blocks == engine.block_manager.num_blocks + 1 == BLOCKS + 1
    assert cache.num_slots == slots and cache.scratch_slot == (SLOTS if slots else None)
    assert sorted(engine.scheduler.free_slots) == list(range(slots))  # the scratch slot is never handed out
    states = state_tensors(cache)
    assert bool(states) == bool(slots) and all(p.shape[0] == slots + 1 for t in states for p in parts(t))
    assert sum(p.numel() * p.element_size() for t in states for p in parts(t)) == memory.state_bytes(model, slots)
    assert engine.memory.get("state_slots") == (slots or None)

    graphs = DecodeGraphs(model, cache, BLOCKS, MAX_LEN, [2], capture=False)
    graphs.stage([SeqChunk([5], 3, [4], 1 if slots else None)])  # one live row, one padding row
    assert graphs.scratch_state == cache.scratch_slot
    assert graphs.block_tables[1, 0] == BLOCKS and graphs.slot_mapping[1] == BLOCKS * 16
    if slots:
        assert graphs.state_slots.tolist() == [1, SLOTS]
    else:
        assert graphs.state_slots is None


@pytest.mark.parametrize("kind", KINDS)
def test_the_trainer_cache_keeps_no_state(kind):
    build, cache_type = KINDS[kind]
    model = build()
    cache = model.make_cache(5, 16)
    assert type(cache) is (KVCache if cache_type is HybridCache else cache_type)
    assert cache.num_blocks == 5 and cache.num_slots == 0 and cache.scratch_slot is None
    assert state_tensors(cache) == []


def test_a_dense_cache_refuses_state_slots():
    with pytest.raises(ValueError, match="keeps no state per sequence.*num_slots=0, not 2"):
        tiny_model("consistent").make_cache(4, 16, num_slots=2)
