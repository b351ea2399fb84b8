"""End to end on the GPU: a Qwen3-0.6B-shaped model (random BF16 weights), 256 requests with prompts
of 1..2000 tokens and 1..1000 generated tokens; the trainer's recomputed log-probs equal the engine's
for every token. The baseline path on a subset of the same case must differ (negative control)."""
import pytest
import torch

from onepath.numerics.diff import is_exact, rollout_diff
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.config import ModelConfig
from onepath.models.dense import DenseDecoder
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from onepath.train.actor import Actor, Responses

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QWEN3_0_6B = ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, model_type="qwen3",
                         rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=True,
                         eos_token_id=151645)
MAX_LEN = 3072


def build(mode: str) -> DenseDecoder:
    model = DenseDecoder(QWEN3_0_6B, Ops(ExecutionSpec.default(mode, "cuda")), max_positions=MAX_LEN)
    model.init_weights(seed=0, std=0.02)
    return model


def workload(count: int, max_prompt: int, max_gen: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, max_prompt + 1, (count,), generator=g).tolist()
    gen_lens = torch.randint(1, max_gen + 1, (count,), generator=g).tolist()
    prompts = [torch.randint(0, QWEN3_0_6B.vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, seed=i, temperature=1.0) for i, m in enumerate(gen_lens)]
    return prompts, params


def rollout_vs_trainer(mode: str, count: int, max_prompt: int, max_gen: int) -> dict:
    engine_model, policy = build(mode), build(mode)
    engine = LLMEngine(engine_model, num_blocks=16384, block_size=16,
                       scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=MAX_LEN))
    prompts, params = workload(count, max_prompt, max_gen)
    outs = engine.generate(prompts, params, request_ids=list(range(count)))
    assert all(o.error is None and len(o.token_ids) == p.max_tokens for o, p in zip(outs, params))
    r = Responses.build([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], params,
                        [o.logprobs for o in outs])
    with torch.no_grad():
        lp, _ = Actor(policy, block_size=16, lr=0.0).logprobs(r, max_tokens=65536)
    mask = r.mask.cuda()
    return rollout_diff(r.rollout_logprobs.cuda(), lp, mask)


def test_trainer_equals_engine_for_every_token_qwen3_shape():
    metrics = rollout_vs_trainer("consistent", 256, 2000, 1000)
    assert metrics["rollout_corr/valid_tokens"] > 100_000
    assert is_exact(metrics), metrics


def test_negative_control_baseline_qwen3_shape():
    metrics = rollout_vs_trainer("baseline", 16, 500, 64)
    assert metrics["rollout_corr/tokens_differing_frac"] > 0, metrics
