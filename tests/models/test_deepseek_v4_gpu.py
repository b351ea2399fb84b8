"""DeepSeek-V4 on the GPU, BF16 (the default CUDA spec), FP8 KV and the FP8 indexer (fp8_indexer: e4m3 codes scored on
an e4m3 wgmma): the Triton kernels (index_topk, index_scores in the model's dtype and in FP8, sparse_attention, compress,
hc_pre / hc_post / hc_head) keep a row's bits alone = in a batch of 256, with the baseline's stock paths as controls; the
model gives the same bits whole, chunked and in decode, alone and in a batch of 256 requests, with CUDA graphs and
eager, and engine = trainer before and after an update; planted indexer ties resolve to the larger position on
both sides. Run as one command on a GPU machine:

    pytest -q -m gpu tests/models/test_deepseek_v4_gpu.py
"""
import pytest
import torch

from onepath.consistency.recorder import Layout
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models import build_decoder
from onepath.models.deepseek_v4_config import DeepseekV4Config
from onepath.numerics.diff import is_exact
from onepath.numerics.quant import quantize_fp8
from onepath.numerics.spec import FP8_INDEX
from onepath.ops import ExecutionSpec, Ops
from onepath.ops import compressor as C
from onepath.ops import indexer as IX
from onepath.ops import mhc as M
from onepath.ops import sparse_attention as SA
from onepath.ops import topk as T
from tests.models.test_deepseek_v4_consistency import phase_logits
from tests.tiny import random_prompts
from tests.tiny_deepseek_v4 import CSA, HCA, SLIDING
from tests.train.test_trainer_consistency import engine_vs_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = dict(vocab_size=1000, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=16,
             head_dim=128, q_lora_rank=192, num_experts_per_tok=2, n_routed_experts=8, hc_mult=4,
             layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
             compress_rates={CSA: 4, HCA: 16}, sliding_window=32, o_groups=4, o_lora_rank=64, index_n_heads=16,
             index_head_dim=64, index_topk=16, partial_rotary_factor=0.25, max_position_embeddings=4096)
MAX_LEN = 1024


def model(mode="consistent", quant=None, seed=0, **edits):
    config = DeepseekV4Config(**{**SHAPE, **edits})
    m = build_decoder(config, Ops(ExecutionSpec.default(mode, "cuda", quant=quant)), max_positions=MAX_LEN)
    m.init_weights(seed, std=0.05)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("sinks", "position_bias", "base")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return m


def requests(count, seed, low=1, high=300, max_tokens=(1, 120)):
    gen = torch.Generator().manual_seed(seed)
    prompts = random_prompts(gen, count, low=low, high=high)
    lengths = torch.randint(*max_tokens, (count,), generator=gen).tolist()
    params = [SamplingParams(max_tokens=n, temperature=(0.7, 1.0, 1.3)[i % 3], seed=i, ignore_eos=True)
              for i, n in enumerate(lengths)]
    return prompts, params


def engine(m, graphs, **scheduler):
    return LLMEngine(m, num_blocks=2048, block_size=16, cuda_graphs=graphs,
                     scheduler=SchedulerConfig(**{"max_model_len": MAX_LEN, "max_num_seqs": 256, **scheduler}))


def same(a, b) -> list[bool]:
    return [(x.token_ids, x.logprobs) == (y.token_ids, y.logprobs) for x, y in zip(a, b)]


# ---- kernels: a row alone = in a batch of 256 (baseline controls) ----

@pytest.mark.gpu_smoke
def test_index_topk_kernel_equals_the_key_and_beats_torch_topk_on_ties():
    gen = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.relu(torch.randn(256, 8192, device="cuda", generator=gen))  # ~half exact zeros: planted ties
    valid = torch.rand(256, 8192, device="cuda", generator=gen) < 0.95
    cuda = ExecutionSpec.default("consistent", "cuda")
    for k in (16, 512, 2048):
        got = T.index_topk(cuda, scores, valid, k)
        assert torch.equal(got, T.keyed_index_topk(scores, valid, k))
        assert torch.equal(torch.cat([T.index_topk(cuda, scores[i:i + 1], valid[i:i + 1], k) for i in range(256)]),
                           got)
    # the control: fewer positive scores than k, so the selection ends among the zeros and their tie-break decides
    # it (with ~half positive, the top 2048 of 8192 hold no zero and torch.topk picks the key's set)
    scores = torch.relu(torch.randn(256, 8192, device="cuda", generator=gen) - 1.2)  # ~11% positive: ~940 a row
    library = T.index_topk(ExecutionSpec.default("baseline", "cuda"), scores, valid, 2048)
    assert torch.equal(T.index_topk(cuda, scores, valid, 2048), T.keyed_index_topk(scores, valid, 2048))
    assert not torch.equal(torch.sort(library, descending=True).values, T.keyed_index_topk(scores, valid, 2048))


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_sparse_attention_and_index_scores_rows_alone_equal_batch_of_256(mode):
    gen = torch.Generator(device="cuda").manual_seed(1)
    spec = ExecutionSpec.default(mode, "cuda")
    q = torch.randn(256, 16, 128, device="cuda", generator=gen).bfloat16()
    keys = torch.randn(256, 160, 128, device="cuda", generator=gen).bfloat16()
    valid = torch.rand(256, 160, device="cuda", generator=gen) < 0.8
    sinks = torch.randn(16, device="cuda", generator=gen)
    for decode in (False, True):
        full = SA.sparse_attention(spec, q, keys, valid, sinks, 0.088, decode)
        alone = torch.cat([SA.sparse_attention(spec, q[i:i + 1], keys[i:i + 1], valid[i:i + 1], sinks, 0.088, decode)
                           for i in range(256)])
        if mode == "consistent":
            assert torch.equal(alone, full)
        elif decode:  # the stock decode splits its candidates by the batch
            assert not torch.equal(alone, full)
        torch.testing.assert_close(full.float(), SA.reference(q, keys, valid, sinks, 0.088).float(), rtol=2e-2,
                                   atol=2e-2)
    w = torch.randn(256, 16, device="cuda", generator=gen).bfloat16()
    iq, ik = q[:, :, :64].contiguous(), keys[:, :, :64].contiguous()
    full = IX.index_scores(spec, iq, ik, w, valid, 0.125, 0.25)
    alone = torch.cat([IX.index_scores(spec, iq[i:i + 1], ik[i:i + 1], w[i:i + 1], valid[i:i + 1], 0.125, 0.25)
                       for i in range(256)])
    if mode == "consistent":
        assert torch.equal(alone, full)
        shared = IX.index_scores(spec, iq, ik[0], w, valid, 0.125, 0.25)
        assert torch.equal(shared, IX.index_scores(spec, iq, ik[0].expand(256, -1, -1), w, valid, 0.125, 0.25))


def test_compress_windows_alone_equal_batch_of_256():
    """CSA's 2m = 8 slots and HCA's 128 at head_dim 512, BF16 compressor state as the model reads it (strided
    halves), CSA's first window half invalid."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    spec = ExecutionSpec.default("consistent", "cuda")
    for slots in (8, 128):
        state = torch.randn(256, slots, 1024, device="cuda", generator=gen).bfloat16()
        kv, gate = state[..., :512], state[..., 512:]
        bias = torch.randn(slots, 512, device="cuda", generator=gen)
        valid = torch.ones(256, slots, dtype=torch.bool, device="cuda")
        valid[0, :slots // 2] = False
        full = C.compress(spec, kv, gate, bias, valid)
        alone = torch.cat([C.compress(spec, kv[i:i + 1], gate[i:i + 1], bias, valid[i:i + 1]) for i in range(256)])
        assert torch.equal(alone, full)
        torch.testing.assert_close(full.float(), C.reference(kv, gate, bias, valid).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_mhc_tokens_alone_equal_batch_of_256(mode):
    """hc_mult 4 streams of DeepSeek-V4-Flash's hidden size 4096 (K = 16384: 16 splits), 20 Sinkhorn iterations.
    The baseline's stock GEMM (cuBLAS) runs another kernel at M = 1 than at 256: its bits move."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    spec = ExecutionSpec.default(mode, "cuda")
    n, d = 4, 4096
    x = torch.randn(256, n, d, device="cuda", generator=gen).bfloat16()
    fn = torch.randn((2 + n) * n, n * d, device="cuda", generator=gen) / (n * d) ** 0.5
    base, scale = torch.randn((2 + n) * n, device="cuda", generator=gen), torch.randn(3, device="cuda", generator=gen)
    out = torch.randn(256, d, device="cuda", generator=gen).bfloat16()

    def outputs(rows):
        post, comb, collapsed = M.hc_pre(spec, x[rows], fn, base, scale, 1e-6, 1e-6, 20)
        return (post, comb, collapsed, M.hc_head(spec, x[rows], fn[:n], base[:n], scale[:1], 1e-6, 1e-6),
                M.hc_post(spec, out[rows], x[rows], post, comb))

    full = outputs(slice(None))
    each = [outputs(slice(i, i + 1)) for i in range(256)]
    alone = [torch.cat([a[j] for a in each]) for j in range(5)]
    if mode == "consistent":
        assert all(torch.equal(a, b) for a, b in zip(alone, full))
    else:
        assert not torch.equal(alone[2], full[2]) and not torch.equal(alone[3], full[3])
    want = M.reference_pre(x, fn, base, scale, 1e-6, 1e-6, 20)
    for got, ref in zip(full[:3], want):
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_fp8_index_scores_rows_alone_equal_batch_of_256_and_paged_equal_contiguous(mode):
    """The FP8 scorer at DeepSeek-V4-Flash's indexer shape (64 heads, index_head_dim 128): a query alone = in a batch
    of 256, keys gathered per query = shared contiguous rows, near the CPU's exact-dot FP8 path; the stock way
    (dequantise, then a GEMM over the launch or a paged decode's sum) gives gathered and contiguous keys other bits."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    spec = ExecutionSpec.default(mode, "cuda", quant="fp8_indexer")
    q = torch.randn(256, 64, 128, device="cuda", generator=gen).bfloat16()
    keys = torch.randn(300, 128, device="cuda", generator=gen).bfloat16()
    w = torch.randn(256, 64, device="cuda", generator=gen).bfloat16()
    valid = torch.rand(256, 300, device="cuda", generator=gen) < 0.8
    shared = quantize_fp8(keys, FP8_INDEX)
    gathered = quantize_fp8(keys.expand(256, -1, -1).contiguous(), FP8_INDEX)
    full = IX.index_scores(spec, q, gathered, w, valid, 128 ** -0.5, 64 ** -0.5)
    contiguous = IX.index_scores(spec, q, shared, w, valid, 128 ** -0.5, 64 ** -0.5)
    if mode == "baseline":
        assert not torch.equal(full, contiguous)
        return
    assert torch.equal(contiguous, full)
    alone = torch.cat([IX.index_scores(spec, q[i:i + 1], shared, w[i:i + 1], valid[i:i + 1], 128 ** -0.5, 64 ** -0.5)
                       for i in range(256)])
    assert torch.equal(alone, full)
    cpu = IX.index_scores(ExecutionSpec.default(quant="fp8_indexer"), q.cpu().float(), keys.cpu().float(),
                          w.cpu(), valid.cpu(), 128 ** -0.5, 64 ** -0.5)
    live = valid.cpu()
    # Hopper's e4m3 wgmma accumulates with fewer bits than FP32: near, not equal
    torch.testing.assert_close(full.cpu()[live], cpu[live], rtol=1e-2, atol=1e-2 * float(cpu[live].abs().max()))


# ---- the model ----

QUANTS = [None, "fp8_kv", "fp8_kv+fp8_indexer"]


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("quant", QUANTS)
def test_whole_chunked_and_decode_give_the_same_bits(quant):
    m = model(quant=quant)
    seqs = random_prompts(torch.Generator().manual_seed(2), 6, low=40, high=200)
    whole = phase_logits(m, seqs, Layout())
    for layout in (Layout(chunk=37), Layout(prefill=1), Layout(prefill=50, chunk=16)):
        assert all(torch.equal(a, b) for a, b in zip(whole, phase_logits(m, seqs, layout))), layout


def test_baseline_phases_differ():
    m = model("baseline")
    seqs = random_prompts(torch.Generator().manual_seed(2), 6, low=40, high=200)
    assert not all(torch.equal(a, b) for a, b in zip(phase_logits(m, seqs, Layout()),
                                                     phase_logits(m, seqs, Layout(prefill=1))))


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_request_alone_equals_request_in_a_batch_of_256(mode):
    m = model(mode)
    prompts, params = requests(256, 3, max_tokens=(4, 40))
    batch = engine(m, True).generate(prompts, params, request_ids=list(range(256)))
    probes = [0, 97, 255]
    alone = [engine(m, True).generate([prompts[i]], [params[i]], request_ids=[i])[0] for i in probes]
    assert all(same(alone, [batch[i] for i in probes])) == (mode == "consistent")


@pytest.mark.parametrize("quant", QUANTS)
def test_graph_equals_eager(quant):
    m = model(quant=quant)
    assert m.capturable
    prompts, params = requests(45, 11)
    ids = list(range(45))
    graphed = engine(m, True)
    a = graphed.generate(prompts, params, request_ids=ids)
    b = engine(m, False).generate(prompts, params, request_ids=ids)
    assert graphed.stats.graph_steps > 50 and all(same(a, b))


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("quant", QUANTS)
def test_engine_equals_trainer_before_and_after_an_update(quant):
    before, after = engine_vs_trainer(model(quant=quant), model(quant=quant), update=True, prompts=12,
                                      max_model_len=512)
    assert is_exact(before) and is_exact(after), (before, after)


def test_baseline_trainer_differs():
    (metrics,) = engine_vs_trainer(model("baseline"), model("baseline"), update=False, prompts=12, max_model_len=512)
    assert metrics["rollout_corr/tokens_differing_frac"] > 0


def test_planted_indexer_ties_resolve_the_same_way_on_both_sides():
    """An indexer whose head weights are all zero scores every entry 0: every selection is a tie, resolved to the
    largest positions; engine (prefill, decode, graphs) and trainer agree, and the selection is the last
    index_topk entries a query may see."""
    m, policy = model(), model()
    for net in (m, policy):
        with torch.no_grad():
            for name, p in net.named_parameters():
                if name.endswith("scorer.weights_proj.weight"):
                    p.zero_()
    (metrics,) = engine_vs_trainer(m, policy, update=False, prompts=12, max_model_len=512)
    assert is_exact(metrics)
    indexer = next(mod for mod in m.modules() if type(mod).__name__ == "Indexer")
    scores = torch.zeros(3, 40, device="cuda")
    valid = torch.arange(40, device="cuda")[None] < torch.tensor([[10], [25], [40]], device="cuda")
    picked = m.ops.index_topk(scores, valid, indexer.topk)
    want = torch.stack([torch.arange(n - 1, n - 1 - indexer.topk, -1, device="cuda") for n in (10, 25, 40)])
    want = want.clamp(min=-1)
    assert torch.equal(picked, want)
