"""The grouped expert GEMM on the GPU (Hopper MMA, BF16): every row of a grouped launch has the
bits of ops/cuda/matmul.py's dense kernel on that row against its expert's weight, at Qwen3-MoE
expert shapes (hidden 2048, moe_intermediate 768; gate_up N = 1536, down N = 2048 with FP32 out),
64 and 128 experts, random top-8 routing with empty experts, 1 to 4096 tokens. The MoE experts wired
to it keep masked == contiguous == each pair alone. No stock-path negative control here: on the H200
(2026-11-29) cuBLAS per expert (a row at M = 1, at its expert's count, in a 4096-row batch) and
torch._grouped_mm (all groups vs a row alone) all kept a row's bits at these shapes; the MoE's
negative controls are model-level (tests/gpu/test_moe_gpu.py: baseline alone != batch).

    python -m pytest -q -m gpu tests/gpu/test_grouped_matmul_gpu.py
"""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HIDDEN, MOE_INTERMEDIATE, TOP_K = 2048, 768, 8
TOKENS = (1, 3, 16, 64, 257, 1024, 4096)
# name: (N, K, out dtype); the down projection has FP32 output, as ops.expert_down
PROJECTIONS = {"gate_up": (2 * MOE_INTERMEDIATE, HIDDEN, torch.bfloat16),
               "down": (HIDDEN, MOE_INTERMEDIATE, torch.float32)}
ALONE_ROWS = 48  # rows per case also computed truly alone (M = 1)


def routed(tokens: int, num_experts: int, gen: torch.Generator) -> list[int]:
    """Rows per expert of `tokens` tokens routed top-8 at random over the first 3/4 of the experts
    (the rest get none)."""
    used = num_experts * 3 // 4
    scores = torch.rand(tokens, used, generator=gen, device="cuda")
    experts = scores.topk(TOP_K, dim=-1).indices
    return torch.bincount(experts.flatten(), minlength=num_experts).tolist()


def case(num_experts: int, n: int, k: int, tokens: int, gen: torch.Generator):
    counts = routed(tokens, num_experts, gen)
    w = (torch.randn(num_experts, n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()
    x = torch.randn(sum(counts), k, generator=gen, device="cuda").bfloat16()
    return x, w, counts


@pytest.mark.parametrize("num_experts", [64, 128])
@pytest.mark.parametrize("projection", list(PROJECTIONS))
def test_grouped_rows_equal_dense_kernel(num_experts, projection):
    from onepath.ops.cuda.grouped_matmul import grouped_matmul
    from onepath.ops.cuda.matmul import matmul

    n, k, out_dtype = PROJECTIONS[projection]
    gen = torch.Generator(device="cuda").manual_seed(num_experts)
    bad = []
    for tokens in TOKENS:
        x, w, counts = case(num_experts, n, k, tokens, gen)
        assert 0 in counts
        y = grouped_matmul(x, w, counts, out_dtype=out_dtype)
        # each expert's rows through the dense kernel (whose rows do not depend on M: test_matmul.py)
        dense = torch.cat([matmul(part, w[e], out_dtype=out_dtype) for e, part in enumerate(x.split(counts))])
        if not torch.equal(y, dense):
            bad.append((tokens, "per expert", int((y != dense).any(-1).sum())))
        expert_of = torch.repeat_interleave(torch.arange(num_experts), torch.tensor(counts)).tolist()
        picks = torch.randint(x.shape[0], (min(ALONE_ROWS, x.shape[0]),), generator=gen, device="cuda").tolist()
        alone = [torch.equal(y[r], matmul(x[r:r + 1], w[expert_of[r]], out_dtype=out_dtype)[0]) for r in picks]
        if not all(alone):
            bad.append((tokens, "alone", alone.count(False)))
        # the same rows in reverse order, so in other tiles at other offsets
        flipped = grouped_matmul(x.flip(0), w.flip(0), counts[::-1], out_dtype=out_dtype)
        if not torch.equal(flipped.flip(0), y):
            bad.append((tokens, "reversed packing", int((flipped.flip(0) != y).any(-1).sum())))
    assert not bad, f"(tokens, check, rows differing): {bad}"


def test_moe_experts_layouts_equal_alone_with_the_grouped_kernel():
    from tests.gpu.test_moe_gpu import SHAPE, moe_model

    block = moe_model("consistent").model.layers[0].mlp
    experts = block.experts
    assert experts.ops.grouped_experts
    gen = torch.Generator(device="cuda").manual_seed(0)
    bad = []
    with torch.no_grad():
        for tokens in (1, 7, 33, 300):
            x = torch.randn(tokens, SHAPE["hidden_size"], generator=gen, device="cuda").bfloat16()
            _, chosen = block.gate(x)
            contiguous = experts(x, chosen, "contiguous")
            masked = experts(x, chosen, "masked")
            alone = torch.stack([torch.cat([experts.mlp(int(e), x[i:i + 1]) for e in chosen[i]])
                                 for i in range(min(tokens, 8))])
            if not torch.equal(masked, contiguous):
                bad.append((tokens, "masked"))
            if not torch.equal(alone, contiguous[:alone.shape[0]]):
                bad.append((tokens, "alone"))
    assert not bad, bad


def test_moe_experts_backward_with_the_grouped_kernel():
    """Kernel values forward, torch's per-expert BF16 GEMMs backward: gradients match the per-expert
    path's."""
    from tests.gpu.test_moe_gpu import grads_vs_loop, moe_model

    block = moe_model("consistent").model.layers[0].mlp
    for g, r in zip(*grads_vs_loop(block, torch.Generator(device="cuda").manual_seed(2))):
        # BF16 gradients summed in another order: compare by relative norm (exact zeros of one side
        # may be a cancellation residue on the other)
        assert float((g.float() - r.float()).norm() / r.float().norm()) < 1e-2
