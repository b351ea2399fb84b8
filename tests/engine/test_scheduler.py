import math

import pytest

from onepath.engine.block_manager import BlockManager
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import Scheduler, SchedulerConfig
from onepath.engine.sequence import Sequence, SequenceStatus

EOS = 1


def fake_sample(seq):
    # a pure function of (request, position): any schedule must give the same tokens
    pos = seq.num_tokens
    return (seq.request_id * 7919 + pos * 104729) % 1000 + 10, -0.001 * pos - seq.request_id


def make(num_blocks=256, block_size=4, **cfg):
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size))


def make_seqs(lengths, max_tokens=8, **params):
    return [Sequence(i, [100 + i + j for j in range(n)], SamplingParams(max_tokens=max_tokens, **params), (EOS,))
            for i, n in enumerate(lengths)]


def check_step(sched, batch):
    cfg, bm = sched.config, sched.block_manager
    assert batch, "schedule() returned nothing while sequences remain"
    assert sum(s.num_tokens for s in batch) <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    assert len({s.seq.request_id for s in batch}) == len(batch)
    for s in batch:
        assert s.seq.status is SequenceStatus.RUNNING and s.num_tokens >= 1
        assert len(s.seq.block_table) * bm.block_size >= s.start + s.num_tokens
        assert s.samples == (s.start + s.num_tokens == s.seq.num_tokens)
        if cfg.prefill_chunk_size:
            assert s.num_tokens <= cfg.prefill_chunk_size
    held = [b for seq in sched.running for b in seq.block_table]
    assert len(held) == len(set(held)) == bm.num_blocks - bm.num_free_blocks
    assert all(not seq.block_table for seq in sched.waiting)


def drive(sched, seqs, sample=fake_sample):
    for seq in seqs:
        sched.add(seq)
    log, finished = [], []
    while not sched.is_finished():
        batch = sched.schedule()
        check_step(sched, batch)
        log.append([(s.seq.request_id, s.start, s.num_tokens, s.samples) for s in batch])
        finished += sched.postprocess(batch, {s.seq.request_id: sample(s.seq) for s in batch if s.samples})
        assert len(log) < 10_000
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks  # no leak
    assert sorted(s.request_id for s in finished) == sorted(s.request_id for s in seqs)
    return log


def outcome(seqs):
    return [(s.token_ids, s.logprobs, s.finish_reason) for s in seqs]


def test_mixed_prefill_and_decode_in_one_step():
    sched = make()
    a, b = make_seqs([5, 6])
    sched.add(a)
    batch = sched.schedule()
    assert [(s.seq, s.start, s.num_tokens, s.samples) for s in batch] == [(a, 0, 5, True)]
    sched.postprocess(batch, {0: fake_sample(a)})
    sched.add(b)
    batch = sched.schedule()
    assert [(s.seq, s.start, s.num_tokens, s.samples) for s in batch] == [(a, 5, 1, True), (b, 0, 6, True)]
    assert list(batch[0].positions) == [5]


def test_only_the_last_chunk_samples():
    sched = make(prefill_chunk_size=7)
    log = drive(sched, make_seqs([20], max_tokens=2))
    assert log == [[(0, 0, 7, False)], [(0, 7, 7, False)], [(0, 14, 6, True)], [(0, 20, 1, True)]]


@pytest.mark.parametrize("budget", [16, 2048])
def test_chunk_sizes_reach_the_same_state(budget):
    lengths = [1, 7, 8, 30, 64, 65, 3]
    ref = make_seqs(lengths)
    ref_log = drive(make(max_num_batched_tokens=2048), ref)
    logs = []
    for chunk in [1, 7, 64, None]:
        seqs = make_seqs(lengths)
        logs.append(drive(make(max_num_batched_tokens=budget, prefill_chunk_size=chunk), seqs))
        assert outcome(seqs) == outcome(ref)
    assert len({len(log) for log in logs + [ref_log]}) > 1  # control: the schedules really differ


def test_token_budget_and_max_num_seqs_bind():
    sched = make(max_num_seqs=3, max_num_batched_tokens=10)
    steps = []
    seqs = make_seqs([4, 9, 2, 13, 5, 1, 6])
    for seq in seqs:
        sched.add(seq)
    while not sched.is_finished():
        batch = sched.schedule()
        check_step(sched, batch)
        steps.append((sum(s.num_tokens for s in batch), len(sched.running)))
        sched.postprocess(batch, {s.seq.request_id: fake_sample(s.seq) for s in batch if s.samples})
    assert max(n for n, _ in steps) == 10 and max(r for _, r in steps) == 3  # control: both limits were reached
    assert all(s.num_completion_tokens == 8 for s in seqs)


def test_preemption_recomputes_and_every_sequence_finishes():
    lengths = [5, 3, 9, 2, 6, 4]
    ref = make_seqs(lengths, max_tokens=10)
    drive(make(), ref)
    seqs = make_seqs(lengths, max_tokens=10)
    sched = make(num_blocks=8, block_size=4, prefill_chunk_size=3)
    drive(sched, seqs)
    assert sched.num_preemptions > 0  # control: the small cache really preempted
    assert outcome(seqs) == outcome(ref)
    assert all(s.num_completion_tokens == 10 and len(s.logprobs) == 10 and s.finish_reason == "length" for s in seqs)


def test_preemption_evicts_the_latest_admitted():
    sched = make(num_blocks=4, block_size=2)
    a, b = make_seqs([3, 3], max_tokens=3)
    log = drive(sched, [a, b])
    # step 3: a needs a third block, none is free, so b (admitted after a) is evicted and waits for a to finish
    assert log[2] == [(0, 4, 1, True)]
    assert log[3] == [(1, 0, 5, True)]  # b recomputes its prompt and its 2 generated tokens, then samples
    assert sched.num_preemptions == 1


def test_victim_is_not_readmitted_in_the_step_that_evicted_it():
    sched = make(num_blocks=4, block_size=2, prefill_chunk_size=2)
    a, b = make_seqs([3, 3], max_tokens=3)
    log = drive(sched, [a, b])
    # step 4: evicting b frees 2 blocks, a takes 1; b's first chunk would fit the other but must wait a step
    assert log[3] == [(0, 4, 1, True)]
    assert log[4] == [(1, 0, 2, False)]
    assert sched.num_preemptions == 1


def test_preemption_may_evict_the_asking_sequence():
    sched = make(num_blocks=4, block_size=2)
    a, b = make_seqs([3, 4], max_tokens=2)
    log = drive(sched, [a, b])
    assert log[1] == [(0, 3, 1, True)]  # b needed a block, was itself the latest admitted, so it stepped back
    assert log[2] == [(1, 0, 5, True)]
    assert sched.num_preemptions == 1
    assert outcome([a, b]) == outcome(drive_ref([3, 4], max_tokens=2))


def drive_ref(lengths, **params):
    seqs = make_seqs(lengths, **params)
    drive(make(), seqs)
    return seqs


def test_same_inputs_same_schedule():
    def run():
        seqs = make_seqs([5, 17, 2, 9, 30, 1], max_tokens=12)
        return drive(make(num_blocks=12, block_size=4, max_num_batched_tokens=20, prefill_chunk_size=8), seqs), seqs
    (log1, seqs1), (log2, seqs2) = run(), run()
    assert log1 == log2 and outcome(seqs1) == outcome(seqs2)


def test_sequence_that_can_never_fit_is_refused():
    sched = make(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match=r"request 0 may need KV for 12 tokens .* cache holds 8"):
        sched.add(make_seqs([3], max_tokens=10)[0])
    seq = make_seqs([3], max_tokens=6)[0]
    drive(sched, [seq])  # 8 tokens of KV at most: fits exactly
    assert seq.num_completion_tokens == 6


def test_prompt_longer_than_max_model_len_is_refused():
    sched = make(max_model_len=8)
    with pytest.raises(ValueError, match=r"prompt length 8 >= max_model_len 8 for request 0"):
        sched.add(make_seqs([8])[0])


def eos_at(k, token=EOS):
    def sample(seq):
        tok, lp = fake_sample(seq)
        return (token, lp) if seq.num_completion_tokens == k - 1 else (tok, lp)
    return sample


def test_eos_stops_and_is_kept():
    seq = make_seqs([4], max_tokens=10)[0]
    drive(make(), [seq], eos_at(3))
    assert seq.finish_reason == "stop" and seq.completion_token_ids[-1] == EOS
    assert seq.num_completion_tokens == 3 and len(seq.logprobs) == 3


def test_ignore_eos_runs_to_max_tokens():
    seq = make_seqs([4], max_tokens=10, ignore_eos=True)[0]
    drive(make(), [seq], eos_at(3))
    assert seq.finish_reason == "length" and seq.num_completion_tokens == 10
    assert seq.completion_token_ids[2] == EOS


def test_stop_token_ids_stop_even_with_ignore_eos():
    seq = make_seqs([4], max_tokens=10, ignore_eos=True, stop_token_ids=(5, 6))[0]
    drive(make(), [seq], eos_at(4, token=6))
    assert seq.finish_reason == "stop" and seq.num_completion_tokens == 4


def test_max_model_len_caps_the_sequence():
    seq = make_seqs([5], max_tokens=100)[0]
    drive(make(max_model_len=8, prefill_chunk_size=2), [seq])
    assert seq.finish_reason == "length" and seq.num_tokens == 8 and seq.num_computed_tokens == 7


def test_abort_waiting_running_and_in_flight():
    sched = make(max_num_seqs=2, prefill_chunk_size=4)
    a, b, c = make_seqs([10, 10, 10])
    for seq in (a, b, c):
        sched.add(seq)
    batch = sched.schedule()
    assert [s.seq for s in batch] == [a, b] and a.block_table
    sched.abort(2)
    sched.abort(0, error="reward server down")
    sched.abort(2)  # already finished: nothing to do
    sched.abort(99)
    assert c.finish_reason == "abort" and a.finish_reason == "error" and a.error == "reward server down"
    assert not a.block_table and a.status is SequenceStatus.FINISHED
    assert sched.postprocess(batch, {}) == []  # a's chunk is dropped, b's is kept
    assert b.num_computed_tokens == 4
    sched.abort(1)
    assert sched.is_finished() and sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_missing_sample_names_the_request():
    sched = make()
    sched.add(make_seqs([3])[0])
    with pytest.raises(KeyError, match="request 0"):
        sched.postprocess(sched.schedule(), {})


def test_duplicate_request_id_is_refused():
    sched = make()
    sched.add(make_seqs([3])[0])
    with pytest.raises(ValueError, match="request 0 is already scheduled"):
        sched.add(make_seqs([3])[0])


def test_sequence_counts():
    seq = make_seqs([3])[0]
    seq.append_token(42, -0.5)
    seq.num_computed_tokens = 3
    assert seq.num_tokens == 4 and seq.num_uncomputed_tokens == 1 and seq.num_completion_tokens == 1
    assert seq.completion_token_ids == [42] and seq.prompt_token_ids == [100, 101, 102] and seq.logprobs == [-0.5]
    with pytest.raises(ValueError, match="request 3 has an empty prompt"):
        Sequence(3, [], SamplingParams())


@pytest.mark.parametrize("settings,kwargs,message", [
    (SamplingParams, dict(temperature=-1.0), "temperature -1.0 "),
    (SamplingParams, dict(temperature=math.nan), "temperature nan "),
    (SamplingParams, dict(top_k=-1), "top_k -1 "),
    (SamplingParams, dict(top_p=0.0), "top_p 0.0 "),
    (SamplingParams, dict(top_p=1.5), "top_p 1.5 "),
    (SamplingParams, dict(max_tokens=0), "max_tokens 0 "),
    (SamplingParams, dict(stop_token_ids=(3, -2)), r"stop_token_ids \(3, -2\) holds \[-2\]"),
    (SamplingParams, dict(stop_token_ids=7), "stop_token_ids 7 "),
    (SamplingParams, dict(ignore_eos=1), "ignore_eos 1 "),
    (SamplingParams, dict(seed=1.5), "seed 1.5 "),
    (SchedulerConfig, dict(max_num_seqs=0), "max_num_seqs 0 "),
    (SchedulerConfig, dict(max_num_batched_tokens=0), "max_num_batched_tokens 0 "),
    (SchedulerConfig, dict(max_model_len=1), "max_model_len 1 "),
    (SchedulerConfig, dict(prefill_chunk_size=0), "prefill_chunk_size 0 "),
])
def test_settings_errors_name_the_value(settings, kwargs, message):
    with pytest.raises(ValueError, match=message):
        settings(**kwargs)


def test_sampling_params_are_hashable_with_a_list_of_stop_ids():
    params = SamplingParams(stop_token_ids=[2, 3], top_k=50, top_p=0.9)
    assert params.stop_token_ids == (2, 3) and hash(params) == hash(SamplingParams(stop_token_ids=(2, 3), top_k=50,
                                                                                  top_p=0.9))


def test_short_prefill_chunks_end_on_the_alignment():
    bm = BlockManager(64, 16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=40, max_model_len=256, chunk_align=16), bm)
    seq = Sequence(0, list(range(3, 103)), SamplingParams(max_tokens=2))
    sched.add(seq)
    ends = []
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        (s,) = sched.schedule()
        ends.append(s.start + s.num_tokens)
        sched.postprocess([s], {0: (5, -1.0)} if s.samples else {})
    assert ends == [32, 64, 100]   # the last chunk reaches the end of the prompt: no cut


def test_runner_sampling_keys_are_sample_key_of_seed_request_and_position():
    """The runner derives keys from each sequence's cached request key: the same keys as
    sample_key(seed, request id, position), for any seed and id (negative, past 64 bits)."""
    from onepath.engine.model_runner import ModelRunner
    from onepath.ops.sampling import sample_key

    seqs = [Sequence(rid, list(range(3, 3 + n)), SamplingParams(seed=seed))
            for rid, n, seed in ((0, 1, 0), (7, 5, -3), (2 ** 70 + 5, 17, 2 ** 66 + 1), (-9, 2, 12345))]
    seqs[1].append_token(11, -0.5)
    assert ModelRunner.sample_keys(seqs) == [sample_key(s.params.seed, s.request_id, s.num_tokens) for s in seqs]
    assert len(set(ModelRunner.sample_keys(seqs))) == len(seqs)
