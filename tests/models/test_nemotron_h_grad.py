"""The trainer's backward through a Nemotron-H model is correct: the forward runs the engine's operators (the
chunked scan, the conv, the gated norm), the backward differentiates the reference math (ops/autograd.py). The
gradients of a Mamba-2 mixer equal a float64 plain-loop recurrence written here, token by token; those of an MoE
block a float64 plain-torch router and experts; the whole model's transformers' NemotronH run in float64."""
import pytest
import torch
import torch.nn.functional as F

from onepath.models.batch import ForwardBatch
from onepath.models.nemotron_h import NemotronHDecoder
from onepath.ops.spans import SeqSpans
from tests.models.test_nemotron_h_phases import tiny_model
from tests.models.test_nemotron_h_vs_transformers import hf_model, load_ours, sequences

RTOL, ATOL = 1e-4, 1e-6


def mixer_loop(x, p, m):
    """One sequence x [T, hidden] through a Mamba-2 mixer in float64, the scan one token at a time."""
    h, d, g, n = m.heads, m.head_dim, m.groups, m.state_size
    proj = x @ p["in_proj.weight"].T + (p["in_proj.bias"] if "in_proj.bias" in p else 0)
    z, xbc, dt = proj.split([m.inner, m.conv_dim, h], dim=-1)
    w = p["conv1d.weight"][:, 0]
    taps = w.shape[-1]
    padded = torch.cat([xbc.new_zeros(taps - 1, m.conv_dim), xbc])
    conv = torch.stack([(padded[t:t + taps].T * w).sum(-1) for t in range(x.shape[0])])
    xbc = F.silu(conv + (p["conv1d.bias"] if "conv1d.bias" in p else 0))
    xs, b, c = xbc.split([m.inner, g * n, g * n], dim=-1)
    a = -torch.exp(p["A_log"])
    state, ys = x.new_zeros(h, d, n), []
    for t in range(x.shape[0]):
        step = F.softplus(dt[t] + p["dt_bias"]).clamp(*m.dt_limit)
        bt = b[t].view(g, n).repeat_interleave(h // g, 0)
        ct = c[t].view(g, n).repeat_interleave(h // g, 0)
        xt = xs[t].view(h, d)
        state = torch.exp(step * a)[:, None, None] * state + (step[:, None] * xt)[..., None] * bt[:, None, :]
        ys.append(((state * ct[:, None, :]).sum(-1) + p["D"][:, None] * xt).reshape(-1))
    y = torch.stack(ys) * F.silu(z)
    grouped = y.view(y.shape[0], g, -1)
    y = (grouped / torch.sqrt(grouped.pow(2).mean(-1, keepdim=True) + m.eps)).view(y.shape) * p["norm.weight"]
    return y @ p["out_proj.weight"].T + (p["out_proj.bias"] if "out_proj.bias" in p else 0)


@pytest.mark.parametrize("overrides", [{}, dict(use_bias=True, n_groups=1, conv_kernel=3,
                                               time_step_limit=(0.02, 0.3))])
def test_mixer_gradients_match_a_float64_loop(overrides):
    model = tiny_model(seed=3, **overrides)
    mixer = model.model.layers[0].mixer
    g = torch.Generator().manual_seed(4)
    lengths = (19, 6)
    x = torch.randn(sum(lengths), 32, generator=g, requires_grad=True)
    cotangent = torch.randn(sum(lengths), 32, generator=g)
    (mixer(x, SeqSpans((0, 19, 25), (0, 0))) * cotangent).sum().backward()
    params = dict(mixer.named_parameters())
    leaves = {k: v.detach().double().requires_grad_() for k, v in params.items()}
    x64 = x.detach().double().requires_grad_()
    out = torch.cat([mixer_loop(part, leaves, mixer) for part in x64.split(lengths)])
    (out * cotangent.double()).sum().backward()
    assert_grads_match(x, params, x64, leaves)


def assert_grads_match(x, params, x64, leaves):
    """Every gradient (x's and each parameter's) nonzero and within RTOL of its float64 twin's."""
    for name, p in [("x", x), *params.items()]:
        want = x64.grad if name == "x" else leaves[name].grad
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad.double(), want, rtol=RTOL, atol=1e-5 * want.abs().max(),
                                   msg=lambda m: f"{name}: {m}")


def moe_reference(x, p, gate):
    """The MoE block in plain float64 torch: sigmoid scores, group pruning, top-k by the corrected scores."""
    scores = torch.sigmoid(x @ p["gate.weight"].T)
    choice = scores + p["gate.e_score_correction_bias"]
    t, e = choice.shape
    per_group = choice.view(t, gate.groups, -1)
    group_scores = per_group.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_scores).scatter(1, group_scores.topk(gate.topk_group, dim=-1).indices, 1.0)
    choice = choice.masked_fill(keep.repeat_interleave(e // gate.groups, 1) == 0, float("-inf"))
    experts = choice.topk(gate.k, dim=-1).indices
    weights = scores.gather(1, experts)
    if gate.normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * gate.scaling
    h = x @ p["fc1_latent_proj.weight"].T if "fc1_latent_proj.weight" in p else x
    up = torch.relu(torch.einsum("td,tkid->tki", h, p["experts.up_proj"][experts])) ** 2
    routed = (weights[..., None] * torch.einsum("tki,tkdi->tkd", up, p["experts.down_proj"][experts])).sum(1)
    if "fc2_latent_proj.weight" in p:
        routed = routed @ p["fc2_latent_proj.weight"].T
    shared = torch.relu(x @ p["shared_experts.up_proj.weight"].T) ** 2 @ p["shared_experts.down_proj.weight"].T
    return routed + shared, experts


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("overrides", [{}, dict(moe_latent_size=16, norm_topk_prob=False, routed_scaling_factor=2.0)])
def test_moe_gradients_match_a_float64_reference(layout, overrides):
    block = tiny_model(seed=5, **overrides).model.layers[1].mixer
    block.layout = layout
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(0.2 * torch.randn(6, generator=g))
    x = torch.randn(29, 32, generator=g, requires_grad=True)
    cotangent = torch.randn(29, 32, generator=g)
    (block(x) * cotangent).sum().backward()
    params = dict(block.named_parameters())
    leaves = {k: v.detach().double().requires_grad_() for k, v in params.items()}
    leaves["gate.e_score_correction_bias"] = block.gate.e_score_correction_bias.double()
    x64 = x.detach().double().requires_grad_()
    out, experts = moe_reference(x64, leaves, block.gate)
    with torch.no_grad():
        assert torch.equal(experts, block.gate(x)[1]), "the float64 reference routed differently"
    (out * cotangent.double()).sum().backward()
    assert_grads_match(x, params, x64, leaves)


def test_model_gradients_match_transformers_in_float64(tmp_path):
    ref = hf_model("every_kind")
    ref.config._experts_implementation = "eager"
    ref.save_pretrained(tmp_path)
    model = load_ours(tmp_path)
    assert isinstance(model, NemotronHDecoder)
    ref.double()
    seqs = sequences(ref.config.vocab_size, lengths=(5, 23))
    g = torch.Generator().manual_seed(3)
    cotangents = [torch.randn(len(s), ref.config.vocab_size, generator=g) for s in seqs]
    sum((ref(torch.tensor([s]), use_cache=False).logits[0] * c.double()).sum()
        for s, c in zip(seqs, cotangents)).backward()
    batch, num_blocks = ForwardBatch.for_sequences(seqs, 16)
    logits = model.compute_logits(model(batch, model.make_cache(num_blocks, 16)))
    (logits * torch.cat(cotangents)).sum().backward()
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        w = want[name].grad
        torch.testing.assert_close(p.grad, w.float(), rtol=RTOL, atol=1e-5 * w.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")
