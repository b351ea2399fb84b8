"""onepath.ops.cuda.linear_grouped_fp8 run by Triton's CPU interpreter (TRITON_INTERPRET=1) on tiny,
awkward shapes: G = 5 and 8 groups with empty and one-row groups, K = 200 and 40 (a ragged K tail) and
256, N = 140 (two 128-row weight blocks, the second ragged; not a multiple of any tile).

As in test_linear_fp8_interpret.py, the interpreter's dot sums a block's e4m3 products exactly and
rounds once to FP32, its FMA rounds once, and its FP32 -> bf16 / e4m3 casts round to nearest even
(tests/interpret.patch_fp8_gemm_interpreter). Under that model the contract is checked bitwise: every
grouped row equals linear_fp8.py's Triton kernel on that row alone against its group's weight, in
every tile config, with the weight by TMA or by pointers, under any number of programs; the masked
layout's buffer (chunks, zero rows, a NaN tail) gives the contiguous layout's rows; the group sizes
are read from the device tensor the launcher is handed, never on the host; the activations quantised
per token by ops/cuda/quant.quantize_fp8 before or after the dispatch's gather give the same codes.
Negative controls: the same products with K's blocks in reverse order, and the dequantised operands'
matmul, give other bits on the same case. Hopper's FP8 MMA bits are tests/ops/test_linear_grouped_fp8_gpu.py's.
"""
from __future__ import annotations

from tests.interpret import (SM90_SHARED_BYTES, check_recorder, compile_sm90, interpreted_checks,
                              patch_fp8_gemm_interpreter, print_checks)

CHECKS = ["rows_equal_dense_alone", "configs_agree", "programs_agree", "out_dtypes", "empty_groups",
          "device_counts", "no_host_read", "masked_equals_contiguous", "quantise_before_or_after_gather",
          "moe_row_maps_equal_alone", "control_k_order", "control_dequantised_bf16"]
CASES = {5: [0, 1, 23, 0, 6], 8: [3, 0, 1, 9, 0, 0, 2, 5]}
N = 140


def _run_checks() -> dict:
    import torch

    patch_fp8_gemm_interpreter()

    from onepath.numerics.quant import FP8Tensor, quantize
    from onepath.numerics.spec import FP8_WEIGHT
    from onepath.ops.cuda import linear_grouped_fp8 as gm
    from onepath.ops.cuda.linear import TileConfig
    from onepath.ops.cuda.linear_fp8 import TILES_FP8, linear_fp8
    from onepath.ops.cuda.quant import quantize_fp8

    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()
    dense_tile = TILES_FP8[0]  # the dense Triton kernel forced (the default on Hopper is the Gluon one)

    def weights(groups, k):
        parts = [quantize(torch.randn(N, k, generator=gen) * 0.05, FP8_WEIGHT) for _ in range(groups)]
        return FP8Tensor(torch.stack([p.codes for p in parts]), torch.stack([p.scales for p in parts]),
                         parts[0].block, parts[0].rule)

    def expert(qw, g):
        return FP8Tensor(qw.codes[g], qw.scales[g], qw.block, qw.rule)

    def rows(qa, start, end):
        return FP8Tensor(qa.codes[start:end], qa.scales[start:end], qa.block, qa.rule)

    def alone(qa, qw, counts, out_dtype):
        group_of = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).tolist()
        return torch.cat([linear_fp8(rows(qa, r, r + 1), expert(qw, g), out_dtype=out_dtype, config=dense_tile)
                          for r, g in enumerate(group_of)])

    # 16-row tiles with group_m 2: M tiles of one group and of neighbouring groups, walked several times
    # over by the interpreter's 3-program persistent loop; the weight by TMA (reading past N) and by pointers
    configs = {"default": None, "16x16": TileConfig(16, 16, 4, 2, group_m=2), "16x32": TileConfig(16, 32, 4, 2),
               "tma_16x16": TileConfig(16, 16, 4, 2, group_m=2, tma=True),
               **{f"{c.block_m}x{c.block_n}": c for c in TILES_FP8},
               **{f"tma_{c.block_m}x{c.block_n}": TileConfig(c.block_m, c.block_n, c.num_warps, c.num_stages,
                                                            tma=True) for c in TILES_FP8}}

    for groups, counts in CASES.items():
        for k in (200, 40):
            qw = weights(groups, k)
            x = torch.randn(sum(counts), k, generator=gen) * 3
            qa = quantize_fp8(x)
            y = gm.linear_grouped_fp8(qa, qw, counts, out_dtype=torch.float32)
            want = alone(qa, qw, counts, torch.float32)
            record("rows_equal_dense_alone", torch.equal(y, want),
                   f"G={groups} K={k}: {(y != want).any(-1).sum()} rows differ")
            if k != 200:
                continue
            for name, cfg in configs.items():
                got = gm.linear_grouped_fp8(qa, qw, counts, out_dtype=torch.float32, config=cfg)
                record("configs_agree", torch.equal(got, y), f"G={groups} {name}")
            for cfg in (configs["16x16"], configs["tma_16x16"]):
                for programs in (1, 2, 11, 200):
                    got = gm.linear_grouped_fp8(qa, qw, counts, out_dtype=torch.float32, config=cfg,
                                                programs=programs)
                    record("programs_agree", torch.equal(got, y), f"G={groups} {cfg} programs={programs}")
            bf16 = gm.linear_grouped_fp8(qa, qw, counts)
            record("out_dtypes", bf16.dtype == torch.bfloat16 and torch.equal(bf16, y.to(torch.bfloat16))
                   and torch.equal(bf16, alone(qa, qw, counts, torch.bfloat16)), f"G={groups}: bf16 = fp32 rounded once")

    groups, counts = 5, CASES[5]
    k = 200
    qw = weights(groups, k)
    x = torch.randn(sum(counts), k, generator=gen) * 3
    qa = quantize_fp8(x)
    want = gm.linear_grouped_fp8(qa, qw, counts)

    record("empty_groups", gm.linear_grouped_fp8(rows(qa, 0, 0), qw, [0] * groups).shape == (0, N), "M = 0")
    one = gm.linear_grouped_fp8(rows(qa, 0, 1), qw, [0] * (groups - 1) + [1])
    record("empty_groups", torch.equal(one, linear_fp8(rows(qa, 0, 1), expert(qw, groups - 1), config=dense_tile)),
           "only the last group has a row")
    try:
        gm.linear_grouped_fp8(qa, qw, [1] * groups)
        record("empty_groups", False, "group sizes that do not sum to M were accepted")
    except ValueError:
        pass

    # group sizes as a tensor: the same bits in every config; sizes summing to less than M leave the rows
    # past them unwritten and the others equal; control: the sizes are what picks a row's weight
    for name, cfg in configs.items():
        got = gm.linear_grouped_fp8(qa, qw, torch.tensor(counts), config=cfg)
        record("device_counts", torch.equal(got, gm.linear_grouped_fp8(qa, qw, counts, config=cfg)), name)
    short = gm.linear_grouped_fp8(qa, qw, torch.tensor([0, 1, 20, 0, 6], dtype=torch.int32))
    record("device_counts", torch.equal(short[:21], want[:21]), "first 21 rows")
    record("device_counts", torch.equal(short[21:27], gm.linear_grouped_fp8(rows(qa, 21, 27), qw, [0, 0, 0, 0, 6])),
           "group 4's rows")
    moved = gm.linear_grouped_fp8(qa, qw, torch.tensor([0, 0, 24, 0, 6]))
    record("device_counts", not torch.equal(moved[:1], want[:1]) and torch.equal(moved[1:], want[1:]),
           "row 0 moved to group 2 kept its bits")
    try:
        gm.linear_grouped_fp8(qa, qw, torch.tensor([1.0, 2, 3, 4, 5]))
        record("device_counts", False, "float group sizes were accepted")
    except ValueError:
        pass

    _check_no_host_read(record, gm, qa, qw, counts, want)
    _check_layouts(record, gm, quantize_fp8, qw, counts, x, want)
    _check_moe_row_maps(record, gm, quantize_fp8, qw, lambda t, g: linear_fp8(t, expert(qw, g), config=dense_tile))

    # controls on the same case, FP32 out (a bf16 rounding hides last-bit changes): the same products
    # with the two K blocks swapped (codes and scales alike), and the dequantised operands' matmul
    k = 256
    qw = weights(groups, k)
    qa = quantize_fp8(torch.randn(sum(counts), k, generator=gen) * 3)
    y = gm.linear_grouped_fp8(qa, qw, counts, out_dtype=torch.float32)
    swap = torch.arange(k).view(2, 128).flip(0).flatten()
    qa_swapped = FP8Tensor(qa.codes[:, swap].contiguous(), qa.scales.flip(-1).contiguous(), qa.block, qa.rule)
    qw_swapped = FP8Tensor(qw.codes[:, :, swap].contiguous(), qw.scales.flip(-1).contiguous(), qw.block, qw.rule)
    swapped = gm.linear_grouped_fp8(qa_swapped, qw_swapped, counts, out_dtype=torch.float32)
    record("control_k_order", torch.equal(y, alone(qa, qw, counts, torch.float32))
           and not torch.equal(swapped, y) and torch.allclose(swapped, y, rtol=1e-5, atol=1e-5),
           f"K blocks swapped: {(swapped != y).any(-1).sum()} rows differ")
    group_of = torch.repeat_interleave(torch.arange(groups), torch.tensor(counts))
    w_bf16 = (qw.codes.float() * qw_dequant_scales(qw)).to(torch.bfloat16)
    deq = torch.einsum("mk,mnk->mn", qa.dequantize(torch.bfloat16).float(), w_bf16.float()[group_of])
    record("control_dequantised_bf16", not torch.equal(deq, y) and torch.allclose(deq, y, rtol=2e-2, atol=5e-2),
           f"dequantised matmul: {(deq != y).any(-1).sum()} rows differ")
    return results


def qw_dequant_scales(qw):
    """The weights' block scales expanded to [G, N, K]."""
    g, n, k = qw.codes.shape
    r, c = qw.block
    return qw.scales.repeat_interleave(r, 1)[:, :n].repeat_interleave(c, 2)[:, :, :k]


def _check_no_host_read(record, gm, qa, qw, counts, want):
    """The launcher never reads a device-size tensor on the host: handed a tensor whose host reads raise,
    it launches, and the kernel gets that very tensor. Control: the guard does catch a host read."""
    import torch

    BLOCKED = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__index__,
               torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__iter__, torch.Tensor.cpu,
               torch.Tensor.numpy, torch.Tensor.__len__}
    guard = {"on": True}

    class DeviceOnly(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if guard["on"] and func in BLOCKED:
                raise AssertionError(f"host read of the group sizes: {func.__name__}")
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    kernel, seen = gm._linear_grouped_fp8_kernel, []

    class Launch:  # the launch itself reads the sizes where the kernel runs (here the interpreter: the host)
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append(args[6])
                guard["on"] = False
                try:
                    return kernel[grid](*args, **kwargs)
                finally:
                    guard["on"] = True
            return run

    sizes = torch.tensor(counts).as_subclass(DeviceOnly)
    gm._linear_grouped_fp8_kernel = Launch()
    try:
        got = gm.linear_grouped_fp8(qa, qw, sizes)
        record("no_host_read", torch.equal(got, want) and len(seen) == 1 and seen[0] is sizes,
               f"kernel got {[type(s).__name__ for s in seen]}")
    except AssertionError as e:
        record("no_host_read", False, str(e))
    finally:
        gm._linear_grouped_fp8_kernel = kernel
    try:
        sizes.tolist()
        record("no_host_read", False, "control: the guard let .tolist() through")
    except AssertionError:
        pass


def _check_layouts(record, gm, quantize_fp8, qw, counts, x, want):
    """The masked layout (models/moe.py): each group's rows in whole chunks of CAPACITY rows, zero rows
    filling the last, a NaN tail past them, quantised as a whole; its rows equal the contiguous layout's.
    The quantiser is per token: quantising the tokens once, then gathering codes and scales, gives the
    codes and scales of quantising the gathered rows."""
    import torch

    from onepath.numerics.quant import FP8Tensor, quantize_fp8 as quantize_fp8_torch
    from tests.interpret import same_fp8

    capacity = 4
    chunks = [-(-c // capacity) * capacity for c in counts]
    buffer = torch.full((sum(chunks) + 2 * capacity, x.shape[1]), float("nan"))
    buffer[:sum(chunks)] = 0
    starts = torch.tensor([0, *chunks[:-1]]).cumsum(0).tolist()
    for part, start in zip(x.split(counts), starts):
        buffer[start:start + part.shape[0]] = part
    for sizes in (chunks, torch.tensor(chunks)):
        out = gm.linear_grouped_fp8(quantize_fp8(buffer), qw, sizes) if isinstance(sizes, torch.Tensor) else \
            gm.linear_grouped_fp8(quantize_fp8(buffer[:sum(chunks)]), qw, sizes)
        got = torch.cat([out[s:s + c] for s, c in zip(starts, counts)])
        record("masked_equals_contiguous", torch.equal(got, want), f"sizes as {type(sizes).__name__}")

    tokens = torch.randn(7, x.shape[1], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    order = torch.tensor([3, 0, 6, 6, 1, 3, 5, 2, 0, 4])  # a dispatch's gather: tokens repeated, reordered
    before = quantize_fp8(tokens)
    gathered = FP8Tensor(before.codes.index_select(0, order), before.scales.index_select(0, order), before.block,
                         before.rule)
    after = quantize_fp8(tokens.index_select(0, order))
    record("quantise_before_or_after_gather", same_fp8(gathered, after)
           and same_fp8(after, quantize_fp8_torch(tokens.index_select(0, order))), "codes and scales")


def _check_moe_row_maps(record, gm, quantize_fp8, qw, dense):
    """models/moe.py's own row maps, the tokens quantised once and their codes gathered by the dispatch:
    experts_contiguous and experts_masked (buffer sized for any routing, chunks of 4) give each (token,
    slot) pair the bits of the dense kernel on that token alone against that expert."""
    import torch

    from onepath.models.moe import experts_contiguous, experts_masked

    def grouped(rows, counts):  # rows: token indices, gathered as the dispatch gathers the tokens
        return gm.linear_grouped_fp8(gather(q, rows), qw, counts)

    def gather(qx, index):
        return type(qx)(qx.codes.index_select(0, index), qx.scales.index_select(0, index), qx.block, qx.rule)

    gen = torch.Generator().manual_seed(5)
    groups, k = qw.codes.shape[0], qw.codes.shape[2]
    t = 9
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16)
    q = quantize_fp8(x)
    ids = torch.arange(t).view(t, 1).float()  # the row maps move token ids; the kernel gets the codes they index
    chosen = torch.stack([torch.ones(t, dtype=torch.long), torch.tensor([0, 2, 4])[torch.arange(t) % 3]], 1)
    with torch.no_grad():
        contiguous = experts_contiguous(None, ids, chosen, groups, lambda r, c: grouped(r[:, 0].long(), c))
        masked = experts_masked(None, ids, chosen, groups, 4, lambda r, c: grouped(r[:, 0].long(), c))
    alone = torch.stack([torch.cat([dense(gather(q, torch.tensor([i])), int(e)) for e in chosen[i]]) for i in range(t)])
    record("moe_row_maps_equal_alone", torch.equal(contiguous, alone) and torch.equal(masked, alone),
           f"contiguous {torch.equal(contiguous, alone)}, masked {torch.equal(masked, alone)}")


interpreted, test_linear_grouped_fp8_interpreted = interpreted_checks(__file__, "linear_grouped_fp8", CHECKS)


def test_config_pick_follows_m_and_g():
    import pytest
    pytest.importorskip("triton")

    from onepath.ops.cuda import linear_grouped_fp8 as gm
    from onepath.ops.cuda.linear_fp8 import TILES_FP8

    assert gm.pick_grouped_fp8_config([512] * 64, 768, 132) == TILES_FP8[0]
    assert gm.pick_grouped_fp8_config([0] * 64, 768, 132) == TILES_FP8[-1]
    assert gm.pick_grouped_fp8_config([1], 128, 3) == TILES_FP8[-1]


def _compile_sm90(cfg, out: str):
    from onepath.ops.cuda import linear_grouped_fp8 as gm

    consts = dict(W_TMA=cfg.tma, W_BLOCK_N=128, G_PAD=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=128,
                  GROUP_M=cfg.group_m)
    sig = {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "w_ptr": "*fp8e4nv", "sw_ptr": "*fp32", "out_ptr": f"*{out}",
           "counts_ptr": "*i64", **{a: "i32" for a in ("G", "N", "K", "NUM_PROGRAMS", "stride_am", "stride_sam",
                                                       "stride_sak", "stride_we", "stride_wn", "stride_swe",
                                                       "stride_swn", "stride_om")}}
    if cfg.tma:
        sig["w_desc"] = f"tensordesc<fp8e4nv[{cfg.block_n}, 128]>"
    else:
        consts["w_desc"] = None
    aligned = ("a_ptr", "w_ptr", "out_ptr", "counts_ptr", "N", "K", "stride_am", "stride_we", "stride_wn", "stride_om")
    return compile_sm90(gm._linear_grouped_fp8_kernel, sig, consts, aligned, cfg)


def test_every_grouped_fp8_config_compiles_for_sm90_on_fp8_wgmma_within_shared_memory():
    """What the launcher can run builds for the H200 (the Triton wheel's ptxas, no GPU): fp8 wgmma (e4m3
    operands, no mma.sync fallback), one FMA per K block, the weight by TMA where the config says so,
    within the 227 KiB of shared memory; bf16 and fp32 out."""
    import dataclasses

    from onepath.ops.cuda.linear_fp8 import TILES_FP8

    bad = []
    for cfg in (dataclasses.replace(c, tma=tma) for c in TILES_FP8 for tma in (False, True)):
        for out in ("bf16", "fp32"):
            ptx, shared = _compile_sm90(cfg, out)
            ok = "wgmma.mma_async" in ptx and ".e4m3.e4m3" in ptx and "mma.sync" not in ptx and "fma.rn.f32" in ptx
            tma = ("cp.async.bulk.tensor" in ptx) == cfg.tma
            if shared > SM90_SHARED_BYTES or not ok or not tma:
                bad.append((cfg, out, shared, ok, tma))
    assert not bad, f"(config, out, shared bytes, fp8 wgmma + fma, TMA as configured) that break the build: {bad}"


if __name__ == "__main__":
    print_checks(_run_checks)
