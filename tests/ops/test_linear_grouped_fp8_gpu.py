"""The grouped block-FP8 expert GEMM on the GPU (Hopper's FP8 MMA): every row of a grouped launch has
the bits of ops/cuda/linear_fp8.py's dense kernels (the Triton tile forced, and the default pick, the
warp-specialized Gluon kernel) on that row against its expert's weight, at Qwen3-MoE expert shapes
(hidden 2048, moe_intermediate 768: gate_up N = 1536, K = 2048; down N = 2048, K = 768 with FP32 out),
64 experts, random top-8 routing over 3/4 of them (empty experts), 1 to 8192 tokens. The tokens are
quantised once per token by ops/cuda/quant.quantize_fp8 and their codes gathered by models/moe.py's
dispatch: the contiguous and the masked row maps give each (token, slot) pair its bits alone; one CUDA
graph replays other routings with the eager bits. Controls: the same products with K's blocks in
reverse order, and the dequantised operands' BF16 matmul, differ from the kernel's rows; a replay
under the captured routing's sizes differs from the replayed routing's rows.
The `warp_specialized` tests hold linear_grouped_fp8_ws.py's kernel (the default on Hopper from 128 rows a group,
so also in the tests above at 1024 and 8192 tokens) to the Triton grouped kernel on awkward counts, N and K.

    python -m pytest -q -m gpu tests/ops/test_linear_grouped_fp8_gpu.py
    python -m pytest -q -m gpu tests/ops/test_linear_grouped_fp8_gpu.py -k warp_specialized
"""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HIDDEN, MOE_INTERMEDIATE, TOP_K, NUM_EXPERTS = 2048, 768, 8, 64
TOKENS = (1, 3, 16, 64, 256, 1024, 8192)
# name: (N, K, out dtype); the down projection has FP32 output, as ops.expert_down
PROJECTIONS = {"gate_up": (2 * MOE_INTERMEDIATE, HIDDEN, torch.bfloat16),
               "down": (HIDDEN, MOE_INTERMEDIATE, torch.float32)}
ALONE_ROWS = 48  # rows per case also computed truly alone (M = 1)


def fp8_experts(n: int, k: int, gen: torch.Generator):
    """NUM_EXPERTS random [n, k] weights quantised per expert by FP8_WEIGHT and stacked: codes [G, n, k],
    scales [G, n / 128, k / 128]."""
    from onepath.numerics.quant import FP8Tensor, quantize
    from onepath.numerics.spec import FP8_WEIGHT

    parts = [quantize(torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5, FP8_WEIGHT)
             for _ in range(NUM_EXPERTS)]
    return FP8Tensor(torch.stack([p.codes for p in parts]), torch.stack([p.scales for p in parts]),
                     parts[0].block, parts[0].rule)


def expert(qw, e: int):
    from onepath.numerics.quant import FP8Tensor
    return FP8Tensor(qw.codes[e], qw.scales[e], qw.block, qw.rule)


def gather(qx, index: torch.Tensor):
    """Rows `index` of an FP8Tensor of row groups (codes and scales alike)."""
    from onepath.numerics.quant import FP8Tensor
    return FP8Tensor(qx.codes.index_select(0, index), qx.scales.index_select(0, index), qx.block, qx.rule)


def routing(tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Top-8 choices [tokens, 8] at random over the first 3/4 of the experts (the rest get none)."""
    scores = torch.rand(tokens, NUM_EXPERTS * 3 // 4, generator=gen, device="cuda")
    return scores.topk(TOP_K, dim=-1).indices


def packed(tokens: int, k: int, gen: torch.Generator):
    """The tokens quantised once, their pairs packed by expert by the dispatch: (qa of the packed rows,
    device counts, host counts)."""
    from onepath.models.moe import dispatch
    from onepath.ops.cuda.quant import quantize_fp8

    x = torch.randn(tokens, k, generator=gen, device="cuda").bfloat16()
    order, counts = dispatch(routing(tokens, gen), NUM_EXPERTS)
    return gather(quantize_fp8(x), order // TOP_K), counts, counts.tolist()


@pytest.mark.parametrize("projection", list(PROJECTIONS))
def test_grouped_fp8_rows_equal_dense_kernels(projection):
    from onepath.ops.cuda import sm_count
    from onepath.ops.cuda.linear import TileConfig
    from onepath.ops.cuda.linear_fp8 import TILES_FP8, linear_fp8
    from onepath.ops.cuda.linear_grouped_fp8 import linear_grouped_fp8

    n, k, out_dtype = PROJECTIONS[projection]
    gen = torch.Generator(device="cuda").manual_seed(0)
    qw = fp8_experts(n, k, gen)
    configs = [*TILES_FP8, *(TileConfig(c.block_m, c.block_n, c.num_warps, c.num_stages, tma=True) for c in TILES_FP8)]
    bad, sizes_seen = [], set()
    for tokens in TOKENS:
        qa, counts, host = packed(tokens, k, gen)
        sizes_seen.update(host)
        y = linear_grouped_fp8(qa, qw, counts, out_dtype=out_dtype)
        starts = [0, *torch.tensor(host).cumsum(0).tolist()]
        parts = [(e, gather(qa, torch.arange(starts[e], starts[e + 1], device="cuda")))
                 for e in range(NUM_EXPERTS) if host[e]]
        for name, config in (("triton", TILES_FP8[0]), ("default", None)):
            dense = torch.cat([linear_fp8(part, expert(qw, e), out_dtype=out_dtype, config=config) for e, part in parts])
            if not torch.equal(y, dense):
                bad.append((tokens, f"per expert, {name}", int((y != dense).any(-1).sum())))
        expert_of = torch.repeat_interleave(torch.arange(NUM_EXPERTS), torch.tensor(host)).tolist()
        picks = torch.randint(len(expert_of), (min(ALONE_ROWS, len(expert_of)),), generator=gen, device="cuda")
        for r in picks.tolist():
            row = gather(qa, torch.tensor([r], device="cuda"))
            if not torch.equal(y[r], linear_fp8(row, expert(qw, expert_of[r]), out_dtype=out_dtype)[0]):
                bad.append((tokens, f"row {r} alone", 1))
        runs = {"host sizes": linear_grouped_fp8(qa, qw, host, out_dtype=out_dtype),
                "two per SM": linear_grouped_fp8(qa, qw, counts, out_dtype=out_dtype,
                                                 programs=2 * sm_count(qa.codes.device)),
                **{str(c): linear_grouped_fp8(qa, qw, counts, out_dtype=out_dtype, config=c) for c in configs}}
        for name, got in runs.items():
            if not torch.equal(got, y):
                bad.append((tokens, name, int((got != y).any(-1).sum())))
    assert {0, 1} <= sizes_seen, f"no empty or 1-row expert among the cases: sizes {sorted(sizes_seen)}"
    assert not bad, f"(tokens, check, rows differing): {bad}"


def moe_grouped(qx, qw, out_dtype):
    """models/moe.py's `grouped` callback over token ids: the tokens' codes (quantised once) gathered
    by the row map, then the grouped FP8 GEMM."""
    from onepath.ops.cuda.linear_grouped_fp8 import linear_grouped_fp8
    return lambda ids, counts: linear_grouped_fp8(gather(qx, ids[:, 0]), qw, counts, out_dtype=out_dtype)


@pytest.mark.parametrize("tokens", [1, 256, 8192])
def test_moe_row_maps_equal_pairs_alone(tokens):
    """experts_contiguous and experts_masked (the buffer sized for any routing) give each (token, slot)
    pair of the gate_up projection the bits of the dense kernel on that token alone."""
    from onepath.models.moe import experts_contiguous, experts_masked
    from onepath.ops.cuda.linear_fp8 import linear_fp8
    from onepath.ops.cuda.quant import quantize_fp8

    n, k, out_dtype = PROJECTIONS["gate_up"]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    qw = fp8_experts(n, k, gen)
    qx = quantize_fp8(torch.randn(tokens, k, generator=gen, device="cuda").bfloat16())
    chosen = routing(tokens, gen)
    ids = torch.arange(tokens, device="cuda").view(-1, 1)  # the row maps move token ids: the codes they index
    grouped = moe_grouped(qx, qw, out_dtype)
    contiguous = experts_contiguous(None, ids, chosen, NUM_EXPERTS, grouped)
    masked = experts_masked(None, ids, chosen, NUM_EXPERTS, grouped=grouped)
    assert torch.equal(contiguous, masked), f"{int((contiguous != masked).any(-1).sum())} pairs differ by layout"
    picks = torch.randint(tokens, (min(16, tokens),), generator=gen, device="cuda").tolist()
    bad = [(i, e) for i in picks for s, e in enumerate(chosen[i].tolist())
           if not torch.equal(contiguous[i, s], linear_fp8(gather(qx, ids[i]), expert(qw, e), out_dtype=out_dtype)[0])]
    assert not bad, f"(token, expert) pairs whose row differs from the token alone: {bad}"


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_graph_replays_other_routings_with_the_eager_bits(layout):
    """The whole expert GEMM of 64 tokens (quantiser, dispatch, row map, grouped launch) captured in a CUDA
    graph at one routing and replayed under others (spread, crowded on 8 experts, random): the replayed
    rows equal eager's. Control: eager under the captured routing gives other rows."""
    from onepath.models.moe import experts_contiguous, experts_masked
    from onepath.ops.cuda.quant import quantize_fp8

    n, k, out_dtype = PROJECTIONS["gate_up"]
    tokens = 64
    gen = torch.Generator(device="cuda").manual_seed(11)
    qw = fp8_experts(n, k, gen)
    run_layout = experts_contiguous if layout == "contiguous" else experts_masked
    ids = torch.arange(tokens, device="cuda").view(-1, 1)

    def step(x, chosen):
        return run_layout(None, ids, chosen, NUM_EXPERTS, grouped=moe_grouped(quantize_fp8(x), qw, out_dtype))

    spread = (torch.arange(tokens * TOP_K, device="cuda") % NUM_EXPERTS).view(tokens, TOP_K)
    crowded = torch.arange(TOP_K, device="cuda").expand(tokens, TOP_K).contiguous()
    cases = [(torch.randn(tokens, k, generator=gen, device="cuda").bfloat16(), chosen)
             for chosen in (routing(tokens, gen), spread, crowded, routing(tokens, gen))]
    static_x, static_chosen = cases[0][0].clone(), cases[0][1].clone()
    side = torch.cuda.Stream()  # the first run compiles the kernels, outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static_x, static_chosen)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static_x, static_chosen)
    bad, stale_equal = [], []
    for i, (x, chosen) in enumerate(cases):
        static_x.copy_(x)
        static_chosen.copy_(chosen)
        graph.replay()
        eager = step(x, chosen)
        if not torch.equal(out, eager):
            bad.append((i, int((out != eager).any(-1).sum())))
        if i:
            stale_equal.append(torch.equal(out, step(x, cases[0][1])))
    assert not bad, f"(routing, pairs differing from eager): {bad}"
    assert not any(stale_equal), f"replays equal to the captured routing's rows: {stale_equal}"


def test_controls_see_order_and_dequantisation():
    """The comparisons can fail: at the down projection's shape (FP32 out), the same products with K's
    128-wide blocks reversed (codes and scales alike), and the dequantised operands' BF16 matmul, give
    rows other than the kernel's."""
    from onepath.numerics.quant import FP8Tensor
    from onepath.ops.cuda.linear_grouped_fp8 import linear_grouped_fp8

    n, k, out_dtype = PROJECTIONS["down"]
    gen = torch.Generator(device="cuda").manual_seed(3)
    qw = fp8_experts(n, k, gen)
    qa, counts, host = packed(256, k, gen)
    y = linear_grouped_fp8(qa, qw, counts, out_dtype=out_dtype)
    flip = torch.arange(k, device="cuda").view(-1, 128).flip(0).flatten()
    qa_r = FP8Tensor(qa.codes[:, flip].contiguous(), qa.scales.flip(-1).contiguous(), qa.block, qa.rule)
    qw_r = FP8Tensor(qw.codes[:, :, flip].contiguous(), qw.scales.flip(-1).contiguous(), qw.block, qw.rule)
    reversed_k = linear_grouped_fp8(qa_r, qw_r, counts, out_dtype=out_dtype)
    assert torch.allclose(reversed_k, y, rtol=1e-4, atol=1e-4) and not torch.equal(reversed_k, y), \
        "K blocks summed in reverse gave the same bits: the comparisons see no order"
    starts = [0, *torch.tensor(host).cumsum(0).tolist()]
    a = qa.dequantize(torch.bfloat16)
    deq = torch.cat([a[starts[e]:starts[e + 1]] @ expert(qw, e).dequantize(torch.bfloat16).t()
                     for e in range(NUM_EXPERTS) if host[e]]).float()
    assert not torch.equal(deq, y), "the dequantised BF16 matmul gave the kernel's bits: the comparisons see nothing"


# ---- the warp-specialized grouped kernel (linear_grouped_fp8_ws): python -m pytest -q -m gpu -k warp_specialized
# (G, N, K, out dtype): N off multiples of 128 (and of 16: the epilogue's scalar stores), K off multiples of 128
# (TMA's zero fill of the last block) and of 16 (the codes padded), Qwen3-MoE's two projections
WS_CASES = {"awkward_bf16": (7, 200, 400, torch.bfloat16), "awkward_fp32": (5, 328, 1000, torch.float32),
            "gate_up": (16, 1536, 2048, torch.bfloat16), "down": (16, 2048, 768, torch.float32)}
WS_COUNTS = ([0, 1, 127, 128, 129, 300, 0, 5, 64, 0, 256, 3, 0, 77, 1000, 9],  # cut to G groups
             [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 700])  # one group, the rest empty (cut: all empty)


def ws_operands(groups: int, n: int, k: int, rows: int, gen: torch.Generator):
    from onepath.numerics.quant import FP8Tensor, quantize
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT

    parts = [quantize(torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5, FP8_WEIGHT) for _ in range(groups)]
    qw = FP8Tensor(torch.stack([p.codes for p in parts]), torch.stack([p.scales for p in parts]), parts[0].block,
                   parts[0].rule)
    return quantize(torch.randn(rows, k, generator=gen, device="cuda") * 2, FP8_ACT), qw


def random_counts(groups: int, rows: int, gen: torch.Generator) -> list[int]:
    """Rows spread over the groups at random, about a third of the groups empty."""
    picks = torch.randint(0, groups, (rows,), generator=gen, device="cuda")
    keep = torch.rand(groups, generator=gen, device="cuda") > 0.33
    keep[0] = True
    return torch.bincount(torch.where(keep[picks], picks, 0), minlength=groups).tolist()


@pytest.mark.parametrize("case", list(WS_CASES))
def test_warp_specialized_grouped_rows_equal_the_triton_grouped_kernel_and_dense(case):
    """torch.equal: the warp-specialized grouped kernel's rows = the Triton grouped kernel's = linear_fp8's Triton
    kernel per group, for host-list and device counts (device: M rows, more than the counts sum to; those rows
    past the sum keep the output's NaN fill), under any program count and the split "n" layout; the dequantised
    operands' BF16 matmul differs on the same case."""
    from onepath.ops.cuda.linear_fp8 import DECODE_WS_CONFIG, TILES_FP8, linear_fp8
    from onepath.ops.cuda.linear_fp8_ws import WSConfig
    from onepath.ops.cuda.linear_grouped_fp8 import GROUPED_WS_CONFIG, linear_grouped_fp8
    from onepath.ops.cuda.linear_grouped_fp8_ws import linear_grouped_fp8_ws

    groups, n, k, out_dtype = WS_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(len(case))
    bad = []
    for c, counts in enumerate([*(cs[:groups] for cs in WS_COUNTS), random_counts(groups, 1500, gen)]):
        total = sum(counts)
        qa, qw = ws_operands(groups, n, k, total + 37, gen)
        listed = gather(qa, torch.arange(total, device="cuda"))
        triton = linear_grouped_fp8(listed, qw, counts, out_dtype=out_dtype, config=TILES_FP8[0])
        starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
        dense = [linear_fp8(gather(listed, torch.arange(starts[g], starts[g + 1], device="cuda")), expert(qw, g),
                            out_dtype=out_dtype, config=TILES_FP8[0]) for g in range(groups) if counts[g]]
        if total and not torch.equal(triton, torch.cat(dense)):
            bad.append((c, "triton grouped vs dense"))
        runs = {"list": linear_grouped_fp8(listed, qw, counts, out_dtype=out_dtype, config=GROUPED_WS_CONFIG),
                "one program": linear_grouped_fp8(listed, qw, counts, out_dtype=out_dtype, config=GROUPED_WS_CONFIG,
                                                  programs=1),
                "split n": linear_grouped_fp8(listed, qw, counts, out_dtype=out_dtype, config=DECODE_WS_CONFIG),
                "128x256, a program a tile": linear_grouped_fp8(listed, qw, counts, out_dtype=out_dtype,
                                                                config=WSConfig(256, 4, persistent=False))}
        sizes = torch.tensor(counts, device="cuda")
        for name, config in (("device", GROUPED_WS_CONFIG), ("device split n", DECODE_WS_CONFIG)):
            out = torch.full((qa.codes.shape[0], n), float("nan"), device="cuda", dtype=out_dtype)
            linear_grouped_fp8_ws(qa, qw, sizes, out, config)
            if not out[total:].isnan().all():
                bad.append((c, f"{name}: rows past the counts written"))
            runs[name] = out[:total]
        for name, got in runs.items():
            if not torch.equal(got, triton):
                bad.append((c, name, int((got != triton).any(-1).sum())))
        if total:
            a = listed.dequantize(torch.bfloat16)
            deq = torch.cat([a[starts[g]:starts[g + 1]] @ expert(qw, g).dequantize(torch.bfloat16).t()
                             for g in range(groups) if counts[g]]).to(out_dtype)
            if torch.equal(deq, runs["list"]):
                bad.append((c, "control: the dequantised BF16 matmul gave the kernel's bits"))
    assert not bad, f"(counts case, check, rows differing): {bad}"


def test_warp_specialized_grouped_is_the_default_from_128_rows_a_group(monkeypatch):
    """On Hopper, with GROUPED_WS_BY_DEFAULT on, linear_grouped_fp8 picks the warp-specialized kernel at 8192
    tokens x top-8 over 64 experts and the Triton kernel at 64 tokens; both give the forced Triton kernel's rows
    (pick_grouped_kernel)."""
    from onepath.ops.cuda import linear_grouped_fp8 as gm
    from onepath.ops.cuda.linear_fp8 import TILES_FP8, is_hopper
    from onepath.ops.cuda.linear_grouped_fp8 import GROUPED_WS_CONFIG, linear_grouped_fp8, pick_grouped_kernel

    monkeypatch.setattr(gm, "GROUPED_WS_BY_DEFAULT", True)

    if not is_hopper(torch.device("cuda")):
        pytest.skip("the warp-specialized kernel is Hopper's (sm_90)")
    n, k, out_dtype = PROJECTIONS["down"]
    gen = torch.Generator(device="cuda").manual_seed(5)
    qw = fp8_experts(n, k, gen)
    for tokens, picked in ((8192, GROUPED_WS_CONFIG), (64, None)):
        qa, counts, _ = packed(tokens, k, gen)
        assert pick_grouped_kernel(qa.codes.shape[0], NUM_EXPERTS, k, out_dtype, qa.codes.device) == picked
        y = linear_grouped_fp8(qa, qw, counts, out_dtype=out_dtype)
        assert torch.equal(y, linear_grouped_fp8(qa, qw, counts, out_dtype=out_dtype, config=TILES_FP8[0])), tokens


def test_warp_specialized_graph_replays_other_counts_with_the_eager_bits():
    """One launch with device counts captured in a CUDA graph (the tile map built inside it) and replayed under
    other counts (random, one group, every group empty but the last, fewer rows than M): each replay's rows equal
    the eager Triton grouped kernel's, the rows past the counts keep their fill. Control: the rows of the
    captured counts differ from a replay's."""
    from onepath.ops.cuda.linear_fp8 import TILES_FP8
    from onepath.ops.cuda.linear_grouped_fp8 import GROUPED_WS_CONFIG, linear_grouped_fp8
    from onepath.ops.cuda.linear_grouped_fp8_ws import linear_grouped_fp8_ws

    groups, n, k, out_dtype = WS_CASES["awkward_bf16"]
    gen = torch.Generator(device="cuda").manual_seed(23)
    m = 2000
    qa, qw = ws_operands(groups, n, k, m, gen)
    cases = [random_counts(groups, m, gen), [0, 0, m, 0, 0, 0, 0], [0] * (groups - 1) + [513],
             random_counts(groups, 1111, gen), [1, 129, 0, 300, 0, 7, 128]]
    sizes = torch.tensor(cases[0], device="cuda")
    out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
    side = torch.cuda.Stream()  # the first run compiles, outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        linear_grouped_fp8_ws(qa, qw, sizes, out, GROUPED_WS_CONFIG)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear_grouped_fp8_ws(qa, qw, sizes, out, GROUPED_WS_CONFIG)
    bad, stale_equal = [], []
    for i, counts in enumerate(cases):
        total = sum(counts)
        sizes.copy_(torch.tensor(counts))
        out.fill_(float("nan"))
        graph.replay()
        eager = linear_grouped_fp8(gather(qa, torch.arange(total, device="cuda")), qw, counts, out_dtype=out_dtype,
                                   config=TILES_FP8[0])
        if not torch.equal(out[:total], eager):
            bad.append((i, int((out[:total] != eager).any(-1).sum())))
        if not out[total:].isnan().all():
            bad.append((i, "rows past the counts written"))
        if i:
            captured = linear_grouped_fp8(qa, qw, torch.tensor(cases[0], device="cuda"), out_dtype=out_dtype,
                                          config=TILES_FP8[0])
            stale_equal.append(torch.equal(out[:total], captured[:total]))
    assert not bad, f"(counts case, rows differing from eager): {bad}"
    assert not any(stale_equal), f"replays equal to the captured counts' rows: {stale_equal}"


def test_warp_specialized_control_sees_k_order():
    """The comparisons can fail: K's 128-wide blocks reversed (codes and scales alike) through the same kernel give
    rows close to, and not equal to, the kernel's."""
    from onepath.numerics.quant import FP8Tensor
    from onepath.ops.cuda.linear_grouped_fp8 import GROUPED_WS_CONFIG, linear_grouped_fp8

    groups, n, k, out_dtype = WS_CASES["down"]
    gen = torch.Generator(device="cuda").manual_seed(4)
    counts = random_counts(groups, 3000, gen)
    qa, qw = ws_operands(groups, n, k, sum(counts), gen)
    y = linear_grouped_fp8(qa, qw, counts, out_dtype=out_dtype, config=GROUPED_WS_CONFIG)
    flip = torch.arange(k, device="cuda").view(-1, 128).flip(0).flatten()
    qa_r = FP8Tensor(qa.codes[:, flip].contiguous(), qa.scales.flip(-1).contiguous(), qa.block, qa.rule)
    qw_r = FP8Tensor(qw.codes[:, :, flip].contiguous(), qw.scales.flip(-1).contiguous(), qw.block, qw.rule)
    reversed_k = linear_grouped_fp8(qa_r, qw_r, counts, out_dtype=out_dtype, config=GROUPED_WS_CONFIG)
    assert torch.allclose(reversed_k, y, rtol=1e-4, atol=1e-4) and not torch.equal(reversed_k, y), \
        "K blocks summed in reverse gave the same bits: the comparisons see no order"
