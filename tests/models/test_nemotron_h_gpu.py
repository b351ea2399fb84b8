"""The hybrid's contract on the GPU (BF16, Triton kernels, decode in CUDA graphs): a Nemotron-H with Nemotron-3-Nano's
mixer shape (64 Mamba heads of 64, 8 groups, state 128, chunk 128), attention, relu2 MLP and MoE layers, random
weights. The logits are the same bits in the trainer's forward, one prefill, chunked prefill and decode; the engine
procedures of tests/engine/test_engine_gpu.py and test_cuda_graphs_gpu.py run on it: a request alone vs in
batches (and in a batch of 256), chunked prefill and preemption vs whole prefill, graph vs eager decode, trainer ==
engine before and after an update with in-place sync. Baseline negative controls on the same runs.

    python -m pytest -q -m gpu tests/ops/test_ssd_gpu.py tests/models/test_nemotron_h_gpu.py \
        tests/consistency/test_hybrid_check_gpu.py
"""
import pytest
import torch

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models import build_decoder
from onepath.models.config import NemotronHConfig
from onepath.numerics.diff import is_exact
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from tests.engine import test_cuda_graphs_gpu as graphs
from tests.engine import test_engine_gpu as dense
from tests.models import test_nemotron_h_phases as phases
from tests.tiny import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = dict(vocab_size=1000, hidden_size=512, hybrid_override_pattern="MEM*EM-", num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, intermediate_size=1024, mamba_num_heads=64, mamba_head_dim=64,
             n_groups=8, ssm_state_size=128, chunk_size=128, n_routed_experts=32, num_experts_per_tok=4,
             moe_intermediate_size=256, moe_shared_expert_intermediate_size=512, routed_scaling_factor=2.5,
             max_position_embeddings=1024, eos_token_id=2)


def hybrid_model(mode, seed=0, **overrides):
    config = NemotronHConfig.from_dict({"model_type": "nemotron_h", **SHAPE, **overrides})
    model = build_decoder(config, Ops(ExecutionSpec.default(mode, "cuda")), max_positions=1024)
    model.init_weights(seed, std=0.05)
    return model


@pytest.fixture(autouse=True)
def hybrid(monkeypatch):
    monkeypatch.setattr(dense, "model", hybrid_model)
    monkeypatch.setattr(graphs, "model", hybrid_model)


def test_the_model_captures_decode_graphs_gpu():
    m = hybrid_model("consistent")
    assert m.capturable and m.ops.grouped_kernel("expert")
    eng = dense.engine(m)
    assert eng.runner.graphs is not None and not eng.block_manager.enable_prefix_caching


def logits_by_phase(mode, state_dtype="float32"):
    """The trainer's forward, one prefill, chunked prefill cut off the chunks, and prefill-then-decode, of five
    sequences together: logits per sequence (tests/models/test_nemotron_h_phases.py's passes, on the GPU)."""
    m = hybrid_model(mode, seed=1, mamba_ssm_cache_dtype=state_dtype)
    gen = torch.Generator().manual_seed(7)
    seqs = random_prompts(gen, 5, low=1, high=400)
    seqs[0] = seqs[0][:1]
    passes = {"prefill": phases.whole(seqs), "chunked": phases.chunked(seqs, (3, 130, 131, 200, 257)),
              "decode": phases.decoded(seqs)}
    return phases.trainer_logits(m, seqs), {name: phases.engine_logits(m, seqs, p) for name, p in passes.items()}


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_every_phase_gives_the_trainer_logits_gpu(state_dtype):
    trainer, phases = logits_by_phase("consistent", state_dtype)
    for name, got in phases.items():
        for b, (g, w) in enumerate(zip(got, trainer)):
            assert torch.equal(g, w), (name, b, (g - w).abs().max())


def test_negative_control_phases_baseline_gpu():
    trainer, phases = logits_by_phase("baseline")
    assert any(not torch.equal(g, w) for name in ("chunked", "decode") for g, w in zip(phases[name], trainer))


@pytest.mark.gpu_smoke
def test_alone_equals_batch_hybrid_gpu():
    assert all(dense.alone_vs_batches("consistent"))


def test_negative_control_baseline_hybrid_gpu():
    assert not all(dense.alone_vs_batches("baseline"))


def batch_of_256(mode):
    m = hybrid_model(mode, seed=3)
    gen = torch.Generator().manual_seed(9)
    prompts = random_prompts(gen, 256, low=1, high=150)
    params = [SamplingParams(max_tokens=48, seed=i, ignore_eos=True, temperature=(0.7, 1.0, 1.3)[i % 3])
              for i in range(256)]

    def engine():
        return LLMEngine(m, num_blocks=256 * 13, block_size=16, scheduler=SchedulerConfig(
            max_model_len=256, max_num_batched_tokens=8192, max_num_seqs=256))

    together = engine().generate(prompts, params, request_ids=list(range(256)))
    alone = [engine().generate([prompts[i]], params[i], request_ids=[i])[0] for i in (0, 77, 255)]
    return [dense.same(a, together[i]) for a, i in zip(alone, (0, 77, 255))]


@pytest.mark.gpu_smoke
def test_alone_equals_in_a_batch_of_256_hybrid_gpu():
    assert all(batch_of_256("consistent"))


def test_negative_control_batch_of_256_baseline_hybrid_gpu():
    assert not all(batch_of_256("baseline"))


def test_chunked_prefill_and_preemption_hybrid_gpu():
    assert all(dense.chunking("consistent"))


def test_negative_control_chunking_baseline_hybrid_gpu():
    assert not all(dense.chunking("baseline"))


@pytest.mark.gpu_smoke
def test_graph_equals_eager_hybrid_gpu():
    assert all(graphs.graph_vs_eager("consistent"))


def test_negative_control_graph_vs_eager_baseline_hybrid_gpu():
    assert not all(graphs.graph_vs_eager("baseline"))


@pytest.mark.gpu_smoke
def test_trainer_equals_engine_before_and_after_update_hybrid_gpu():
    diffs = dense.trainer_diffs("consistent")
    assert all(is_exact(d) for d in diffs), diffs


def test_negative_control_trainer_baseline_hybrid_gpu():
    diffs = dense.trainer_diffs("baseline")
    assert any(d["rollout_corr/tokens_differing_frac"] > 0 for d in diffs)
