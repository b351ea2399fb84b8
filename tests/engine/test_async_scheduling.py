"""Async scheduling: a decode step is scheduled and launched before the previous step's tokens reach
the host. The host holds placeholders and the runner feeds those rows from the device, so every
request must get the tokens, log-probs and finish reason it gets when each step waits for the last.
The workload stops requests by EOS (seen one step late), by max_tokens and by max_model_len, admits
requests while others decode, preempts, and hits the prefix cache."""
import pytest
import torch

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.model_runner import Feed
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from tests.tiny import VOCAB, random_prompts, tiny_model

EOS = tuple(range(3, 3 + VOCAB // 10))  # about one token in ten stops a request


def workload(seed: int = 4):
    gen = torch.Generator().manual_seed(seed)
    shared = random_prompts(gen, 1, low=40, high=40)[0]
    prompts = [shared + p if i % 3 == 0 else p for i, p in enumerate(random_prompts(gen, 24, low=1, high=50))]
    params = [SamplingParams(max_tokens=int(torch.randint(1, 60, (1,), generator=gen)), temperature=0.5 + (i % 4) / 3,
                             top_k=7 if i % 5 == 0 else 0, ignore_eos=i % 4 == 0, seed=i) for i in range(len(prompts))]
    return prompts, params


def run(async_scheduling: bool, num_blocks: int = 14):
    prompts, params = workload()
    engine = LLMEngine(tiny_model("consistent", seed=2), num_blocks=num_blocks, block_size=16, eos_token_ids=EOS,
                       scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=96, max_model_len=100),
                       async_scheduling=async_scheduling)
    outputs = engine.generate(prompts, params, request_ids=list(range(len(prompts))))
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in outputs], engine


def test_async_scheduling_gives_the_synchronous_outputs():
    ahead, engine = run(True)
    waited, sync_engine = run(False)
    assert ahead == waited
    reasons = [r for _, _, r in ahead]
    assert {"stop", "length"} <= set(reasons), f"the workload must stop by EOS and by length: {reasons}"
    assert engine.scheduler.num_preemptions > 0 and engine.stats.cached_tokens > 0
    assert engine.stats.ahead_steps > engine.stats.steps // 3, engine.stats
    assert sync_engine.stats.ahead_steps == 0
    assert not any(t < 0 for tokens, _, _ in ahead for t in tokens), "a placeholder reached an output"


def test_every_block_is_free_after_async_requests_finish():
    _, engine = run(True)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and engine.pending is None


def test_negative_control_a_wrongly_fed_token_changes_the_outputs(monkeypatch):
    """Feeding each row another row's sampled token (rolled by one) must show in the outputs."""
    waited, _ = run(False)
    monkeypatch.setattr(Feed, "into", lambda self, ids: ids.index_copy_(0, self.rows, self.values.roll(1)))
    ahead, _ = run(True)
    assert ahead != waited


@pytest.mark.parametrize("num_blocks", [7, 64])
def test_async_scheduling_under_cache_pressure_and_without(num_blocks):
    assert run(True, num_blocks)[0] == run(False, num_blocks)[0]
