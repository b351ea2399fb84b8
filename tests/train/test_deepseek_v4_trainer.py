"""DeepSeek-V4 through the real engine and trainer on the CPU: the trainer's log-probs (its private cache, whole
sequences) equal the engine's (paged cache, prefill then decode) bit for bit, before and after an update and in-place
sync, with the FP8 KV cache and the FP8 indexer (its key pages e4m3, scored FP8 x FP8) too, in FP32 and in BF16
(the GPU's default spec); the engine's outputs do not change with the prefill chunk size or preemption. The baseline
mode differs: the negative control."""
import pytest
import torch

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.scheduler import SchedulerConfig
from onepath.numerics.diff import is_exact
from tests.engine.engines import chunking_runs
from tests.models.test_deepseek_v4_consistency import EDITS
from tests.tiny import random_prompts
from tests.tiny_deepseek_v4 import onepath_model, transformers_model
from tests.train.test_moe_trainer import engine_routing_hits
from tests.train.test_trainer_consistency import PARAMS, engine_vs_trainer


@pytest.fixture(scope="module")
def hf():
    return transformers_model(EDITS)


@pytest.mark.parametrize("dtype, quant", [("float32", None), ("float32", "fp8_kv"), ("bfloat16", None),
                                         ("bfloat16", "fp8_kv"), ("float32", "fp8_indexer"),
                                         ("bfloat16", "fp8_kv+fp8_indexer")])
def test_trainer_logprobs_equal_engine_logprobs_before_and_after_an_update(hf, dtype, quant):
    models = [onepath_model(hf, quant=quant, dtype=dtype) for _ in range(2)]
    before, after = engine_vs_trainer(*models, update=True, prompts=6, max_model_len=64)
    assert before["rollout_corr/valid_tokens"] > 100
    assert is_exact(before) and is_exact(after), (before, after)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_baseline_trainer_differs(hf, dtype):
    models = [onepath_model(hf, "baseline", dtype=dtype) for _ in range(2)]
    (metrics,) = engine_vs_trainer(*models, update=False, prompts=6, max_model_len=64)
    assert metrics["rollout_corr/tokens_differing_frac"] > 0


def test_engine_outputs_do_not_depend_on_chunking_or_preemption(hf):
    model = onepath_model(hf, max_positions=128)
    prompts = random_prompts(torch.Generator().manual_seed(5), 5, low=10, high=30)
    assert chunking_runs(model, prompts, PARAMS[1], chunks=(16, 32), small_cache=6) == [True, True, True]


def test_engine_routing_equals_the_trainers_whole_sequence_routing(hf):
    """Chunked prefill, preemption and repeated prompts: each router's choices (hash and top-k) at every position the
    engine computed equal a whole-sequence forward's (no routing replay). Prefix caching is off for this model (a
    cached prefix lacks the sequence's rings), so every position is computed."""
    assert engine_routing_hits(onepath_model(hf, max_positions=96), max_tokens=20, repeats=2) == 0


def test_prefix_caching_is_refused_by_name(hf):
    with pytest.raises(ValueError, match="prefix caching is not supported for deepseek_v4.*rings"):
        LLMEngine(onepath_model(hf), num_blocks=8, enable_prefix_caching=True,
                  scheduler=SchedulerConfig(max_model_len=64))
