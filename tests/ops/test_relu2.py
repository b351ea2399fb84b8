import torch

from onepath.ops.relu2 import relu2


def test_relu2_is_the_square_of_relu_rounded_once(consistent, baseline, gen):
    x = torch.randn(37, 101, generator=gen).bfloat16()
    want = (torch.relu(x.double()) ** 2).float().bfloat16()  # the FP32 square is exact enough to round the same
    assert torch.equal(relu2(consistent, x), want) and torch.equal(relu2(baseline, x), want)
    assert torch.equal(relu2(consistent, x[5:6]), relu2(consistent, x)[5:6])


def test_relu2_gradient(consistent, gen):
    x = torch.randn(9, 7, generator=gen).requires_grad_()
    (g,) = torch.autograd.grad(relu2(consistent, x).sum(), x)
    torch.testing.assert_close(g, 2 * torch.relu(x.detach()))
