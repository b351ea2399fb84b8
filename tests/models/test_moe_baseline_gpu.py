"""The MoE baseline's experts on the GPU: one stock torch._grouped_mm per projection (BF16) in place of
a F.linear per expert. Not batch-invariant (the baseline need not be), but correct: values and
gradients close to the per-expert loop's, and the baseline MoE engine generates every token with it.
Shapes of tests/models/test_moe_gpu.py (64 experts, top-8) and the bench's Qwen3-30B-A3B layer."""
import pytest
import torch

from onepath.engine.sampling_params import SamplingParams
from onepath.models.moe import experts_contiguous
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import linear as L
from tests.engine import test_engine_gpu as dense
from tests.models.test_moe_gpu import SHAPE, grads_vs_loop, moe_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")]

BF16 = dict(rtol=1.6e-2, atol=1e-2)  # a BF16 rounding or two apart: the two paths' GEMM kernels differ


@pytest.fixture
def grouped_mm_calls(monkeypatch):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    return calls


def packed(counts, k, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(len(counts), n, k, generator=g, device="cuda") / k ** 0.5).bfloat16()
    return x, w


# (counts, K, N): awkward group sizes with empty groups; the 30B-A3B gate/up and down projections at batch 256
CASES = [([3, 0, 17, 1, 0, 130, 9], 512, 256), ([16] * 128, 2048, 1536), ([16] * 128, 768, 2048),
         ([0] * 127 + [40], 2048, 1536)]


@pytest.mark.parametrize("counts,k,n", CASES)
def test_baseline_grouped_linear_matches_the_per_expert_loop_gpu(counts, k, n, grouped_mm_calls):
    spec = ExecutionSpec.default("baseline", "cuda")
    x, w = packed(counts, k, n)
    want = L.grouped_reference(x, w, counts)
    got = L.grouped_linear(spec, x, w, counts)
    assert grouped_mm_calls == [x.shape[0]] and got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, **BF16)
    wide = L.grouped_linear(spec, x, w, counts, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide, got.float())
    shifted = [counts[0] + 1, *counts[1:-1], counts[-1] - 1]  # negative control: rows in the wrong groups show
    assert not torch.allclose(L.grouped_linear(spec, x, w, shifted), want, **BF16)


def test_baseline_grouped_linear_gradients_match_the_loop_gpu():
    spec = ExecutionSpec.default("baseline", "cuda")
    counts = [3, 0, 17, 1, 0, 130, 9]
    x, w = (t.requires_grad_() for t in packed(counts, 512, 256, seed=1))
    g = torch.randn(x.shape[0], 256, device="cuda")
    L.grouped_linear(spec, x, w, counts, out_dtype=torch.float32).backward(g)
    x2, w2 = (t.detach().clone().requires_grad_() for t in (x, w))
    L.grouped_reference(x2, w2, counts).float().backward(g)
    torch.testing.assert_close(x.grad, x2.grad, **BF16)
    torch.testing.assert_close(w.grad, w2.grad, **BF16)


def test_baseline_moe_experts_match_the_per_expert_loop_gpu(grouped_mm_calls):
    block = moe_model("baseline").model.layers[0].mlp
    experts = block.experts
    assert experts.ops.grouped_experts
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tokens in (1, 7, 33, 300):
        x = torch.randn(tokens, SHAPE["hidden_size"], generator=gen, device="cuda").bfloat16()
        with torch.no_grad():
            _, chosen = block.gate(x)
            loop = experts_contiguous(experts.mlp, x, chosen, experts.num_experts)
            for layout in ("contiguous", "masked"):
                grouped_mm_calls.clear()
                got = experts(x, chosen, layout)
                assert len(grouped_mm_calls) == 2 and got.dtype == torch.float32, (tokens, layout)
                torch.testing.assert_close(got, loop, **BF16)
    # backward: gradients of the grouped forward vs the per-expert loop's, BF16 sums in another order
    # (an element near zero may lose every digit): compared by relative norm, as the consistent grouped GEMM's
    for a, b in zip(*grads_vs_loop(block, gen)):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2


def test_baseline_moe_engine_generates_with_the_stock_grouped_gemm_gpu(grouped_mm_calls):
    engine = dense.engine(moe_model("baseline"))
    prompts = dense.random_prompts(torch.Generator().manual_seed(5), 24, high=200)
    outs = engine.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True, seed=1))
    assert all(o.error is None and len(o.token_ids) == 30 for o in outs)
    # decode replays captured graphs (torch._grouped_mm reads device offsets), prefill runs eagerly
    assert engine.stats.graph_steps > 0 and engine.stats.eager_steps > 0
    assert grouped_mm_calls, "the baseline MoE engine never reached torch._grouped_mm"
