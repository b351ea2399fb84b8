import torch

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
