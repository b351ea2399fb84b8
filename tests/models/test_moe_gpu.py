"""The MoE contract on the GPU (BF16, Triton kernels): a Qwen3-MoE-shaped model with random weights
(8 layers, 64 experts, top-8). The procedures of tests/engine/test_engine_gpu.py run on it (its engines
decode in CUDA graphs by default, the MoE being capturable): a request alone vs inside batches, chunked
prefill and preemption vs whole prefill, trainer == engine before and after an update with in-place
sync (no routing replay); masked vs contiguous expert layouts give equal rows; decode steps replayed
from CUDA graphs equal eager ones, and an expert layer captured once replays any routing with the
eager bits. Baseline negative controls.

    python -m pytest -q -m gpu tests/models/test_moe_gpu.py
"""
import pytest
import torch

from onepath.numerics.diff import is_exact
from onepath.models import build_decoder
from onepath.models.moe import ExpertParallel, SparseMoeBlock
from onepath.models.config import ModelConfig
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from tests.engine import test_cuda_graphs_gpu as graphs
from tests.engine import test_engine_gpu as dense

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = dict(vocab_size=1000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=64,
             num_experts_per_tok=8, norm_topk_prob=True, model_type="qwen3_moe", max_position_embeddings=1024,
             eos_token_id=2)


def moe_model(mode, seed=0, quant=None):
    spec = ExecutionSpec.default(mode, "cuda", quant=quant)
    model = build_decoder(ModelConfig(**SHAPE), Ops(spec), max_positions=1024)
    model.init_weights(seed, std=0.05)
    return model


def grads_vs_loop(block, gen):
    """Gradients (input, gate_up_proj, down_proj) of sum(y^2) over 200 random tokens: through the
    block's experts as they run, then through the per-expert loop."""
    from onepath.models.moe import experts_contiguous

    experts = block.experts
    x = torch.randn(200, SHAPE["hidden_size"], generator=gen, device="cuda").bfloat16()
    with torch.no_grad():
        _, chosen = block.gate(x)
    grads = []
    loop = lambda x: experts_contiguous(experts.mlp, x, chosen, experts.num_experts)
    for run in (lambda x: experts(x, chosen), loop):
        experts.zero_grad()
        leaf = x.clone().requires_grad_()
        run(leaf).square().sum().backward()
        grads.append((leaf.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()))
    return grads


@pytest.fixture(autouse=True)
def moe(monkeypatch):
    monkeypatch.setattr(dense, "model", moe_model)


def test_alone_equals_batch_moe_gpu():
    assert all(dense.alone_vs_batches("consistent"))


def test_negative_control_baseline_moe_gpu():
    assert not all(dense.alone_vs_batches("baseline"))


def test_fp8_experts_alone_equals_batch_and_trainer_equals_engine_moe_gpu(monkeypatch):
    """Block-FP8 W8A8 everywhere, the experts included (per-token activation groups, the same in the
    engine's masked and the trainer's contiguous layout): alone == batch, trainer == engine over updates."""
    monkeypatch.setattr(dense, "model", lambda mode, seed=0: moe_model(mode, seed, quant="fp8"))
    assert all(dense.alone_vs_batches("consistent"))
    assert all(is_exact(d) for d in dense.trainer_diffs("consistent"))


def test_chunked_prefill_and_preemption_moe_gpu():
    assert all(dense.chunking("consistent"))


@pytest.mark.gpu_smoke
def test_trainer_equals_engine_moe_gpu():
    from onepath.numerics.diff import is_exact
    diffs = dense.trainer_diffs("consistent")
    assert all(is_exact(d) for d in diffs), diffs


@pytest.mark.gpu_smoke
def test_negative_control_trainer_baseline_moe_gpu():
    assert any(d["rollout_corr/tokens_differing_frac"] > 0 for d in dense.trainer_diffs("baseline"))


def layouts(mode):
    """Per token count: (masked == contiguous, contiguous == each token computed alone)."""
    block = moe_model(mode).model.layers[0].mlp
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for tokens in (1, 7, 33, 300):
        x = torch.randn(tokens, SHAPE["hidden_size"], generator=g, device="cuda").to(torch.bfloat16)
        _, experts = block.gate(x)
        contiguous = block.experts(x, experts, "contiguous")
        alone = torch.cat([block.experts(x[i:i + 1], experts[i:i + 1], "contiguous") for i in range(tokens)])
        results.append((torch.equal(block.experts(x, experts, "masked"), contiguous), torch.equal(alone, contiguous)))
    return results


def test_masked_vs_contiguous_layout_moe_gpu():
    # the negative control is the model-level one above (baseline alone != batch): on the H200, cuBLAS's
    # per-expert rows at these shapes did not move with the row count (2026-11-29), see
    # tests/ops/test_linear_grouped_gpu.py's stock-path control
    assert all(masked and alone for masked, alone in layouts("consistent"))


@pytest.mark.parametrize("tokens", [7, 200], ids=["masked", "contiguous"])
@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_experts_make_no_host_sync(mode, tokens):
    """The dispatch counts experts on the device, the masked buffer is sized for any routing, and both
    grouped GEMMs (ours, torch._grouped_mm) read the counts there: an MoE layer makes no host sync in
    either layout (torch's sync debug mode raises on one). Control: reading the counts on the host raises."""
    block = moe_model(mode).model.layers[0].mlp
    x = torch.randn(tokens, SHAPE["hidden_size"], device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    x = x.bfloat16()
    with torch.no_grad():
        expected = block(x)  # compiles the kernels, fills the caches
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = block(x)
            with pytest.raises(RuntimeError):
                torch.zeros(3, device="cuda").tolist()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, expected)


def test_moe_is_capturable_unless_its_experts_read_host_counts():
    assert moe_model("consistent").capturable and moe_model("baseline").capturable
    model = moe_model("consistent")  # expert parallelism: the all-to-alls take their split sizes on the host
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            block.ep = ExpertParallel(None, 0, 1, SHAPE["num_experts"])
    assert not model.capturable


def routings(tokens: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Top-8 expert choices [tokens, 8]: random; every token on experts 0..7 (the others empty); each
    pair on the next expert round the 64 (as many experts as the pairs can reach); reversed slots."""
    e, k = SHAPE["num_experts"], SHAPE["num_experts_per_tok"]
    first = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    spread = torch.arange(tokens * k).view(tokens, k) % e
    return [t.cuda() for t in (first, torch.arange(k).repeat(tokens, 1), spread, first.flip(1))]


def replayed_experts(mode: str, tokens: int, layout: str):
    """A layer's experts captured once in a CUDA graph at `tokens` tokens, replayed under each of
    `routings` with new inputs: (replayed, eager in this layout, eager contiguous, eager under the
    captured routing) per routing."""
    experts = moe_model(mode).model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(tokens)
    xs = [torch.randn(tokens, SHAPE["hidden_size"], generator=gen).bfloat16().cuda() for _ in range(4)]
    chosen = routings(tokens, gen)
    static_x, static_chosen = xs[0].clone(), chosen[0].clone()
    with torch.no_grad():
        side = torch.cuda.Stream()  # the first run compiles the kernels, outside the capture
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            experts(static_x, static_chosen, layout)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts(static_x, static_chosen, layout)
        results = []
        for x, c in zip(xs, chosen):
            static_x.copy_(x)
            static_chosen.copy_(c)
            graph.replay()
            results.append((out.clone(), experts(x, c, layout), experts(x, c, "contiguous"),
                            experts(x, chosen[0], layout)))
    return results


@pytest.mark.parametrize("tokens,layout", [(1, "masked"), (7, "masked"), (64, "masked"), (200, "contiguous")])
def test_captured_experts_replay_any_routing_with_the_eager_bits(tokens, layout):
    results = replayed_experts("consistent", tokens, layout)
    assert all(torch.equal(graph, eager) and torch.equal(graph, contiguous) for graph, eager, contiguous, _ in results)
    # control: a replay stuck on the captured routing (sizes baked in at capture) would show
    assert not any(torch.equal(graph, stale) for graph, _, _, stale in results[1:])


@pytest.mark.parametrize("tokens,layout", [(7, "masked"), (200, "contiguous")])
def test_captured_baseline_experts_replay_any_routing(tokens, layout):
    """torch._grouped_mm reads its offsets on the device: captured, it follows each routing (values
    close to the eager layer's; the baseline promises no bits)."""
    for graph, eager, _, _ in replayed_experts("baseline", tokens, layout):
        torch.testing.assert_close(graph, eager, rtol=1.6e-2, atol=1e-2)


def set_layout(model, layout):
    for m in model.modules():
        if isinstance(m, SparseMoeBlock):
            m.layout = layout
    return model


@pytest.mark.parametrize("layout", [None, "contiguous"], ids=["masked-decode", "contiguous"])
def test_graph_equals_eager_moe_gpu(monkeypatch, layout):
    """tests/engine/test_cuda_graphs_gpu.py's decode replayed from CUDA graphs (padded batches, 45 ragged
    requests) vs eager decode: the same tokens and log-probs; decode in the masked layout (the default
    up to 64 tokens) or the contiguous one."""
    monkeypatch.setattr(graphs, "model", lambda mode: set_layout(moe_model(mode), layout))
    assert all(graphs.graph_vs_eager("consistent"))


def test_negative_control_graph_vs_eager_baseline_moe_gpu(monkeypatch):
    monkeypatch.setattr(graphs, "model", moe_model)
    assert not all(graphs.graph_vs_eager("baseline"))


def trainer_diffs_with_graphs(monkeypatch, mode):
    """tests/engine/test_engine_gpu.py's trainer == engine procedure, its engine replaying decode graphs."""
    engines = []
    built = dense.engine
    monkeypatch.setattr(dense, "engine", lambda m, **options: engines.append(built(m, **options)) or engines[-1])
    diffs = dense.trainer_diffs(mode)
    assert engines[0].runner.graphs is not None and engines[0].stats.graph_steps > 0
    return diffs


def test_trainer_equals_engine_with_cuda_graphs_moe_gpu(monkeypatch):
    diffs = trainer_diffs_with_graphs(monkeypatch, "consistent")
    assert all(is_exact(d) for d in diffs), diffs


def test_negative_control_trainer_with_cuda_graphs_baseline_moe_gpu(monkeypatch):
    diffs = trainer_diffs_with_graphs(monkeypatch, "baseline")
    assert any(d["rollout_corr/tokens_differing_frac"] > 0 for d in diffs)
