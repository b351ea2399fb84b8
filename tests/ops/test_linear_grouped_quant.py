"""Quantised experts through grouped_linear (block-FP8 W8A8, NVFP4 W4A16 and W4A4) on the CPU: every row of
a grouped call has the bits linear() gives it alone against its expert's weight, with the group sizes a list
or a device tensor, packed (the trainer's contiguous layout) or in a buffer with an unused tail (the engine's
masked layout); the stacked weights are quantised expert by expert, once per weight version; the gradient is
the plain grouped linear's (straight-through). Negative control: the baseline's rows move with their batch."""
import pytest
import torch

from onepath.numerics.quant import FP8Tensor, NVFP4Tensor, quantize
from onepath.numerics.spec import FP8_WEIGHT, NVFP4_WEIGHT, ExecutionSpec
from onepath.ops import linear as L
from onepath.ops.linear_quant import group_of_rows, quantize_experts, refresh_quantized
from tests.ops.test_linear_quant import wide

PRESETS = ("fp8", "nvfp4_w4a16", "nvfp4_w4a4")
GROUPS, N, K = 5, 70, 200  # N and K off the 128 / 16 blocks: ragged edges


def spec(preset, mode="consistent"):
    return ExecutionSpec.default(mode, "cpu", quant=preset)


def experts(gen, n=N):
    return wide(GROUPS * n, K, gen).reshape(GROUPS, n, K) * 0.1


def rows_alone(spec, x, w, counts, out_dtype=None):
    """linear() of each row alone against its group's weight."""
    groups = group_of_rows(counts, x.shape[0], x.device).tolist()
    return torch.cat([L.linear(spec, x[i:i + 1], w[g], out_dtype=out_dtype) for i, g in enumerate(groups)])


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("counts", [[3, 0, 17, 1, 9], [0, 0, 1, 0, 0], [16, 16, 0, 32, 5]])
def test_grouped_rows_equal_rows_alone(preset, counts, gen):
    w, x = experts(gen), wide(sum(counts), K, gen)
    for out_dtype in (None, torch.float32):
        alone = rows_alone(spec(preset), x, w, counts, out_dtype)
        for given in (counts, torch.tensor(counts)):
            assert torch.equal(L.grouped_linear(spec(preset), x, w, given, out_dtype=out_dtype), alone), (preset, given)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_buffer_tail_leaves_the_counted_rows_alone(preset, gen):
    """The masked layout's buffer: rows past the counts' sum are never anyone's; the counted rows keep their bits."""
    counts, tail = [4, 0, 8, 4, 0], 20
    w, x = experts(gen), wide(16 + tail, K, gen)
    got = L.grouped_linear(spec(preset), x, w, torch.tensor(counts))
    assert torch.equal(got[:16], rows_alone(spec(preset), x[:16], w, counts))


@pytest.mark.parametrize("preset", PRESETS)
def test_negative_control_baseline_rows_move_with_the_batch(preset, gen):
    w = experts(gen)
    moved = False
    for m in (2, 15, 17, 40):
        x = wide(m, K, gen)
        counts = [m, 0, 0, 0, 0]
        moved |= not torch.equal(L.grouped_linear(spec(preset, "baseline"), x, w, counts),
                                 rows_alone(spec(preset, "baseline"), x, w, counts))
    assert moved


@pytest.mark.parametrize("n", [128, N])  # whole weight blocks (one quantiser call), ragged ones (one per expert)
@pytest.mark.parametrize("rule", [FP8_WEIGHT, NVFP4_WEIGHT], ids=["fp8", "nvfp4"])
def test_stacked_experts_quantise_as_each_expert_alone(rule, n, gen):
    w = experts(gen, n)
    w[2] *= 50  # an expert of its own scale: its amax must not reach the others
    stacked = quantize_experts(w, rule)
    for g in range(GROUPS):
        alone = quantize(w[g], rule)
        if isinstance(alone, FP8Tensor):
            assert torch.equal(stacked.codes[g], alone.codes) and torch.equal(stacked.scales[g], alone.scales)
        else:
            assert isinstance(stacked, NVFP4Tensor)
            assert torch.equal(stacked.codes[g], alone.codes)
            assert torch.equal(stacked.scales[g].float(), alone.scales.float())
            assert torch.equal(stacked.encode_scale[g], alone.encode_scale)


@pytest.mark.parametrize("preset", PRESETS)
def test_gradient_is_the_plain_grouped_linear(preset, gen):
    counts = [3, 0, 17, 1, 9]
    w0, x0 = experts(gen), wide(30, K, gen)
    grads = []
    for s in (spec(preset), ExecutionSpec.default("consistent", "cpu")):
        w, x = w0.clone().requires_grad_(), x0.clone().requires_grad_()
        y = L.grouped_linear(s, x, w, torch.tensor(counts))
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        grads.append((x.grad, w.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])


@pytest.mark.parametrize("preset", PRESETS)
def test_an_in_place_update_requantises_the_stacked_weights(preset, gen):
    counts = [3, 0, 17, 1, 9]
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(experts(gen), requires_grad=False)
    w, x = module.w, wide(30, K, gen)
    before = L.grouped_linear(spec(preset), x, w, counts)
    cache = w._quantized[1]
    with torch.no_grad():
        w.mul_(1.5)
    refresh_quantized(module)
    assert w._quantized[1] is cache  # rewritten in place: a captured graph reads the new codes
    after = L.grouped_linear(spec(preset), x, w, counts)
    assert not torch.equal(after, before)
    assert torch.equal(after, rows_alone(spec(preset), x, w, counts))
