"""The CUDA-graph decode path's data handling, run eagerly on the CPU: static buffers, padding rows
into the scratch block, partial table copies. Replaying a graph replays exactly this forward, so a
padded static-buffer decode must give the eager step's bits (consistent) while the baseline's
M-dependent GEMM shows the padding (negative control)."""
import torch

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.model_runner import DecodeGraphs, graph_batch_sizes
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from tests.tiny import random_prompts, tiny_model


def runs(mode: str):
    model = tiny_model(mode, seed=4)
    gen = torch.Generator().manual_seed(8)
    prompts = random_prompts(gen, 13, low=1, high=40)
    params = [SamplingParams(max_tokens=int(n), seed=i, ignore_eos=True, temperature=(0.8, 1.2)[i % 2])
              for i, n in enumerate(torch.randint(1, 30, (13,), generator=gen))]
    outs, engines = [], []
    for padded in (False, True):
        engine = LLMEngine(model, num_blocks=128, block_size=16, cuda_graphs=False,
                           scheduler=SchedulerConfig(max_model_len=96, max_num_seqs=16))
        if padded:
            runner = engine.runner
            runner.graphs = DecodeGraphs(model, runner.cache, engine.block_manager.num_blocks, 96,
                                         [4, 8, 16], capture=False)
        outs.append(engine.generate(prompts, params, request_ids=list(range(13))))
        engines.append(engine)
    assert engines[1].stats.graph_steps > 10 and engines[0].stats.graph_steps == 0
    return [(a.token_ids, a.logprobs) == (b.token_ids, b.logprobs) for a, b in zip(*outs)]


def test_padded_static_decode_equals_eager():
    assert all(runs("consistent"))


def test_negative_control_padded_decode_baseline():
    assert not all(runs("baseline"))


def test_graph_batch_sizes():
    assert graph_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1) == [1]
