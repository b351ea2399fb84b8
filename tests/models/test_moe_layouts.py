"""Expert outputs do not depend on the layout: the engine's masked layout (fixed-capacity chunks per
expert), the trainer's contiguous layout (pairs packed by expert) and each (token, slot) pair
computed alone give bitwise the same rows. The baseline backend (one F.linear over the rows, its
kernel chosen by M) must show a difference (negative control). Routing follows the fixed tie rule."""
import pytest
import torch

from onepath.models.moe import LAYOUTS, SparseMoeBlock, experts_contiguous, experts_masked
from tests.tiny import tiny_moe_model

TOKENS = (1, 7, 33, 100)  # one token, under a chunk, two chunks, several chunks per expert


def block_of(model) -> SparseMoeBlock:
    return model.model.layers[0].mlp


def cases(block: SparseMoeBlock, dtype):
    """(x, experts) pairs: the router's choice for random rows, and a skewed one (expert 3 in every token)."""
    g = torch.Generator().manual_seed(0)
    for t in TOKENS:
        x = torch.randn(t, block.gate.weight.shape[1], generator=g).to(dtype)
        with torch.no_grad():
            _, experts = block.gate(x)
        yield x, experts
        other = (3 + torch.randint(1, block.experts.num_experts, (t,), generator=g)) % block.experts.num_experts
        yield x, torch.stack([torch.full_like(other, 3), other], dim=1)


def alone(block: SparseMoeBlock, x, experts):
    return torch.stack([torch.cat([block.experts.mlp(int(e), x[i:i + 1]) for e in experts[i]])
                        for i in range(x.shape[0])])


def layouts_agree(mode: str, dtype: str = "float32") -> list[bool]:
    block = block_of(tiny_moe_model(mode, dtype=dtype))
    mlp, n = block.experts.mlp, block.experts.num_experts
    results = []
    with torch.no_grad():
        for x, experts in cases(block, block.gate.weight.dtype):
            contiguous = experts_contiguous(mlp, x, experts, n)
            ys = [experts_masked(mlp, x, experts, n, capacity) for capacity in (16, 4)] + [alone(block, x, experts)]
            assert contiguous.shape == (x.shape[0], experts.shape[1], x.shape[1])
            results += [torch.equal(contiguous, y) for y in ys]
    return results


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_masked_contiguous_and_alone_give_the_same_bits(dtype):
    assert all(layouts_agree("consistent", dtype))


def test_negative_control_baseline_depends_on_the_layout():
    results = layouts_agree("baseline")
    assert not all(results)


def test_block_output_does_not_depend_on_the_layout_or_the_batch():
    block = block_of(tiny_moe_model("consistent"))
    x = torch.randn(70, 48, generator=torch.Generator().manual_seed(1))
    outs = {}
    with torch.no_grad():
        for layout in ("masked", "contiguous"):
            block.layout = layout
            outs[layout] = block(x)
        block.layout = None
        rows = torch.cat([block(x[i:i + 1]) for i in range(0, 70, 9)] + [block(x[i:i + 9]) for i in range(1, 70, 9)])
    assert torch.equal(outs["masked"], outs["contiguous"])
    order = list(range(0, 70, 9)) + [j for i in range(1, 70, 9) for j in range(i, min(i + 9, 70))]
    assert torch.equal(rows, outs["masked"][order])


def test_router_ties_go_to_the_larger_expert_in_descending_slot_order():
    block = block_of(tiny_moe_model("consistent"))
    with torch.no_grad():
        w = block.gate.weight
        w.mul_(0.01)
        w[2] = w[5] = w[7] = torch.ones(w.shape[1])  # three experts tie at the top for positive rows
        weights, experts = block.gate(torch.rand(5, w.shape[1]) + 0.5)
    assert experts.tolist() == [[7, 5]] * 5
    assert torch.equal(weights, torch.full((5, 2), 0.5))  # normalised over the two equal slots


def test_unknown_layout_is_refused():
    block = block_of(tiny_moe_model("consistent"))
    block.layout = "padded"
    with pytest.raises(ValueError, match="padded"):
        block(torch.randn(3, 48))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_baseline_cuda_experts_run_one_stock_grouped_gemm_per_projection(monkeypatch):
    """The baseline CUDA BF16 spec's experts, on CPU tensors (torch 2.13's _grouped_mm runs there too):
    both layouts through torch._grouped_mm, two launches a forward, close to the per-expert loop."""
    from onepath.models.moe import Experts
    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops import Ops, silu_mul
    from onepath.ops.cuda import silu_mul as cuda_silu_mul

    monkeypatch.setattr(cuda_silu_mul, "silu_mul", silu_mul.reference)  # the fused Triton SwiGLU needs a GPU

    model = tiny_moe_model("baseline", dtype="bfloat16")  # the CPU spec: F.linear per expert
    block = block_of(model)
    stock = Experts(Ops(ExecutionSpec.default("baseline", "cuda")), model.config, torch.bfloat16)
    stock.load_state_dict(block.experts.state_dict())
    assert stock.ops.grouped_experts and not block.experts.ops.grouped_experts
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    with torch.no_grad():
        for x, experts in cases(block, torch.bfloat16):
            want = alone(block, x, experts)
            for layout in ("contiguous", "masked"):
                calls.clear()
                got = stock(x, experts, layout)
                assert len(calls) == 2 and got.dtype == torch.float32, (layout, calls)
                torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


def quantised_layouts_agree(mode: str, preset: str) -> list[bool]:
    """Each case's expert rows through the block's experts (grouped_linear on the stacked quantised weights) in
    both layouts, against every (token, slot) pair alone through the per-expert linear()."""
    block = block_of(tiny_moe_model(mode, quant=preset))
    results = []
    with torch.no_grad():
        for x, experts in cases(block, block.gate.weight.dtype):
            want = alone(block, x, experts)
            results += [torch.equal(block.experts(x, experts, layout), want) for layout in LAYOUTS]
    return results


@pytest.mark.parametrize("preset", ["fp8", "nvfp4_w4a16", "nvfp4_w4a4"])
def test_quantised_experts_in_both_layouts_give_the_bits_of_each_pair_alone(preset):
    assert block_of(tiny_moe_model("consistent", quant=preset)).experts.ops.grouped_experts
    assert all(quantised_layouts_agree("consistent", preset))


def test_negative_control_baseline_quantised_experts_move_with_the_layout():
    assert not all(quantised_layouts_agree("baseline", "fp8"))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("preset", ["fp8", "nvfp4_w4a16", "nvfp4_w4a4"])
def test_baseline_cuda_quantised_experts_run_one_stock_grouped_gemm_per_projection(monkeypatch, preset):
    """The baseline CUDA spec's quantised experts, on CPU tensors: both layouts through torch._grouped_mm on
    the dequantised operands (BF16), two launches a forward, close to the per-expert loop of the CPU baseline."""
    from onepath.models.moe import Experts
    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops import Ops, silu_mul
    from onepath.ops.cuda import silu_mul as cuda_silu_mul

    monkeypatch.setattr(cuda_silu_mul, "silu_mul", silu_mul.reference)
    model = tiny_moe_model("baseline", dtype="bfloat16", quant=preset)
    block = block_of(model)
    stock = Experts(Ops(ExecutionSpec.default("baseline", "cuda", quant=preset)), model.config, torch.bfloat16)
    stock.load_state_dict(block.experts.state_dict())
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    with torch.no_grad():
        for x, experts in cases(block, torch.bfloat16):
            want = alone(block, x, experts)
            for layout in LAYOUTS:
                calls.clear()
                got = stock(x, experts, layout)
                assert len(calls) == 2 and got.dtype == torch.float32, (layout, calls)
                # BF16 operands and outputs against the CPU baseline's FP32 ones: a code of the SwiGLU output may
                # flip, by a whole E2M1 step under W4A4
                assert ((got - want).norm() / want.norm()).item() < (0.1 if preset == "nvfp4_w4a4" else 0.03)
