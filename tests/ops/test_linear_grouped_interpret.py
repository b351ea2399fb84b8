"""onepath.ops.cuda.linear_grouped run by Triton's CPU interpreter (TRITON_INTERPRET=1) on tiny,
awkward shapes: 5 groups of 0, 1, 37, 0 and 6 rows, K = 200 (three full K blocks and a tail), N = 72.

As in test_linear_interpret.py, the interpreter's dot is replaced by a row-independent model of the
MMA chain (exact products, each K block rounded once to FP32 and added) and its FP32 -> bf16 cast
rounds to nearest even. Under it the contract is checked bitwise: every grouped row equals the dense
kernel (ops/cuda/linear.py) on that row alone against its group's weight, under any packing of the
same rows, in every tile config, with TMA or pointer loads, and whatever the number of programs
walking the tiles; rows past the device sizes (NaN here) never reach a stored row; the MoE experts
wired to it keep masked == contiguous == alone.
The bits of Hopper's MMA are tests/ops/test_linear_grouped_gpu.py's job.
"""
from __future__ import annotations


import pytest
from tests.interpret import (SM90_SHARED_BYTES, check_recorder, compile_sm90,
                              interpreted_checks, patch_gemm_interpreter, print_checks)

CHECKS = ["values", "rows_equal_dense_alone", "packing_invariant", "configs_agree", "programs_agree",
          "fp32_out_one_rounding", "empty_groups", "device_counts", "tail_rows_unread", "moe_layouts_equal_alone",
          "moe_static_buffer", "moe_backward"]
COUNTS = [0, 1, 37, 0, 6]


def _run_checks() -> dict:
    patch_gemm_interpreter()
    import torch

    from onepath.ops.cuda.linear_grouped import linear_grouped
    from onepath.ops.cuda.linear_grouped import GROUPED_TILES
    from onepath.ops.cuda.linear import TILES_16BIT, TileConfig, linear

    gen = torch.Generator().manual_seed(0)
    k, n = 200, 72
    results, record = check_recorder()

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=gen).to(dtype)

    # 16-row tiles with group_m 2: M tiles of one group and of neighbouring groups, walked by the
    # 3-program persistent loop several times over; by TMA descriptors (whose tiles read past the
    # group's rows and columns) and by pointer loads.
    configs = {"default": None, "16x16": TileConfig(16, 16, 4, 2, group_m=2), "16x32": TileConfig(16, 32, 4, 2),
               "tma_16x16": TileConfig(16, 16, 4, 2, group_m=2, tma=True),
               "tma_16x32": TileConfig(16, 32, 4, 2, tma=True),
               **{f"{c.block_m}x{c.block_n}": c for c in TILES_16BIT},
               **{f"tma_{c.block_m}x{c.block_n}": c for c in GROUPED_TILES}}
    group_of = torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))

    for dtype in (torch.bfloat16, torch.float32):
        w = rand(len(COUNTS), n, k, dtype=dtype)
        x = rand(sum(COUNTS), k, dtype=dtype)
        y = linear_grouped(x, w, COUNTS)
        exact = torch.einsum("mk,mnk->mn", x.double(), w.double()[group_of])
        u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23
        scale = torch.einsum("mk,mnk->mn", x.double().abs(), w.double().abs()[group_of])
        err = (y.double() - exact).abs()
        record("values", y.shape == (sum(COUNTS), n) and y.dtype == dtype
               and bool((err <= u * exact.abs() + 2 * k * 2.0 ** -24 * scale + 1e-30).all()),
               f"{dtype}: max err {err.max().item():.3g}")

        alone = torch.cat([linear(x[r:r + 1], w[g]) for r, g in enumerate(group_of.tolist())])
        record("rows_equal_dense_alone", torch.equal(y, alone), f"{dtype}: {(y != alone).any(-1).sum()} rows differ")

        # The same rows packed otherwise: groups in reverse order, rows reversed inside each, and
        # group 2 split in two (its weight twice), so every row sits in another tile at another offset.
        rows_of = [list(reversed((group_of == g).nonzero()[:, 0].tolist())) for g in range(len(COUNTS))]
        rows_of[2], tail = rows_of[2][:20], rows_of[2][20:]
        groups = list(reversed(range(len(COUNTS)))) + [2]
        parts = [rows_of[g] for g in groups[:-1]] + [tail]
        order = sum(parts, [])
        w2, counts2 = w[groups], [len(part) for part in parts]
        y2 = linear_grouped(x[order], w2, counts2)
        record("packing_invariant", torch.equal(y2, y[order]), f"{dtype}")

        for name, cfg in configs.items():
            for x_tma in (None, True, False) if name.startswith("tma_16") else (None,):
                record("configs_agree", torch.equal(linear_grouped(x, w, COUNTS, config=cfg, x_tma=x_tma), y),
                       f"{dtype} {name} x_tma={x_tma}")
        # one program, two, one per tile, more programs than tiles: each tile computed once, the same bits
        for cfg in (configs["tma_16x16"], configs["16x32"]):
            for programs in (1, 2, 11, 200):
                record("programs_agree", torch.equal(linear_grouped(x, w, COUNTS, config=cfg, programs=programs), y),
                       f"{dtype} {cfg} programs={programs}")

    w = rand(len(COUNTS), n, k, dtype=torch.bfloat16)
    x = rand(sum(COUNTS), k, dtype=torch.bfloat16)
    wide = linear_grouped(x, w, COUNTS, out_dtype=torch.float32)
    alone = torch.cat([linear(x[r:r + 1], w[g], out_dtype=torch.float32) for r, g in enumerate(group_of.tolist())])
    record("fp32_out_one_rounding", wide.dtype == torch.float32 and torch.equal(wide, alone), "fp32 out vs dense")
    record("fp32_out_one_rounding", torch.equal(linear_grouped(x, w, COUNTS), wide.to(torch.bfloat16)),
           "bf16 = fp32 rounded")

    record("empty_groups", linear_grouped(x[:0], w, [0] * len(COUNTS)).shape == (0, n), "M = 0")
    one = linear_grouped(x[:1], w, [0, 0, 0, 0, 1])
    record("empty_groups", torch.equal(one, linear(x[:1], w[4])), "only the last group has a row")
    try:
        linear_grouped(x, w, [1, 1, 1, 1, 1])
        record("empty_groups", False, "group sizes that do not sum to M were accepted")
    except ValueError:
        pass

    # group sizes as a tensor (the MoE dispatch's, read on the device): the same tiles, the same bits, in
    # every config; sizes summing to less than M leave the rows past them unwritten and the others equal
    sizes = torch.tensor(COUNTS)
    for name, cfg in configs.items():
        record("device_counts", torch.equal(linear_grouped(x, w, sizes, config=cfg), linear_grouped(x, w, COUNTS, config=cfg)),
               name)
    short = linear_grouped(x, w, torch.tensor([0, 1, 30, 0, 6]))
    record("device_counts", torch.equal(short[:31], linear_grouped(x, w, COUNTS)[:31]), "first 31 rows")
    record("device_counts", torch.equal(short[31:37], linear_grouped(x[31:37], w[4:], [6])), "group 4's rows")
    # control: the device sizes are what picks each row's weight (row 0 moved from group 1 to group 2)
    moved = linear_grouped(x, w, torch.tensor([0, 0, 38, 0, 6]))
    record("device_counts", not torch.equal(moved[:1], linear_grouped(x, w, COUNTS)[:1])
           and torch.equal(moved[1:], linear_grouped(x, w, COUNTS)[1:]), "moved row 0 kept its bits")
    try:
        linear_grouped(x, w, torch.tensor([1.0, 2, 3, 4, 5]))
        record("device_counts", False, "float group sizes were accepted")
    except ValueError:
        pass

    # the masked layout's buffer: rows past the sizes are never read into a stored row, not even by a
    # TMA tile that covers them (NaN there would spread through any stored row that read it)
    tail = torch.cat([x, torch.full((9, k), float("nan"), dtype=x.dtype)])
    want = linear_grouped(x, w, COUNTS)
    for name in ("default", "16x32", "tma_16x16", "tma_16x32"):
        cfg = configs[name]
        for sizes in (torch.tensor(COUNTS), torch.tensor(COUNTS[:-1] + [0]), torch.tensor(COUNTS, dtype=torch.int32)):
            for x_tma in (None, True) if cfg is None or cfg.tma else (None,):
                got = linear_grouped(tail, w, sizes, config=cfg, x_tma=x_tma)[:int(sizes.sum())]
                record("tail_rows_unread", torch.equal(got, want[:got.shape[0]]),
                       f"{name} x_tma={x_tma} sizes {sizes.tolist()}")

    _check_moe(record, gen)
    return results


def _check_moe(record, gen):
    """The MoE experts with the consistent CUDA spec, on CPU tensors: both layouts run the grouped
    kernel and give each (token, slot) pair the bits of the pair computed alone by the dense path."""
    import torch

    from onepath.models.moe import Experts, experts_contiguous, experts_masked, max_chunks
    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops import Ops
    from tests.tiny import tiny_moe_config

    config = tiny_moe_config(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=36, hidden_size=72)
    ops = Ops(ExecutionSpec.default("consistent", "cuda"))
    experts = Experts(ops, config, torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) * 0.1)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) * 0.1)
    record("moe_layouts_equal_alone", ops.grouped_experts, "the consistent CUDA spec does not pick the grouped kernel")
    calls = []
    grouped = lambda rows, counts: calls.append(counts) or experts.grouped_mlp(rows, counts)
    for t in (1, 9, 23):
        x = torch.randn(t, 72, generator=gen).to(torch.bfloat16)
        # expert 1 in every token, expert 3 never: groups of every size, empty ones included
        other = torch.tensor([0, 2, 4])[torch.randint(3, (t,), generator=gen)]
        chosen = torch.stack([torch.ones_like(other), other], 1)
        with torch.no_grad():
            contiguous = experts(x, chosen, "contiguous")
            masked = [experts(x, chosen, "masked", capacity) for capacity in (16, 4)]
            alone = torch.stack([torch.cat([experts.mlp(int(e), x[i:i + 1]) for e in chosen[i]]) for i in range(t)])
            direct = experts_contiguous(experts.mlp, x, chosen, 5, grouped)
            direct_masked = experts_masked(experts.mlp, x, chosen, 5, 4, grouped)
        same = [torch.equal(contiguous, y) for y in (*masked, alone, direct, direct_masked)]
        record("moe_layouts_equal_alone", all(same) and contiguous.dtype == torch.float32, f"T={t}: {same}")
    record("moe_layouts_equal_alone", len(calls) == 6 and 0 in calls[0], f"grouped calls {calls}")

    # the masked buffer sized for any routing (what a CUDA graph replays): filled to its last chunk by
    # tests/models/test_moe_graphs.crowded, and nearly empty with every token on experts 0 and 4
    from tests.models.test_moe_graphs import crowded
    rows_seen = []
    grouped = lambda rows, counts: rows_seen.append(rows.shape[0]) or experts.grouped_mlp(rows, counts)
    x = torch.randn(9, 72, generator=gen).to(torch.bfloat16)
    for chosen in (crowded(9, 5, 4), torch.tensor([[4, 0]] * 9)):
        with torch.no_grad():
            masked = experts_masked(experts.mlp, x, chosen, 5, 4, grouped)
            alone = torch.stack([torch.cat([experts.mlp(int(e), x[i:i + 1]) for e in chosen[i]]) for i in range(9)])
        record("moe_static_buffer", torch.equal(masked, alone), f"routing {chosen.tolist()}")
    record("moe_static_buffer", rows_seen == [max_chunks(18, 5, 4) * 4] * 2, f"buffer rows {rows_seen}")

    # backward: the kernel's values forward, torch's per-expert GEMMs backward (straight-through)
    x = torch.randn(9, 72, generator=gen).to(torch.bfloat16).requires_grad_()
    chosen = torch.stack([torch.ones(9, dtype=torch.long), torch.arange(9) % 3 * 2], 1)
    experts(x, chosen).square().sum().backward()
    grads = [x.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
    experts.zero_grad()
    x_ref = x.detach().clone().requires_grad_()
    experts_contiguous(experts.mlp, x_ref, chosen, 5).square().sum().backward()
    refs = [x_ref.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
    close = [g is not None and torch.allclose(g.float(), r.float(), rtol=2e-2, atol=1e-3) for g, r in zip(grads, refs)]
    record("moe_backward", all(close), f"x, gate_up, down grads close: {close}")


interpreted, test_linear_grouped_interpreted = interpreted_checks(__file__, "linear_grouped", CHECKS)


def test_config_pick_and_grid():
    pytest.importorskip("triton")
    import torch

    from onepath.ops.cuda import linear_grouped as gm
    from onepath.ops.cuda import linear as mm

    # decode: small groups stay on the dense kernel's 64-row tiles, the weight by TMA, x by pointers;
    # training: the largest tile once the groups fill it, both by TMA
    decode = gm.pick_grouped_config([16] * 128, 1536, torch.bfloat16, 132)
    assert decode.block_m == 64 and decode in gm.GROUPED_TILES and decode.tma and not gm.x_by_tma(decode)
    assert gm.pick_grouped_config([512] * 128, 1536, torch.bfloat16, 132) == gm.GROUPED_TILES[0]
    assert gm.x_by_tma(gm.GROUPED_TILES[0])
    wide = gm.pick_grouped_config([512] * 128, 2048, torch.bfloat16, 132, torch.float32)
    assert wide.block_m * wide.block_n <= mm.MAX_TILE_FP32_OUT and wide in gm.GROUPED_TILES
    assert gm.pick_grouped_config([1], 72, torch.float32, 3) == mm.TILE_FP32
    assert gm.pick_grouped_config([0, 0], 72, torch.bfloat16, 3) == gm.GROUPED_TILES[-1]
    # persistent: one program per SM, fewer when there are fewer tiles, never none
    assert gm.grouped_programs(160, 1536, decode, 132) == 132
    assert gm.grouped_programs(1, 128, decode, 132) == 1 and gm.grouped_programs(0, 128, decode, 132) == 1


def _compile_sm90(cfg, dtype: str, out: str, x_tma: bool | None = None):
    """The grouped kernel compiled for sm_90 by the Triton wheel's own ptxas: (ptx, shared bytes);
    x's tiles by TMA as the launcher decides unless x_tma says."""
    from onepath.ops.cuda import linear_grouped as gm
    from onepath.ops.cuda import linear as mm

    x_tma = cfg.tma and (gm.x_by_tma(cfg) if x_tma is None else x_tma)
    consts = dict(X_TMA=x_tma, W_TMA=cfg.tma, G_PAD=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=mm.BLOCK_K, GROUP_M=cfg.group_m)
    sig = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{out}", "counts_ptr": "*i64",
           **{a: "i32" for a in ("G", "N", "K", "NUM_PROGRAMS", "stride_xm", "stride_we", "stride_wn", "stride_om")}}
    for name, rows, on in (("x_desc", cfg.block_m, x_tma), ("w_desc", cfg.block_n, cfg.tma)):
        if on:
            sig[name] = f"tensordesc<{dtype}[{rows}, {mm.BLOCK_K}]>"
        else:
            consts[name] = None
    aligned = ("x_ptr", "w_ptr", "out_ptr", "counts_ptr", "N", "K", "stride_xm", "stride_we", "stride_wn", "stride_om")
    return compile_sm90(gm._linear_grouped_kernel, sig, consts, aligned, cfg)


def test_every_grouped_config_compiles_for_sm90_on_wgmma_within_shared_memory():
    """What the launcher can pick builds for the H200 (the Triton wheel's ptxas, no GPU): 16-bit
    inputs on wgmma only, as the dense kernel, loading by TMA where the config says so, within the
    227 KiB of shared memory; fp32 inputs on FMA."""
    import dataclasses

    from onepath.ops.cuda import linear_grouped as gm
    from onepath.ops.cuda import linear as mm

    cases = [(dataclasses.replace(c, tma=tma), "bf16", out) for c in gm.GROUPED_TILES for tma in (True, False)
             for out in ("bf16", "fp32") if out == "bf16" or c.block_m * c.block_n <= mm.MAX_TILE_FP32_OUT]
    cases += [(mm.TILE_FP32, "fp32", "fp32")]
    bad = []
    for cfg, dtype, out in cases:
        ptx, shared = _compile_sm90(cfg, dtype, out)
        tensor_core = "wgmma.mma_async" in ptx and "mma.sync" not in ptx
        no_mma = "wgmma" not in ptx and "mma.sync" not in ptx
        tma = ("cp.async.bulk.tensor" in ptx) == cfg.tma  # the weight's tiles at least
        if shared > SM90_SHARED_BYTES or not tma or not (no_mma if dtype == "fp32" else tensor_core):
            bad.append((cfg, dtype, out, shared, "wgmma" in ptx, "mma.sync" in ptx, "cp.async.bulk.tensor" in ptx))
    assert not bad, f"(config, in, out, shared bytes, wgmma, mma.sync, TMA) that break the build contract: {bad}"


if __name__ == "__main__":
    print_checks(_run_checks)
