"""Sliding-window attention through the engine and the trainer: the trainer's log-probs equal the engine's
bit for bit, and prefill, chunked prefill, preemption and decode past the window give the same tokens and
log-probs, for dense and MoE models whose layers mix windowed and full attention. Negative control: a
trainer without the window (same weights) differs from the windowed engine, so both sides apply it.
The GPU cases (marked gpu) repeat it in BF16 on the paged Triton kernel with CUDA graphs."""
import pytest
import torch

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models import build_decoder
from onepath.ops import ExecutionSpec, Ops
from onepath.train.actor import Actor, Responses
from tests.tiny import random_prompts, tiny_config, tiny_moe_config

WINDOW = 12
# dense and MoE, windowed layers chosen by each family's rule or by layer_types; some layers full
MODELS = {
    "qwen3_max_window_layers": dict(model_type="qwen3", num_hidden_layers=3, use_sliding_window=True,
                                    sliding_window=WINDOW, max_window_layers=1),
    "qwen2_layer_types": dict(model_type="qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "qwen3_moe_every_layer": dict(moe=True, use_sliding_window=True, sliding_window=WINDOW),
    "qwen2_moe_even_layers": dict(moe=True, model_type="qwen2_moe", num_hidden_layers=3, use_sliding_window=True,
                                  sliding_window=WINDOW, max_window_layers=3, shared_expert_intermediate_size=32),
}
NO_WINDOW = dict(use_sliding_window=False, layer_types=None)
PARAMS = [SamplingParams(max_tokens=24, seed=5), SamplingParams(max_tokens=24, temperature=0.8, top_k=9, seed=6),
          SamplingParams(max_tokens=24, temperature=1.2, top_p=0.85, seed=7)]


def model(name, mode="consistent", device="cpu", seed=4, max_positions=256, window=True, **shape):
    fields = {**MODELS[name], **shape, **({} if window else NO_WINDOW)}
    config = (tiny_moe_config if fields.pop("moe", False) else tiny_config)(**fields)
    m = build_decoder(config, Ops(ExecutionSpec.default(mode, device)), max_positions=max_positions)
    m.init_weights(seed, std=0.15 if device == "cpu" else 0.05)
    return m


def engine(m, max_model_len=128, **scheduler):
    return LLMEngine(m, num_blocks=scheduler.pop("num_blocks", 256), block_size=16,
                     scheduler=SchedulerConfig(max_model_len=max_model_len, **scheduler))


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs


def engine_and_trainer_logprobs(engine_model, policy, prompts, params, **scheduler):
    """(rollout log-probs, trainer log-probs) over the valid completion tokens of one generate."""
    outs = engine(engine_model, **scheduler).generate(prompts, params, request_ids=list(range(len(prompts))))
    r = Responses.build([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], params,
                        [o.logprobs for o in outs])
    lp, _ = Actor(policy, block_size=16, lr=1e-3).logprobs(r)
    mask = r.mask.to(lp.device)
    return r.rollout_logprobs.to(lp.device)[mask], lp.detach()[mask], outs


def cpu_prompts():
    gen = torch.Generator().manual_seed(9)
    prompts = random_prompts(gen, 8, low=1, high=40)
    assert any(len(p) > 2 * WINDOW for p in prompts) and any(len(p) < WINDOW for p in prompts)
    return prompts, [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_trainer_equals_engine_with_a_window(name):
    prompts, params = cpu_prompts()
    rollout, trained, outs = engine_and_trainer_logprobs(model(name), model(name), prompts, params)
    assert any(len(o.prompt_token_ids) + len(o.token_ids) > 2 * WINDOW for o in outs)
    assert rollout.numel() > 100
    assert torch.equal(rollout, trained)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_negative_control_a_trainer_without_the_window_differs(name):
    # no top-k / top-p: the windowless trainer's own set could leave out a sampled token
    prompts, _ = cpu_prompts()
    rollout, trained, _ = engine_and_trainer_logprobs(model(name), model(name, window=False), prompts,
                                                      [PARAMS[0]] * len(prompts))
    assert not torch.equal(rollout, trained)


@pytest.mark.parametrize("name", ["qwen3_max_window_layers", "qwen3_moe_every_layer"])
def test_chunked_prefill_preemption_and_decode_agree_with_a_window(name):
    m = model(name, seed=3)
    gen = torch.Generator().manual_seed(5)
    prompts = random_prompts(gen, 5, low=30, high=50)  # each longer than the window, decoding past it
    ids = list(range(len(prompts)))
    reference = engine(m).generate(prompts, PARAMS[0], request_ids=ids)
    runs = [engine(m, prefill_chunk_size=c).generate(prompts, PARAMS[0], request_ids=ids) for c in (1, 5, 64)]
    small = engine(m, num_blocks=9)
    runs.append(small.generate(prompts, PARAMS[0], request_ids=ids))
    assert small.scheduler.num_preemptions > 0
    for run in runs:
        assert all(same(a, b) for a, b in zip(reference, run))


# tests/engine/test_engine_gpu.py's shape (and tests/models/test_moe_gpu.py's expert sizes), a window of 64
GPU_SHAPE = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                 vocab_size=1000, sliding_window=64)
GPU_MOE = dict(intermediate_size=1024, moe_intermediate_size=256)
GPU_PARAMS = [SamplingParams(max_tokens=96, seed=5), SamplingParams(max_tokens=96, temperature=0.8, top_k=50, seed=6),
              SamplingParams(max_tokens=96, temperature=1.1, top_p=0.9, seed=7)]


def gpu_model(name, mode="consistent", window=True):
    shape = dict(GPU_SHAPE, **(GPU_MOE if MODELS[name].get("moe") else {}))
    if "shared_expert_intermediate_size" in MODELS[name]:
        shape["shared_expert_intermediate_size"] = 256
    return model(name, mode, "cuda", seed=2, max_positions=1024, window=window, **shape)


def gpu_prompts():
    gen = torch.Generator().manual_seed(3)
    prompts = random_prompts(gen, 16, low=1, high=300)
    return prompts, [GPU_PARAMS[i % 3] for i in range(16)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_trainer_equals_engine_with_a_window_on_gpu(name):
    """BF16, the paged Triton kernel: engine prefill, chunked prefill and decode (CUDA graphs where the
    model is capturable) against the trainer's forward, past the window; without the window the trainer
    differs."""
    prompts, params = gpu_prompts()
    kw = dict(max_model_len=1024, max_num_batched_tokens=4096)
    engine_model = gpu_model(name)
    rollout, trained, outs = engine_and_trainer_logprobs(engine_model, gpu_model(name), prompts, params, **kw)
    assert any(len(o.prompt_token_ids) + len(o.token_ids) > 4 * GPU_SHAPE["sliding_window"] for o in outs)
    assert torch.equal(rollout, trained)
    chunked, _, _ = engine_and_trainer_logprobs(engine_model, gpu_model(name), prompts, params,
                                                prefill_chunk_size=48, **kw)
    assert torch.equal(chunked, rollout)
    plain = [GPU_PARAMS[0]] * len(prompts)  # no top-k / top-p: see the CPU negative control
    rollout, full, _ = engine_and_trainer_logprobs(engine_model, gpu_model(name, window=False), prompts, plain, **kw)
    assert not torch.equal(rollout, full)
