"""The engine's generate() under young_objects_gc: full collections inside skip the objects alive at entry
(frozen), and everything is collectable again after; a caller's own freeze is left as it was. Before and
after generate() nothing is frozen (the probe's control)."""
import gc
import weakref

from onepath.engine.llm_engine import LLMEngine, young_objects_gc
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from tests.tiny import random_prompts, tiny_model


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def _engine():
    return LLMEngine(tiny_model("consistent"), num_blocks=64, block_size=16,
                     scheduler=SchedulerConfig(max_model_len=128))


def test_generate_freezes_the_old_objects_and_returns_them(monkeypatch):
    import torch
    engine = _engine()
    seen = []
    step = LLMEngine.step

    def probe(self):
        seen.append(gc.get_freeze_count())
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", probe)
    old = Node()
    old_ref = weakref.ref(old)
    assert gc.get_freeze_count() == 0
    prompts = random_prompts(torch.Generator().manual_seed(0), 3)
    outs = engine.generate(prompts, SamplingParams(max_tokens=4, seed=1))
    assert all(len(o.token_ids) == 4 for o in outs)
    assert seen and min(seen) > 0, f"freeze counts during the steps: {seen[:5]}"
    assert gc.get_freeze_count() == 0, "generate() left objects frozen"
    del old
    gc.collect()
    assert old_ref() is None, "an object alive at generate()'s entry is not collectable after it"


def test_block_collects_young_cycles_and_keeps_a_callers_freeze():
    with young_objects_gc():
        young = Node()
        young_ref = weakref.ref(young)
        del young
        gc.collect()
        assert young_ref() is None, "a cycle made inside the block was not collected inside it"
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with young_objects_gc():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen, "the block unfroze the caller's objects"
    finally:
        gc.unfreeze()
