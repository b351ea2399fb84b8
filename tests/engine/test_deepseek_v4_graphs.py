"""DeepSeek-V4's CUDA-graph decode path run eagerly on the CPU: a decode step finds its closing windows, ring slots
and entry bound on the device (every row computed, the rows that close nothing and the padding rows writing into the
cache's scratch block and slot), so the padded static-buffer step of DecodeGraphs gives the eager engine's bits
(consistent, FP32 and BF16, FP8 KV and the FP8 indexer too); the baseline's decode, split by the padded batch, shows the padding (negative
control)."""
import pytest
import torch

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.model_runner import DecodeGraphs
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from tests.models.test_deepseek_v4_consistency import EDITS
from tests.tiny import random_prompts
from tests.tiny_deepseek_v4 import onepath_model, transformers_model

MAX_LEN = 64


@pytest.fixture(scope="module")
def hf():
    return transformers_model(EDITS)


def runs(model):
    gen = torch.Generator().manual_seed(8)
    prompts = random_prompts(gen, 7, low=1, high=20)
    params = [SamplingParams(max_tokens=int(n), seed=i, ignore_eos=True, temperature=(0.8, 1.2)[i % 2])
              for i, n in enumerate(torch.randint(8, 30, (7,), generator=gen))]
    outs, engines = [], []
    for padded in (False, True):
        engine = LLMEngine(model, num_blocks=64, block_size=16, cuda_graphs=False,
                           scheduler=SchedulerConfig(max_model_len=MAX_LEN, max_num_seqs=8))
        if padded:
            runner = engine.runner
            runner.graphs = DecodeGraphs(model, runner.cache, engine.block_manager.num_blocks, MAX_LEN, [2, 8],
                                         capture=False)
        outs.append(engine.generate(prompts, params, request_ids=list(range(7))))
        engines.append(engine)
    assert engines[1].stats.graph_steps > 10 and engines[0].stats.graph_steps == 0
    return [(a.token_ids, a.logprobs) == (b.token_ids, b.logprobs) for a, b in zip(*outs)]


@pytest.mark.parametrize("dtype, quant", [("float32", None), ("bfloat16", "fp8_kv"),
                                         ("bfloat16", "fp8_kv+fp8_indexer")])
def test_padded_static_decode_equals_eager(hf, dtype, quant):
    assert all(runs(onepath_model(hf, quant=quant, dtype=dtype)))


def test_negative_control_padded_decode_baseline(hf):
    assert not all(runs(onepath_model(hf, "baseline")))


def test_capturable_follows_the_experts():
    """On the CPU the experts loop over their counts on the host: the engine keeps decode steps eager."""
    model = onepath_model(transformers_model({}))
    assert not model.capturable
    with pytest.raises(ValueError, match="cannot be captured in a CUDA graph"):
        LLMEngine(model, num_blocks=8, cuda_graphs=True, scheduler=SchedulerConfig(max_model_len=MAX_LEN))
