"""The engine's generate() under young_collections_only: no full collection inside, young ones go on, and the
caller's thresholds and frozen objects are as they were after it. Controls: outside the block the same
allocations run a full collection; before and after generate() the threshold is the caller's."""
import gc
import weakref

from onepath.engine.llm_engine import NO_FULL_COLLECTIONS, LLMEngine, young_collections_only
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from tests.tiny import random_prompts, tiny_model


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def _engine():
    return LLMEngine(tiny_model("consistent"), num_blocks=64, block_size=16,
                     scheduler=SchedulerConfig(max_model_len=128))


def test_generate_steps_without_full_collections(monkeypatch):
    import torch
    engine = _engine()
    seen = []
    step = LLMEngine.step

    def probe(self):
        seen.append(gc.get_threshold())
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", probe)
    before = gc.get_threshold()
    assert before[2] != NO_FULL_COLLECTIONS, "control: the lifted threshold is already set outside generate()"
    prompts = random_prompts(torch.Generator().manual_seed(0), 3)
    outs = engine.generate(prompts, SamplingParams(max_tokens=4, seed=1))
    assert all(len(o.token_ids) == 4 for o in outs)
    assert seen and all(t == (*before[:2], NO_FULL_COLLECTIONS) for t in seen), f"thresholds in steps: {seen[:3]}"
    assert gc.get_threshold() == before, "generate() did not restore the thresholds"


def test_block_collects_young_cycles_and_nests():
    before = gc.get_threshold()
    with young_collections_only():
        young = Node()
        young_ref = weakref.ref(young)
        del young
        gc.collect()
        assert young_ref() is None, "a cycle made inside the block was not collected inside it"
        with young_collections_only():
            assert gc.get_threshold()[2] == NO_FULL_COLLECTIONS
        assert gc.get_threshold()[2] == NO_FULL_COLLECTIONS, "an inner block's exit restored the outer one's lift"
    assert gc.get_threshold() == before


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


def test_no_full_collection_inside_the_block_even_with_objects_frozen():
    """The H200's Python 3.12 had objects frozen before any block (375 of them); the first form of the block
    stood aside then, and full collections fell inside it. Here the caller freezes some first."""
    n = 2_000_000
    gc.collect()
    outside = _collections_while_keeping(n)
    assert 2 in outside, f"control: {n} kept containers ran no full collection outside the block ({set(outside)})"
    before = gc.get_threshold()
    for freeze_first in (False, True):
        if freeze_first:
            gc.freeze()
        try:
            frozen = gc.get_freeze_count()
            with young_collections_only():
                inside = _collections_while_keeping(n)
            # (a frozen object may still die by its reference count, so not an exact count)
            assert (gc.get_freeze_count() > 0) == (frozen > 0), "the block froze or unfroze objects"
        finally:
            gc.unfreeze()
        assert 0 in inside, "the young collections stopped inside the block"
        assert 2 not in inside, f"a full collection ran inside the block (caller froze first: {freeze_first})"
        assert gc.get_threshold() == before, "thresholds not restored"
