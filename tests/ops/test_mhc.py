"""mhc: DeepSeek-V4's hyper-connections against transformers' modules, and a token's bits alone equal to its bits in
a batch (a fixed split of the mixing GEMM, a fixed Sinkhorn order), with the stock ops as the negative control."""
import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

from onepath.ops import mhc

EPS, HC_EPS = 1e-6, 1e-6


def streams(gen, t, n, d):
    x = torch.randn(t, n, d, generator=gen)
    fn = torch.randn((2 + n) * n, n * d, generator=gen) / (n * d) ** 0.5
    return x, fn, torch.randn((2 + n) * n, generator=gen), torch.randn(3, generator=gen)


@pytest.mark.parametrize("n, iters", [(1, 1), (3, 5), (4, 20)])
def test_pre_post_and_head_match_transformers(consistent, gen, n, iters):
    d, t = 24, 9
    config = DeepseekV4Config(hidden_size=d, hc_mult=n, hc_sinkhorn_iters=iters, hc_eps=HC_EPS, rms_norm_eps=EPS)
    x, fn, base, scale = streams(gen, t, n, d)
    hc, head = DeepseekV4HyperConnection(config), DeepseekV4HyperHead(config)
    with torch.no_grad():
        hc.fn.copy_(fn), hc.base.copy_(base), hc.scale.copy_(scale)
        head.hc_fn.copy_(fn[:n]), head.hc_base.copy_(base[:n]), head.hc_scale.copy_(scale[:1])
        post, comb, collapsed = hc(x[None])
        out = torch.randn(t, d, generator=gen)
        mixed = post[0].unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb[0].transpose(-1, -2), x)
        final = head(x[None])[0]
    got_post, got_comb, got_collapsed = mhc.hc_pre(consistent, x, fn, base, scale, EPS, HC_EPS, iters)
    for got, want in ((got_post, post[0]), (got_comb, comb[0]), (got_collapsed, collapsed[0]),
                      (mhc.hc_post(consistent, out, x, got_post, got_comb), mixed),
                      (mhc.hc_head(consistent, x, fn[:n], base[:n], scale[:1], EPS, HC_EPS), final)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sinkhorn_makes_comb_doubly_stochastic(consistent, gen):
    x, fn, base, scale = streams(gen, 13, 4, 32)
    _, comb, _ = mhc.hc_pre(consistent, x, fn, base, scale, EPS, HC_EPS, 20)
    torch.testing.assert_close(comb.sum(-1), torch.ones(13, 4), atol=5e-2, rtol=0)  # 20 iterations: near
    torch.testing.assert_close(comb.sum(-2), torch.ones(13, 4), atol=1e-5, rtol=0)  # columns normalised last


@pytest.mark.parametrize("t, n, d", [(37, 4, 64), (20, 2, 300)])
def test_token_alone_equals_token_in_a_batch(consistent, baseline, gen, t, n, d):
    x, fn, base, scale = streams(gen, t, n, d)
    out = torch.randn(t, d, generator=gen)

    def alone_and_batch(spec):
        pre = lambda rows: mhc.hc_pre(spec, x[rows], fn, base, scale, EPS, HC_EPS, 20)
        head = lambda rows: mhc.hc_head(spec, x[rows], fn[:n], base[:n], scale[:1], EPS, HC_EPS)
        batch = (*pre(slice(None)), head(slice(None)))
        alone = [(*pre(slice(i, i + 1)), head(slice(i, i + 1))) for i in range(t)]
        return [torch.cat([a[j] for a in alone]) for j in range(4)], list(batch)

    alone, batch = alone_and_batch(consistent)
    assert all(torch.equal(a, b) for a, b in zip(alone, batch))
    post, comb = batch[0], batch[1]
    assert torch.equal(torch.cat([mhc.hc_post(consistent, out[i:i + 1], x[i:i + 1], post[i:i + 1], comb[i:i + 1])
                                  for i in range(t)]), mhc.hc_post(consistent, out, x, post, comb))
    # the stock mixing GEMM runs another kernel at M = 1 than over the batch
    alone, batch = alone_and_batch(baseline)
    assert not torch.equal(alone[2], batch[2]) and not torch.equal(alone[3], batch[3])


def test_gradient_is_the_reference_one(consistent, gen):
    x, fn, base, scale = streams(gen, 5, 3, 8)
    leaves = [t.clone().requires_grad_() for t in (x, fn, base, scale)]
    again = [t.clone().requires_grad_() for t in (x, fn, base, scale)]
    post, comb, collapsed = mhc.hc_pre(consistent, *leaves, EPS, HC_EPS, 4)
    (post.sum() + comb.square().sum() + collapsed.square().sum()).backward()
    post, comb, collapsed = mhc.reference_pre(*again, EPS, HC_EPS, 4)
    (post.sum() + comb.square().sum() + collapsed.square().sum()).backward()
    for a, b in zip(leaves, again):
        torch.testing.assert_close(a.grad, b.grad)
