"""The engine's generate() under young_objects_gc: no full collection inside, the young ones skip the objects
alive at entry (frozen), and everything is collectable again after; a caller's own freeze and thresholds are left
as they were. Before and after generate() nothing is frozen (the probe's control); outside the block the same
allocations run a full collection (the threshold test's control)."""
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


def _collections_while_keeping(n: int) -> list[int]:
    """The generations of the automatic collections that run while n new containers are made and kept."""
    seen = []

    def record(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    try:
        kept = [[] for _ in range(n)]
    finally:
        gc.callbacks.remove(record)
    del kept
    return seen


def test_no_full_collection_inside_the_block_and_thresholds_restored():
    n = 2_000_000
    gc.collect()
    outside = _collections_while_keeping(n)
    assert 2 in outside, f"control: {n} kept containers ran no full collection outside the block ({set(outside)})"
    before = gc.get_threshold()
    with young_objects_gc():
        inside = _collections_while_keeping(n)
        caller = gc.get_threshold()
    assert 0 in inside, "the young collections stopped inside the block"
    assert 2 not in inside, "a full collection ran inside the block"
    assert caller[:2] == before[:2] and gc.get_threshold() == before, "thresholds not kept / restored"
    gc.freeze()
    try:
        with young_objects_gc():
            assert gc.get_threshold() == before, "the block changed a freezing caller's thresholds"
    finally:
        gc.unfreeze()
