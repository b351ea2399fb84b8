"""The engine runs a Nemotron-H hybrid with diff = 0 on the CPU: each running sequence holds a recurrent state slot
beside the paged KV of the attention layers; continuous batching (more requests than slots), chunked prefill cut
off the scan's chunks, preemption by recompute and in-place weight updates all give the log-probs the trainer's
forward recomputes, bit for bit. Baseline mode (the stock scan paths) does not: the negative control. Prefix
caching is refused for the hybrid, with the reason. The CUDA-graph decode path, run eagerly on the CPU (static
buffers, the slots and positions on the device, padding rows in a scratch slot) gives the eager steps' bits, before
and after an in-place weight update."""
import pytest
import torch

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.model_runner import DecodeGraphs
from onepath.engine.sampling_params import SamplingParams, sampling_tensors
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.batch import ForwardBatch
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
        hidden = model(batch, model.make_cache(blocks, 16))
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


def static_decode(model, ps, params, padded: bool, update=None):
    """The engine eager, or with decode steps on the static buffers of DecodeGraphs (padded to 2, 4 or 8 rows, run
    eagerly: a captured graph replays exactly this forward); with `update`, a second generate after update_weights."""
    eng = engine(model, num_blocks=128, max_num_seqs=6)
    if padded:
        runner = eng.runner
        runner.graphs = DecodeGraphs(model, runner.cache, eng.block_manager.num_blocks, 64, [2, 4, 8], capture=False)
    ids = list(range(len(ps)))
    outs = eng.generate(ps, params, request_ids=ids)
    if update is not None:
        eng.update_weights(update.named_parameters())
        outs = eng.generate(ps, params, request_ids=ids)
    assert (eng.stats.graph_steps > 10) == padded
    return outs


def static_params(count):
    return [SamplingParams(max_tokens=13, seed=i, ignore_eos=True) for i in range(count)]


def test_static_decode_buffers_give_the_eager_bits():
    model, ps = tiny_model(seed=4), prompts(count=9)
    ps[2] = ps[2][:1]  # a one-token prompt decodes its first token at position 0 (a fresh slot)
    params = static_params(len(ps))
    eager, padded = (static_decode(model, ps, params, p) for p in (False, True))
    assert all(same(a, b) for a, b in zip(eager, padded))
    assert diffs(model, padded, ps) == [0.0] * len(ps)


def test_negative_control_static_decode_baseline():
    model, ps = tiny_model("baseline", seed=4), prompts(count=9)
    params = static_params(len(ps))
    eager, padded = (static_decode(model, ps, params, p) for p in (False, True))
    assert not all(same(a, b) for a, b in zip(eager, padded))


def test_static_decode_after_an_in_place_update_gives_the_new_weights_bits():
    old, new, ps = tiny_model(seed=4), tiny_model(seed=9), prompts(count=6)
    params = static_params(len(ps))
    after = static_decode(old, ps, params, True, update=new)
    fresh = static_decode(new, ps, params, False)
    assert all(same(a, b) for a, b in zip(after, fresh))
    assert diffs(new, after, ps) == [0.0] * len(ps)
