"""DeepSeek-V4 steps in which no compressor window closes: the rollout bench's warm-up prefills 64-token prompts
under the HCA rate of 128, and chunked prefill and mixed steps meet the same. Nothing runs over zero windows: on
CUDA with FP8 linears the norm also quantises its output for the next GEMM, and that host code cannot shape zero
rows (ops/cuda/quant_rows.fused_quant_result: "cannot reshape tensor of 0 elements into shape [0, -1]", the bench's
failure on an H100). Here a zero-row norm goes through that CUDA host code (no kernel launches at zero rows), so the
CPU engine meets what the GPU met."""
import pytest
import torch

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.batch import ForwardBatch
from onepath.numerics.spec import FP8_ACT
from onepath.ops import rmsnorm
from tests.tiny import random_prompts
from tests.tiny_deepseek_v4 import BLOCK, TINY, onepath_model, sequences, transformers_model

RATE = min(TINY["compress_rates"].values())


@pytest.fixture(scope="module")
def model():
    return onepath_model(transformers_model({}))


@pytest.fixture
def cuda_norm_at_zero_rows(monkeypatch):
    """The consistent CPU norm, but over zero rows the CUDA kernel's host code with the FP8 rule it quantises by."""
    pytest.importorskip("triton")
    from onepath.ops.cuda.rmsnorm import rmsnorm as cuda_rmsnorm
    cpu = rmsnorm.KERNELS["consistent", "cpu"]

    def factory(spec, eps, cast_last=False):
        kernel = cpu(spec, eps, cast_last)
        return lambda x, w: cuda_rmsnorm(x, w, eps, FP8_ACT, cast_last)[0] if x.shape[0] == 0 else kernel(x, w)
    monkeypatch.setitem(rmsnorm.KERNELS, ("consistent", "cpu"), factory)


def test_prefill_that_closes_no_window_runs(model, cuda_norm_at_zero_rows):
    prompts = random_prompts(torch.Generator().manual_seed(3), 6, low=1, high=RATE - 1)
    engine = LLMEngine(model, num_blocks=32, cuda_graphs=False, scheduler=SchedulerConfig(max_model_len=64,
                                                                                         max_num_seqs=8))
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.error for o in outs] == [None] * 6 and all(len(o.token_ids) == 12 for o in outs)


def test_skipping_the_empty_pooling_moves_no_bit(model, monkeypatch):
    """Inference skips the pooling of zero windows; under grad (the trainer's forward) it still runs, so the
    compressor's weights get their zero gradient: the same logits."""
    pooled, compress = [], model.ops.compress
    monkeypatch.setattr(model.ops, "compress", lambda kv, *args: pooled.append(kv.shape[0]) or compress(kv, *args))
    batch, num_blocks = ForwardBatch.for_sequences(sequences(model.config.vocab_size, (1, RATE - 1, 2)), BLOCK)
    logits = {}
    for grad in (False, True):
        pooled.clear()
        with torch.set_grad_enabled(grad):
            logits[grad] = model.compute_logits(model(batch, model.make_cache(num_blocks, BLOCK))).detach()
        assert pooled == ([0] * 3 if grad else [])  # the CSA and HCA compressors and the indexer's
    assert torch.equal(logits[False], logits[True])
