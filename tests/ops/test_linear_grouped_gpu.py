"""The grouped expert GEMM on the GPU (Hopper MMA, BF16): every row of a grouped launch has the
bits of ops/cuda/linear.py's dense kernel on that row against its expert's weight, at Qwen3-MoE
expert shapes (hidden 2048, moe_intermediate 768; gate_up N = 1536, down N = 2048 with FP32 out),
64 and 128 experts, random top-8 routing with empty experts, 1 to 4096 tokens. The decode tiles
(64-row, TMA) at 1..300 tokens over 128 experts: host and device sizes, every grid, the masked
layout's buffer with a NaN tail, and one CUDA graph replaying other routings. The MoE experts wired
to it keep masked == contiguous == each pair alone. No stock-path negative control here: on the H200
(2026-11-29) cuBLAS per expert (a row at M = 1, at its expert's count, in a 4096-row batch) and
torch._grouped_mm (all groups vs a row alone) all kept a row's bits at these shapes; the MoE's
negative controls are model-level (tests/models/test_moe_gpu.py: baseline alone != batch). The decode
test's control: the same products summed in another order (K's 64-wide blocks reversed) must fail
the same comparison.

    python -m pytest -q -m gpu tests/ops/test_linear_grouped_gpu.py
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
    from onepath.ops.cuda.linear_grouped import linear_grouped
    from onepath.ops.cuda.linear import linear

    n, k, out_dtype = PROJECTIONS[projection]
    gen = torch.Generator(device="cuda").manual_seed(num_experts)
    bad = []
    for tokens in TOKENS:
        x, w, counts = case(num_experts, n, k, tokens, gen)
        assert 0 in counts
        y = linear_grouped(x, w, counts, out_dtype=out_dtype)
        # each expert's rows through the dense kernel (whose rows do not depend on M: test_linear_gpu.py)
        dense = torch.cat([linear(part, w[e], out_dtype=out_dtype) for e, part in enumerate(x.split(counts))])
        if not torch.equal(y, dense):
            bad.append((tokens, "per expert", int((y != dense).any(-1).sum())))
        expert_of = torch.repeat_interleave(torch.arange(num_experts), torch.tensor(counts)).tolist()
        picks = torch.randint(x.shape[0], (min(ALONE_ROWS, x.shape[0]),), generator=gen, device="cuda").tolist()
        alone = [torch.equal(y[r], linear(x[r:r + 1], w[expert_of[r]], out_dtype=out_dtype)[0]) for r in picks]
        if not all(alone):
            bad.append((tokens, "alone", alone.count(False)))
        # the same rows in reverse order, so in other tiles at other offsets
        flipped = linear_grouped(x.flip(0), w.flip(0), counts[::-1], out_dtype=out_dtype)
        if not torch.equal(flipped.flip(0), y):
            bad.append((tokens, "reversed packing", int((flipped.flip(0) != y).any(-1).sum())))
    assert not bad, f"(tokens, check, rows differing): {bad}"


DECODE_TOKENS = (1, 2, 3, 5, 8, 16, 17, 31, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 300)


def masked_buffer(x: torch.Tensor, counts: list[int]):
    """The masked layout's buffer of the rows x packed by counts: whole 16-row chunks per expert, zero
    rows in the chunks, sized for any routing of the same pairs (models/moe.py), the unused tail NaN.
    Returns (buffer, chunk row counts)."""
    from onepath.models.moe import CAPACITY, max_chunks

    chunks = [-(-c // CAPACITY) * CAPACITY for c in counts]
    buffer = torch.full((max_chunks(sum(counts), len(counts), CAPACITY) * CAPACITY, x.shape[1]), float("nan"),
                        device=x.device, dtype=x.dtype)
    buffer[:sum(chunks)] = 0
    starts = torch.tensor([0, *chunks[:-1]]).cumsum(0).tolist()
    for part, start in zip(x.split(counts), starts):
        buffer[start:start + part.shape[0]] = part
    return buffer, chunks


def unmasked(out: torch.Tensor, chunks: list[int], counts: list[int]) -> torch.Tensor:
    """The rows of each expert's pairs out of a masked-layout output (chunk rows per expert)."""
    starts = torch.tensor([0, *chunks[:-1]]).cumsum(0).tolist()
    return torch.cat([out[s:s + c] for s, c in zip(starts, counts)])


@pytest.mark.parametrize("projection", list(PROJECTIONS))
def test_decode_tiles_rows_equal_dense_kernel(projection):
    """The launcher's decode pick (64-row tiles by TMA) at 1..300 tokens over 128 experts (empty and
    1-row experts included): every row has the dense kernel's bits on its expert, with host sizes,
    device sizes, one program per tile, two per SM, and in the masked buffer whose NaN tail a TMA tile
    covers but no stored row reads. Control: the same products with K's blocks reversed differ."""
    from onepath.ops.cuda import linear_grouped as gm
    from onepath.ops.cuda.linear import linear, sm_count

    n, k, out_dtype = PROJECTIONS[projection]
    num_experts = 128
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = (torch.randn(num_experts, n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()
    bad, sizes_seen = [], set()
    for tokens in DECODE_TOKENS:
        counts = routed(tokens, num_experts, gen)
        sizes_seen.update(counts)
        x = torch.randn(sum(counts), k, generator=gen, device="cuda").bfloat16()
        config = gm.pick_grouped_config(counts, n, x.dtype, sm_count(x.device), out_dtype)
        assert config.block_m == 64 and config.tma, f"{tokens} tokens picked {config}"
        dense = torch.cat([linear(part, w[e], out_dtype=out_dtype) for e, part in enumerate(x.split(counts))])
        device_counts = torch.tensor(counts, device="cuda")
        tiles = (-(-x.shape[0] // 64) + num_experts) * -(-n // config.block_n)
        runs = {"host sizes": gm.linear_grouped(x, w, counts, out_dtype=out_dtype),
                "device sizes": gm.linear_grouped(x, w, device_counts, out_dtype=out_dtype),
                "one program per tile": gm.linear_grouped(x, w, device_counts, out_dtype=out_dtype, programs=tiles),
                "two per SM": gm.linear_grouped(x, w, counts, out_dtype=out_dtype, programs=2 * sm_count(x.device))}
        buffer, chunks = masked_buffer(x, counts)
        masked = gm.linear_grouped(buffer, w, torch.tensor(chunks, device="cuda"), out_dtype=out_dtype)
        runs["masked buffer"] = unmasked(masked, chunks, counts)
        for name, y in runs.items():
            if not torch.equal(y, dense):
                bad.append((tokens, name, int((y != dense).any(-1).sum())))
    assert {0, 1} <= sizes_seen, f"no empty or 1-row expert among the cases: sizes {sorted(sizes_seen)}"
    assert not bad, f"(tokens, run, rows differing from the dense kernel): {bad}"

    # control, on the FP32 accumulator (a bf16 rounding hides most last-bit changes)
    reversed_k = torch.arange(k, device="cuda").view(-1, 64).flip(0).flatten()
    y = gm.linear_grouped(x[:, reversed_k].contiguous(), w[:, :, reversed_k].contiguous(), counts,
                          out_dtype=torch.float32)
    dense = torch.cat([linear(part, w[e], out_dtype=torch.float32) for e, part in enumerate(x.split(counts))])
    assert not torch.equal(y, dense), "K blocks summed in reverse gave the same bits: the comparison sees no order"


@pytest.mark.parametrize("projection", list(PROJECTIONS))
def test_decode_graph_replays_other_routings_with_the_dense_bits(projection):
    """One launch over the masked buffer of 64 tokens with device sizes, captured in a CUDA graph at
    one routing, replayed under others (one routing per expert, all on 8 experts, random): the
    replayed rows equal the dense kernel's. Control: the same buffers under the captured routing's
    sizes give other rows (a replay stuck on the sizes seen at capture would show), for the routings
    whose chunk sizes differ from the captured ones (two random routings of 64 tokens over 96 experts
    give every used expert one 16-row chunk: the same sizes, so the same rows)."""
    from onepath.ops.cuda.linear_grouped import linear_grouped
    from onepath.ops.cuda.linear import linear

    n, k, out_dtype = PROJECTIONS[projection]
    num_experts, tokens = 128, 64
    gen = torch.Generator(device="cuda").manual_seed(11)
    w = (torch.randn(num_experts, n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()
    pairs = tokens * TOP_K
    spread = [pairs // num_experts] * num_experts
    crowded = [tokens] * TOP_K + [0] * (num_experts - TOP_K)
    cases = []
    for counts in (routed(tokens, num_experts, gen), spread, crowded, routed(tokens, num_experts, gen)):
        x = torch.randn(pairs, k, generator=gen, device="cuda").bfloat16()
        buffer, chunks = masked_buffer(x, counts)
        cases.append((x, counts, buffer, torch.tensor(chunks, device="cuda")))
    static_buffer, static_sizes = cases[0][2].clone(), cases[0][3].clone()
    side = torch.cuda.Stream()  # the first run compiles the kernel, outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        linear_grouped(static_buffer, w, static_sizes, out_dtype=out_dtype)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_grouped(static_buffer, w, static_sizes, out_dtype=out_dtype)
    bad, stale_equal = [], []
    for i, (x, counts, buffer, sizes) in enumerate(cases):
        static_buffer.copy_(buffer)
        static_sizes.copy_(sizes)
        graph.replay()
        got = unmasked(out, sizes.tolist(), counts)
        dense = torch.cat([linear(part, w[e], out_dtype=out_dtype) for e, part in enumerate(x.split(counts))])
        if not torch.equal(got, dense):
            bad.append((i, int((got != dense).any(-1).sum())))
        if torch.equal(sizes, cases[0][3]):
            continue  # the same chunk sizes as at capture (whole 16-row chunks): no stale size to see
        stale = linear_grouped(buffer, w, cases[0][3], out_dtype=out_dtype)
        stale_equal.append(torch.equal(got, unmasked(stale, sizes.tolist(), counts)))
    assert not bad, f"(routing, rows differing from the dense kernel): {bad}"
    assert len(stale_equal) >= 2, "the routings give the captured chunk sizes: the control compares nothing"
    assert not any(stale_equal), f"replays equal to the captured routing's rows: {stale_equal}"


def test_moe_experts_layouts_equal_alone_with_the_grouped_kernel():
    from tests.models.test_moe_gpu import SHAPE, moe_model

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
    from tests.models.test_moe_gpu import grads_vs_loop, moe_model

    block = moe_model("consistent").model.layers[0].mlp
    for g, r in zip(*grads_vs_loop(block, torch.Generator(device="cuda").manual_seed(2))):
        # BF16 gradients summed in another order: compare by relative norm (exact zeros of one side
        # may be a cancellation residue on the other)
        assert float((g.float() - r.float()).norm() / r.float().norm()) < 1e-2
