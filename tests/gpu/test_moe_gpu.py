"""The MoE contract on the GPU (BF16, Triton kernels, eager decode): a Qwen3-MoE-shaped model with
random weights (8 layers, 64 experts, top-8). The procedures of tests/gpu/test_engine_gpu.py run on it:
a request alone vs inside batches, chunked prefill and preemption vs whole prefill, trainer == engine
before and after an update with in-place sync (no routing replay); masked vs contiguous expert layouts
give equal rows. Baseline negative controls."""
import pytest
import torch

from onepath.consistency.diff import is_exact
from onepath.models import build_decoder
from onepath.models.config import ModelConfig
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from tests.gpu import test_engine_gpu as dense

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


def test_trainer_equals_engine_moe_gpu():
    from onepath.consistency.diff import is_exact
    diffs = dense.trainer_diffs("consistent")
    assert all(is_exact(d) for d in diffs), diffs


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
    # tests/gpu/test_grouped_matmul_gpu.py's stock-path control
    assert all(masked and alone for masked, alone in layouts("consistent"))


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_contiguous_experts_make_no_host_sync(mode):
    """The dispatch counts experts on the device and both grouped GEMMs (ours, torch._grouped_mm) read
    the counts there: an MoE layer over more tokens than the masked layout takes makes no host sync
    (torch's sync debug mode raises on one). Control: reading the counts on the host raises."""
    block = moe_model(mode).model.layers[0].mlp
    x = torch.randn(200, SHAPE["hidden_size"], device="cuda", generator=torch.Generator("cuda").manual_seed(0))
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
