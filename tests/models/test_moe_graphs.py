"""The MoE decode path that CUDA graphs hold, on the CPU. Where the experts run grouped, the masked
layout's buffer holds the most chunks T * k pairs can fill and the grouped GEMMs read the expert counts
from a tensor: the shapes follow T only and nothing is read on the host. Its rows must keep the bits of
the per-chunk loop, the contiguous layout and each pair alone, whatever the routing; the padded
static-buffer decode of the engine's graphs (DecodeGraphs, run eagerly here) must equal eager decode;
gradients through the buffer's unwritten tail stay those of the loop. Baseline negative controls. The GPU side (capture, replay) is tests/models/test_moe_gpu.py."""
import dataclasses
import itertools

import pytest
import torch

from onepath.models.moe import ExpertParallel, Experts, experts_contiguous, experts_masked, max_chunks
from onepath.ops import Ops
from tests.engine import test_decode_graphs as dense_graphs
from tests.models.test_moe_layouts import alone, block_of
from tests.tiny import tiny_moe_model


def test_max_chunks_is_the_most_any_routing_needs():
    for num_experts, capacity in ((1, 3), (4, 3), (5, 4), (3, 16)):
        for pairs in range(13):
            most = max(sum(-(-n // capacity) for n in split)
                       for split in itertools.product(range(pairs + 1), repeat=num_experts) if sum(split) == pairs)
            assert max_chunks(pairs, num_experts, capacity) == most, (num_experts, capacity, pairs)


def crowded(t: int, num_experts: int, capacity: int) -> torch.Tensor:
    """Top-2 choices [t, 2] taking the most chunks they can: one pair in every expert, then the rest
    dealt round the experts a chunk at a time (an expert holds at most t pairs, one per token)."""
    counts = [1] * num_experts
    left, e = 2 * t - num_experts, 0
    while left:
        step = min(capacity, left, t - counts[e])
        counts[e], left, e = counts[e] + step, left - step, (e + 1) % num_experts
    flat = torch.repeat_interleave(torch.arange(num_experts), torch.tensor(counts))
    # sorted, and no expert over t pairs: token i's two choices flat[i] and flat[t + i] differ
    return flat.view(2, t).t().contiguous()


def routings(t: int, num_experts: int, capacity: int, gen: torch.Generator):
    """Top-2 choices [t, 2]: random; every token on expert 3 (slot 0) and on experts 5 and 6, the others
    empty; and `crowded` where t has a pair for every expert."""
    yield torch.stack([torch.randperm(num_experts, generator=gen)[:2] for _ in range(t)])
    yield torch.stack([torch.full((t,), 3), 5 + torch.arange(t) % 2], 1)
    if 2 * t >= num_experts:
        yield crowded(t, num_experts, capacity)


def grouped_nan_tail(experts, shapes: list):
    """Experts.grouped_mlp's contract, on the CPU: each expert's rows of the buffer through its MLP, the
    counts a tensor; the rows past their sum come back NaN, as the GPU launch leaves them unwritten."""
    def grouped(rows, counts):
        assert isinstance(counts, torch.Tensor)
        shapes.append(rows.shape[0])
        out = torch.full((rows.shape[0], rows.shape[1]), float("nan"))
        ends = torch.cumsum(counts, 0).tolist()
        for e, (start, end) in enumerate(zip([0] + ends, ends)):
            if end > start:
                out[start:end] = experts.mlp(e, rows[start:end])
        return out
    return grouped


def static_vs_layouts(mode: str, dtype: str = "bfloat16") -> list[bool]:
    block = block_of(tiny_moe_model(mode, dtype=dtype))
    experts, n = block.experts, block.experts.num_experts
    gen = torch.Generator().manual_seed(0)
    results = []
    with torch.no_grad():
        for t in (1, 5, 13, 33, 64):
            x = torch.randn(t, experts.gate_up_proj.shape[2], generator=gen).to(experts.gate_up_proj.dtype)
            for capacity in (16, 4):
                shapes = []
                grouped = grouped_nan_tail(experts, shapes)
                for chosen in routings(t, n, capacity, gen):
                    static = experts_masked(experts.mlp, x, chosen, n, capacity, grouped)
                    results += [torch.equal(static, y) for y in
                                (alone(block, x, chosen), experts_contiguous(experts.mlp, x, chosen, n),
                                 experts_masked(experts.mlp, x, chosen, n, capacity))]
                    assert not static.isnan().any()
                # the buffer's rows are a function of T alone, whatever the routing
                assert set(shapes) == {max_chunks(2 * t, n, capacity) * capacity}, (t, capacity, shapes)
    return results


def test_crowded_routing_takes_every_chunk_of_the_buffer():
    for t in (4, 5, 13, 33, 64):
        counts = torch.bincount(crowded(t, 8, 4).flatten(), minlength=8)
        assert (counts <= t).all() and sum(-(-int(c) // 4) for c in counts) == max_chunks(2 * t, 8, 4)


def test_static_masked_layout_gives_the_bits_of_every_layout():
    assert all(static_vs_layouts("consistent")) and all(static_vs_layouts("consistent", "float32"))


def test_negative_control_baseline_static_masked_layout():
    # the baseline's F.linear per expert picks its kernel by the expert's row count; in which dtype that shows depends
    # on the CPU's kernels (on an AVX2 machine the BF16 case alone did not)
    assert not all(static_vs_layouts("baseline")) or not all(static_vs_layouts("baseline", "float32"))


def on_cuda(mode: str, **options):
    """A tiny MoE whose spec says CUDA (its weights stay on the CPU): what `capturable` reads."""
    model = tiny_moe_model(mode, **{"dtype": "bfloat16", **options})
    model.ops.spec = dataclasses.replace(model.ops.spec, device="cuda")
    return model


def test_capturable_where_every_expert_count_stays_on_the_device():
    assert on_cuda("consistent").capturable and on_cuda("consistent", dtype="float32").capturable
    assert on_cuda("baseline").capturable  # torch._grouped_mm takes device offsets
    # quantised experts: grouped launches on the stacked weights (ours; the baseline's torch._grouped_mm)
    assert all(on_cuda(mode, quant=preset).capturable for mode in ("consistent", "baseline")
               for preset in ("fp8", "nvfp4_w4a16", "nvfp4_w4a4"))
    # host counts: the CPU's per-expert loops, torch._grouped_mm refusing the shapes (FP32, or rows of
    # 36 BF16 = 72 bytes), expert parallelism's all-to-all split sizes
    assert not tiny_moe_model("consistent").capturable and not tiny_moe_model("baseline").capturable
    assert not tiny_moe_model("consistent", quant="fp8").capturable
    assert not on_cuda("baseline", dtype="float32").capturable
    assert not on_cuda("baseline", moe_intermediate_size=36).capturable
    model = on_cuda("consistent")
    block_of(model).ep = ExpertParallel(None, 0, 1, model.config.num_experts)
    assert not model.capturable


def padded_decode_runs(monkeypatch, mode: str, grouped: bool) -> list[bool]:
    """tests/engine/test_decode_graphs.py's padded static-buffer decode vs eager decode, on a tiny MoE;
    grouped: its experts through Experts.grouped_mlp, the counts as tensors (the graph-safe path)."""
    monkeypatch.setattr(dense_graphs, "tiny_model", tiny_moe_model)
    calls = []
    if grouped:
        monkeypatch.setattr(Ops, "grouped_experts", property(lambda self: True))
        real = Experts.grouped_mlp
        monkeypatch.setattr(Experts, "grouped_mlp", lambda self, *a: calls.append(a[1]) or real(self, *a))
    results = dense_graphs.runs(mode)
    assert (len(calls) > 0) == grouped and all(isinstance(c, torch.Tensor) for c in calls)
    return results


@pytest.mark.parametrize("grouped", [False, True], ids=["loops", "grouped"])
def test_padded_static_decode_equals_eager_moe(monkeypatch, grouped):
    assert all(padded_decode_runs(monkeypatch, "consistent", grouped))


def test_negative_control_padded_decode_baseline_moe(monkeypatch):
    assert not all(padded_decode_runs(monkeypatch, "baseline", grouped=False))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_static_masked_layout_backward_through_the_stock_grouped_gemm(monkeypatch):
    """A small training batch runs the masked layout too. Through torch._grouped_mm (the baseline CUDA
    spec, on CPU tensors: it leaves the buffer's tail unwritten) the gradients stay finite and close to
    the per-expert loop's: the tail reaches neither values nor gradients."""
    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops import silu_mul
    from onepath.ops.cuda import silu_mul as cuda_silu_mul

    monkeypatch.setattr(cuda_silu_mul, "silu_mul", silu_mul.reference)  # the fused Triton SwiGLU needs a GPU
    model = tiny_moe_model("baseline", dtype="bfloat16")
    loop = block_of(model).experts
    stock = Experts(Ops(ExecutionSpec.default("baseline", "cuda")), model.config, torch.bfloat16)
    stock.load_state_dict(loop.state_dict())
    x = torch.randn(13, 48, generator=torch.Generator().manual_seed(3)).bfloat16()
    chosen = crowded(13, 8, 16)
    grads = []
    for experts, layout in ((stock, "masked"), (loop, "contiguous")):
        leaf = x.clone().requires_grad_()
        experts(leaf, chosen, layout).square().sum().backward()
        grads.append([leaf.grad, experts.gate_up_proj.grad, experts.down_proj.grad])
    for got, want in zip(*grads):
        assert got.isfinite().all()
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
