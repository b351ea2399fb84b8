"""The engine with an FP8 KV cache (quant="fp8_kv") on CPU: K/V are stored as E4M3 codes with one FP32
scale per token and head, and a request's tokens and log-probs still do not depend on its batch,
chunked prefill, decode or preemption. The quantisation really happens (other log-probs than the
unquantised cache), and the cache's bytes per token, scales included, are <= 0.57x BF16's."""
from dataclasses import replace

import pytest
import torch

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.batch import ForwardBatch, SeqChunk
from onepath.models.dense import DenseDecoder
from onepath.models.kv_cache import KVCache
from onepath.numerics.diff import is_exact, rollout_diff
from onepath.numerics.quant import FP8Tensor
from onepath.numerics.spec import FP8_KV, ExecutionSpec
from onepath.ops import Ops
from onepath.train.actor import Actor, Responses
from tests.engine.engines import chunking_runs, engine, same
from tests.tiny import random_prompts, tiny_config

PARAMS = [SamplingParams(max_tokens=16, seed=5), SamplingParams(max_tokens=16, temperature=0.7, top_k=9, seed=6),
          SamplingParams(max_tokens=16, temperature=1.3, top_p=0.8, seed=7)]


def fp8_model(quant: str | None = "fp8_kv", mode: str = "consistent", seed: int = 0, device: str = "cpu",
              std: float = 0.15, max_positions: int = 256, **overrides) -> DenseDecoder:
    spec = ExecutionSpec.default(mode, device, quant=quant)
    model = DenseDecoder(tiny_config(**overrides), Ops(spec), max_positions=max_positions)
    model.init_weights(seed, std=std)
    return model


def test_cache_is_fp8_codes_and_per_token_head_scales():
    eng = engine(fp8_model())
    cache = eng.runner.cache
    assert all(isinstance(t, FP8Tensor) for t in cache.k + cache.v)
    k = cache.k[0]
    assert k.codes.dtype == torch.float8_e4m3fn and k.scales.dtype == torch.float32
    assert k.scales.shape == (*k.codes.shape[:3], 1)
    eng.generate([[4, 5, 6, 7]], PARAMS[0], request_ids=[0])
    written = k.scales.flatten() > 0
    # amax / 448 per token and head, rounded up to a power of two (FP8_KV's ue8m0 scales): a written token's
    # largest |code| is in 224..448 in each head
    largest = k.codes.float().abs().amax(-1).flatten()[written]
    assert written.any() and bool(((largest >= 224) & (largest <= 448)).all())
    assert bool((torch.frexp(k.scales.flatten()[written]).mantissa == 0.5).all())


def test_request_alone_equals_inside_batches():
    model = fp8_model()
    gen = torch.Generator().manual_seed(11)
    for trial in range(3):
        probe = random_prompts(gen, 1)[0]
        params = PARAMS[trial]
        alone = engine(model).generate([probe], params, request_ids=[1000])[0]
        others = random_prompts(gen, int(torch.randint(2, 9, (1,), generator=gen)))
        at = int(torch.randint(0, len(others) + 1, (1,), generator=gen))
        prompts = others[:at] + [probe] + others[at:]
        ids = [2000 + i for i in range(len(prompts))]
        ids[at] = 1000
        batch_params = [PARAMS[(trial + i) % 3] for i in range(len(prompts))]
        batch_params[at] = params
        inside = engine(model, max_num_batched_tokens=int(torch.randint(64, 256, (1,), generator=gen))) \
            .generate(prompts, batch_params, request_ids=ids)[at]
        assert same(alone, inside), trial


def chunks_agree(mode: str) -> list[bool]:
    prompts = random_prompts(torch.Generator().manual_seed(5), 4, low=30, high=45)
    return chunking_runs(fp8_model(mode=mode, seed=3), prompts, PARAMS[0], chunks=(1, 7), small_cache=7)


def test_whole_prefill_chunked_prefill_decode_and_preemption_agree():
    assert all(chunks_agree("consistent"))


def test_negative_control_baseline_depends_on_chunking():
    """The baseline's whole prefill attends to the fresh K/V, its chunks to the dequantised cache."""
    assert not all(chunks_agree("baseline"))


@torch.no_grad()
def prefill_then_decode(model, prompt):
    """Logits of a prefill of prompt[:-1], then of one decode step of its last token over that cache."""
    cache, table = model.make_cache(4, 16), [2, 0, 3, 1]
    def run(tokens, start):
        return model.compute_logits(model(ForwardBatch.build([SeqChunk(tokens, start, table)], 16), cache))

    return run(prompt[:-1], 0), run(prompt[-1:], len(prompt) - 1)


def test_quantisation_moves_the_logits():
    """Same weights and tokens, FP8 vs unquantised cache: other bits, close values. The baseline's SDPA
    prefill attends to the fresh K/V and ignores the quantisation (the naive path); its decode reads the
    FP8 cache."""
    prompt = random_prompts(torch.Generator().manual_seed(8), 1, low=20, high=30)[0]
    (pre, dec), (pre_plain, dec_plain) = (prefill_then_decode(fp8_model(q), prompt) for q in ("fp8_kv", None))
    assert not torch.equal(pre, pre_plain) and not torch.equal(dec, dec_plain)
    assert (pre - pre_plain).norm() < 0.05 * pre_plain.norm()  # E4M3 keeps 3 mantissa bits: a few % per element
    (pre, dec), (pre_plain, dec_plain) = (prefill_then_decode(fp8_model(q, "baseline"), prompt)
                                          for q in ("fp8_kv", None))
    assert torch.equal(pre, pre_plain) and not torch.equal(dec, dec_plain)


def test_bytes_per_token_include_scales_and_are_at_most_057_of_bf16():
    config = tiny_config(head_dim=128, num_hidden_layers=3, num_key_value_heads=2)
    fp8 = KVCache.bytes_per_token(config, torch.bfloat16, FP8_KV)
    bf16 = KVCache.bytes_per_token(config, torch.bfloat16)
    assert fp8 == 2 * 3 * 2 * (128 + 4) and bf16 == 2 * 3 * 2 * 256
    assert fp8 / bf16 <= 0.57
    cache = KVCache(config, 3, 16, torch.bfloat16, kv=FP8_KV)
    stored = sum(t.codes.nbytes + t.scales.nbytes for t in cache.k + cache.v)
    assert stored == fp8 * 3 * 16
    # the engine sizes and reports its cache by the format its spec asks for
    eng = engine(fp8_model())
    assert eng.memory["kv_bytes_per_token"] == KVCache.bytes_per_token(tiny_config(), torch.float32, FP8_KV)


def test_cache_format_must_follow_the_spec():
    model = fp8_model()
    batch, num_blocks = ForwardBatch.for_sequences([[4, 5, 6]], 16, "cpu")
    with pytest.raises(TypeError, match="model.make_cache"):
        model(batch, KVCache(model.config, num_blocks, 16, torch.float32))
    with pytest.raises(ValueError, match="FP8_KV"):
        KVCache(model.config, num_blocks, 16, torch.float32, kv=replace(FP8_KV, scale_domain="per_tensor"))


GPU_SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=3, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=128, vocab_size=1000)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graphs_batches_chunks_and_trainer_agree():
    """BF16 with FP8 KV on the GPU (the Triton kernel's FP8 path): CUDA graphs == eager, alone == in a
    batch, chunked prefill == whole, and the trainer's log-probs == the engine's; naive trainer differs."""
    make = lambda quant: fp8_model(quant, device="cuda", std=0.05, max_positions=1024, **GPU_SHAPE)
    model = make("fp8_kv")
    prompts = random_prompts(torch.Generator().manual_seed(3), 12, high=300)
    params = [PARAMS[i % 3] for i in range(len(prompts))]

    def run(picks, sampling=params, **kw):
        eng = LLMEngine(model, num_blocks=512, block_size=16, cuda_graphs=kw.pop("graphs", True),
                        scheduler=SchedulerConfig(max_model_len=1024, **kw))
        return eng.generate([prompts[i] for i in picks], [sampling[i] for i in picks], request_ids=list(picks))

    def diff(outs, sampling, trainer_quant):
        r = Responses.build([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], sampling,
                            [o.logprobs for o in outs])
        with torch.no_grad():
            lp, _ = Actor(make(trainer_quant), block_size=16, lr=0.0).logprobs(r)
        return rollout_diff(r.rollout_logprobs.cuda(), lp, r.mask.cuda())

    everything = range(len(prompts))
    outs = run(everything)
    for variant in (run(everything, graphs=False), run(everything, prefill_chunk_size=64),
                    [run([i])[0] for i in (0, 5, 11)]):
        for o in variant:
            assert same(o, outs[o.request_id]), o.request_id
    assert is_exact(diff(outs, params, "fp8_kv"))
    # naive: the trainer keeps K/V unquantised (no top-k / top-p, so its own sets keep every sampled token)
    plain = [PARAMS[0]] * len(prompts)
    assert diff(run(everything, sampling=plain), plain, None)["rollout_corr/tokens_differing_frac"] > 0
