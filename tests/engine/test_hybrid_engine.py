"""The engine runs a Nemotron-H hybrid with diff = 0 on the CPU: each running sequence holds a recurrent state slot
beside the paged KV of the attention layers; continuous batching (more requests than slots), chunked prefill cut
off the scan's chunks, preemption by recompute and in-place weight updates all give the log-probs the trainer's
forward recomputes, bit for bit. Baseline mode (the stock scan paths) does not: the negative control. Prefix
caching is refused for the hybrid, with the reason."""
import pytest
import torch

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams, sampling_tensors
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.batch import ForwardBatch
from onepath.models.kv_cache import KVCache
from tests.engine.engines import same
from tests.models.test_nemotron_h_phases import tiny_model

PARAMS = SamplingParams(max_tokens=13, temperature=1.0, seed=3, ignore_eos=True)


def prompts(seed=7, count=7, low=1, high=30):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g)
    return [torch.randint(3, 61, (int(n),), generator=g).tolist() for n in lengths]


def engine(model, num_blocks=64, **scheduler):
    return LLMEngine(model, num_blocks=num_blocks, block_size=16,
                     scheduler=SchedulerConfig(max_model_len=64, **{"max_num_seqs": 3, **scheduler}))


def trainer_logprobs(model, prompts, completions, params=PARAMS):
    """The trainer's recompute: each prompt + completion[:-1] whole, teacher-forced, from position 0."""
    batch, blocks, rows = ForwardBatch.for_completions(prompts, completions, 16)
    with torch.no_grad():
        hidden = model(batch, KVCache.for_model(model, blocks, 16))
        logits = model.compute_logits(hidden[rows])
    tokens = torch.tensor([t for c in completions for t in c])
    temperature, _, _ = sampling_tensors([params] * len(rows), "cpu")
    return list(model.ops.token_logprobs(logits, tokens, temperature)[0].split([len(c) for c in completions]))


def diffs(model, outputs, ps):
    completions = [o.token_ids for o in outputs]
    want = trainer_logprobs(model, ps, completions)
    return [float((torch.tensor(o.logprobs) - w).abs().max()) for o, w in zip(outputs, want)]


def runs(mode):
    model, ps = tiny_model(mode, seed=4), prompts()
    eng = engine(model, prefill_chunk_size=5, max_num_batched_tokens=40)
    outputs = eng.generate(ps, PARAMS)
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in outputs)
    assert eng.scheduler.free_slots and sorted(eng.scheduler.free_slots) == [0, 1, 2]  # every slot came back
    return model, ps, outputs, diffs(model, outputs, ps)


def test_engine_log_probs_are_the_trainer_bits():
    *_, d = runs("consistent")
    assert d == [0.0] * len(d)


def test_baseline_engine_log_probs_differ_from_its_trainer():
    *_, d = runs("baseline")
    assert max(d) > 0


def test_preemption_by_recompute_keeps_the_bits():
    model, ps = tiny_model(seed=4), prompts(count=5, low=20)
    whole = engine(model).generate(ps, PARAMS)
    small = engine(model, num_blocks=6)
    preempted = small.generate(ps, PARAMS)
    assert small.scheduler.num_preemptions > 0
    assert all(same(a, b) for a, b in zip(whole, preempted))
    assert diffs(model, preempted, ps) == [0.0] * len(ps)


def test_prefix_caching_is_refused_for_the_hybrid():
    model = tiny_model()
    with pytest.raises(ValueError, match="prefix caching is not supported for nemotron_h: a cached prefix holds "
                                         "the attention layers' K/V but not the Mamba layers' state"):
        LLMEngine(model, num_blocks=8, enable_prefix_caching=True)
    eng = engine(model)
    assert not eng.block_manager.enable_prefix_caching
    assert eng.memory["state_slots"] == 3 and eng.memory["state_cache_gib"] > 0


def test_weight_updates_in_place_give_the_new_weights_bits():
    old, new = tiny_model(seed=4), tiny_model(seed=9)
    ps = prompts(count=4)
    ids = list(range(len(ps)))  # the sampling keys follow the request ids
    eng = engine(old)
    before = eng.generate(ps, PARAMS, request_ids=ids)
    storage = {n: p.data_ptr() for n, p in old.named_parameters()}
    eng.update_weights(new.named_parameters())
    after = eng.generate(ps, PARAMS, request_ids=ids)
    assert {n: p.data_ptr() for n, p in old.named_parameters()} == storage
    fresh = engine(new).generate(ps, PARAMS, request_ids=ids)
    assert all(same(a, b) for a, b in zip(after, fresh))
    assert not all(same(a, b) for a, b in zip(before, after))
    assert diffs(new, after, ps) == [0.0] * len(ps)
