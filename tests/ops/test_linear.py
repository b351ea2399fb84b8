import pytest
import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops import linear as L


def _rows_alone_vs_batch(spec, x, w, b, gen):
    """Each probe row alone vs. inside batches of awkward sizes at random positions."""
    worst = 0.0
    for m in (1, 2, 3, 15, 16, 17, 63, 100):
        batch = torch.randn(m, x.shape[1], generator=gen)
        pos = int(torch.randint(0, m, (1,), generator=gen))
        batch[pos] = x[0]
        alone = L.linear(spec, x, w, b)
        inside = L.linear(spec, batch, w, b)[pos:pos + 1]
        worst = max(worst, (alone - inside).abs().max().item())
        if spec.mode == "consistent":
            assert torch.equal(alone, inside), f"m={m} pos={pos}"
    return worst


def test_linear_batch_invariant_with_negative_control(consistent, baseline, gen):
    k, n = 200, 333
    x = torch.randn(1, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    assert _rows_alone_vs_batch(consistent, x, w, b, gen) == 0.0
    assert _rows_alone_vs_batch(baseline, x, w, None, gen) > 0.0


def test_linear_values_close_to_reference(consistent, gen):
    x, w = torch.randn(37, 64, generator=gen), torch.randn(29, 64, generator=gen)
    torch.testing.assert_close(L.linear(consistent, x, w), x @ w.T, rtol=1e-5, atol=1e-5)


def test_linear_gradient_is_plain_math(consistent, gen):
    x = torch.randn(21, 48, generator=gen, requires_grad=True)
    w = torch.randn(30, 48, generator=gen, requires_grad=True)
    b = torch.randn(30, generator=gen, requires_grad=True)
    g = torch.randn(21, 30, generator=gen)
    L.linear(consistent, x, w, b).backward(g)
    got = (x.grad, w.grad, b.grad)
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    (x2 @ w2.T + b2).backward(g)
    for a, e in zip(got, (x2.grad, w2.grad, b2.grad)):
        torch.testing.assert_close(a, e)


def test_backward_refuses_weights_changed_after_forward(consistent, gen):
    x = torch.randn(5, 8, generator=gen, requires_grad=True)
    w = torch.randn(4, 8, generator=gen, requires_grad=True)
    y = L.linear(consistent, x, w)
    with torch.no_grad():
        w.add_(1.0)
    try:
        y.sum().backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
    else:
        raise AssertionError("backward ran on weights changed since the forward")


# grouped_linear on baseline CUDA BF16: one stock torch._grouped_mm. The spec says CUDA; the tensors
# are the CPU's, where torch 2.13's _grouped_mm runs too, so the dispatch and the values are checked here
# (tests/models/test_moe_baseline_gpu.py runs it on the GPU).
COUNTS = [3, 0, 17, 1, 9]  # groups of awkward sizes, an empty one included
stock = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")


@pytest.fixture
def grouped_mm_calls(monkeypatch):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    return calls


def _grouped_operands(gen, k=48, n=40, dtype=torch.bfloat16):
    x = torch.randn(sum(COUNTS), k, generator=gen).to(dtype)
    w = (torch.randn(len(COUNTS), n, k, generator=gen) / k ** 0.5).to(dtype)
    return x, w


@stock
def test_baseline_grouped_linear_is_one_stock_grouped_mm(gen, grouped_mm_calls):
    spec = ExecutionSpec.default("baseline", "cuda")
    x, w = _grouped_operands(gen)
    want = L.grouped_reference(x, w, COUNTS)
    got = L.grouped_linear(spec, x, w, COUNTS)
    assert grouped_mm_calls == [x.shape] and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    # the down projection's FP32 output: the BF16 result cast, as the per-group loop gives it
    wide = L.grouped_linear(spec, x, w, COUNTS, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide, got.float())
    # negative control: rows given to the wrong groups show
    shifted = [4, 0, 16, 1, 9]
    assert not torch.allclose(L.grouped_linear(spec, x, w, shifted), want, rtol=1.6e-2, atol=1e-2)


@stock
def test_baseline_grouped_linear_gradient_is_the_per_group_loop(gen, grouped_mm_calls):
    spec = ExecutionSpec.default("baseline", "cuda")
    x, w = (t.requires_grad_() for t in _grouped_operands(gen))
    g = torch.randn(x.shape[0], w.shape[1], generator=gen)
    L.grouped_linear(spec, x, w, COUNTS, out_dtype=torch.float32).backward(g)
    x2, w2 = (t.detach().clone().requires_grad_() for t in (x, w))
    L.grouped_reference(x2, w2, COUNTS).float().backward(g)
    assert len(grouped_mm_calls) == 1  # forward only: the backward differentiates the per-group F.linear
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


@stock
def test_grouped_linear_keeps_the_loop_where_the_stock_kernel_does_not_apply(gen, grouped_mm_calls, monkeypatch):
    baseline_cuda = ExecutionSpec.default("baseline", "cuda")
    assert L.grouped_kernel(baseline_cuda) and L.grouped_kernel(ExecutionSpec.default("consistent", "cuda"))
    assert not L.grouped_kernel(ExecutionSpec.default("baseline", "cpu"))
    assert not L.grouped_kernel(ExecutionSpec(mode="baseline", device="cuda"))  # FP32
    assert L.grouped_kernel(ExecutionSpec.default("baseline", "cuda", quant="fp8"))  # on the dequantised operands
    for x, w in (_grouped_operands(gen, k=36), _grouped_operands(gen, n=36),  # rows not 16-byte multiples
                 _grouped_operands(gen, dtype=torch.float32)):
        assert torch.equal(L.grouped_linear(baseline_cuda, x, w, COUNTS), L.grouped_reference(x, w, COUNTS))
    x, w = _grouped_operands(gen)
    assert L.grouped_linear(baseline_cuda, x[:0], w, [0] * len(COUNTS)).shape == (0, 40)  # no rows
    assert grouped_mm_calls == []
    monkeypatch.delattr(torch, "_grouped_mm")
    assert not L.grouped_kernel(baseline_cuda)
    assert torch.equal(L.grouped_linear(baseline_cuda, x, w, COUNTS), L.grouped_reference(x, w, COUNTS))
