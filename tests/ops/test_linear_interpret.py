"""onepath.ops.cuda.linear run by Triton's CPU interpreter (TRITON_INTERPRET=1) on tiny shapes.

The interpreter must be on before the kernel is decorated, so the checks run in a subprocess: this
file, run as a script, prints one JSON line of results that the tests below assert on. On CPU the
dot is numpy's, so what this proves is the kernel's logic (tile walk, masks, K tail, bias, the one
rounding, rows never mixing); the bits of Hopper's MMA are tests/ops/test_linear_gpu.py's job.
"""
from __future__ import annotations


import pytest
from tests.interpret import (SM90_SHARED_BYTES, check_recorder, compile_sm90,
                              interpreted_checks, patch_gemm_interpreter, print_checks)

CHECKS = ["values", "rows_alone_equal_rows_in_batch", "configs_agree", "last_rows_back", "bias_fp32_out", "one_rounding",
          "leading_dims"]
DTYPES = ["bfloat16", "float16", "float32"]


def _run_checks() -> dict:
    import torch

    patch_gemm_interpreter()
    from onepath.ops.cuda.linear import (DENSE_TILES, SKINNY_TILES, SMALL_TILES, SWAP_TILES, TILES_16BIT,
                                        TileConfig, dense_candidates, linear)

    gen = torch.Generator().manual_seed(0)
    n, k = 48, 96  # K = 64 + 32: one full K tile and one masked tail
    # Forced configs beside the default: 16-row tiles make M = 1..40 span up to three M tiles and
    # the 3-program persistent loop walk several tiles; the TMA one reads through descriptors; the
    # 128-deep K step takes all of K = 96 in one masked step.
    configs = {"default": None, "16x16": TileConfig(16, 16, 4, 2, group_m=2),
               "tma_16x32": TileConfig(16, 32, 4, 2, tma=True),
               "16x32x128": TileConfig(16, 32, 1, 2, block_k=128),
               "swap_16x16": TileConfig(16, 16, 4, 2, group_m=2, swap=True),
               "swap_tma_16x32": TileConfig(16, 32, 4, 2, tma=True, swap=True)}
    results, record = check_recorder()

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=gen).to(getattr(torch, dtype))

    def bound(x, w, out_dtype, exact):
        # |out - exact| <= u_out|exact| + 2 K 2^-24 (|x| |w|^T): one rounding to out_dtype plus
        # an FP32 sum of K products (exact in fp32) in any order.
        u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}[out_dtype]
        a = x.double().abs() @ w.double().abs().T
        return u * exact.abs() + 2 * x.shape[-1] * 2.0 ** -24 * a + 1e-30

    for dtype in DTYPES:
        w = rand(n, k, dtype=dtype)
        for m in (1, 3, 17):
            x = rand(m, k, dtype=dtype)
            exact = x.double() @ w.double().T
            for cname, cfg in configs.items():
                y = linear(x, w, config=cfg)
                err = (y.double() - exact).abs()
                record("values", y.dtype == x.dtype and y.shape == (m, n) and bool((err <= bound(x, w, y.dtype, exact)).all()),
                       f"{dtype} M={m} {cname}: max err {err.max().item():.3g}")

        for cname, cfg in configs.items():
            probe = rand(1, k, dtype=dtype)
            alone = linear(probe, w, config=cfg)
            for m in range(1, 41):
                batch = rand(m, k, dtype=dtype)
                pos = int(torch.randint(m, (1,), generator=gen))
                batch[pos] = probe[0]
                same = torch.equal(linear(batch, w, config=cfg)[pos], alone[0])
                record("rows_alone_equal_rows_in_batch", same, f"{dtype} {cname} M={m} pos={pos}")

    # Every config (and TMA, and its pointer fallback when K * 2 bytes is not a multiple of 16)
    # reads the same values and walks K the same way: with a row-independent dot, equal bits.
    for dtype in DTYPES:
        for kk in (k, 100):
            x, w = rand(40, kk, dtype=dtype), rand(n, kk, dtype=dtype)
            ref = linear(x, w, config=configs["16x16"])
            for cfg in (*configs.values(), *TILES_16BIT, *DENSE_TILES, *SKINNY_TILES, *SMALL_TILES, *SWAP_TILES,
                        *dense_candidates(512), TileConfig(64, 64, 4, 3, tma=True)):
                record("configs_agree", torch.equal(linear(x, w, config=cfg), ref), f"{dtype} K={kk} {cfg}")

    # The last row tile moved back to end at M (rows computed twice, stored twice) or running past M: the same
    # output, at every M a tile does not divide, and with or without TMA.
    from onepath.ops.cuda import linear as mm
    w = rand(n, k, dtype="bfloat16")
    for cname in ("16x16", "tma_16x32", "swap_16x16", "swap_tma_16x32"):
        for m in (17, 23, 31, 33, 40):
            x = rand(m, k, dtype="bfloat16")
            back = linear(x, w, config=configs[cname])
            mm.LAST_ROWS_BACK = False
            try:
                past = linear(x, w, config=configs[cname])
            finally:
                mm.LAST_ROWS_BACK = True
            record("last_rows_back", torch.equal(back, past), f"{cname} M={m}")

    w, b = rand(n, k, dtype="bfloat16"), rand(n, dtype="bfloat16")
    probe = rand(2, k, dtype="bfloat16")
    alone = linear(probe, w, b, out_dtype=torch.float32)
    exact = probe.double() @ w.double().T + b.double()
    record("bias_fp32_out", alone.dtype == torch.float32, f"dtype {alone.dtype}")
    record("bias_fp32_out", bool(((alone.double() - exact).abs() <= bound(probe, w, torch.float32, exact)).all()),
           f"max err {(alone.double() - exact).abs().max().item():.3g}")
    for m in (2, 5, 33):
        batch = rand(m, k, dtype="bfloat16")
        pos = int(torch.randint(m - 1, (1,), generator=gen))
        batch[pos:pos + 2] = probe
        record("bias_fp32_out", torch.equal(linear(batch, w, b, out_dtype=torch.float32)[pos:pos + 2], alone), f"M={m}")

    # bias added in fp32 before a single round-to-nearest-even: the bf16 result is the fp32 one rounded.
    x = rand(7, k, dtype="bfloat16")
    for bias in (None, b):
        wide = linear(x, w, bias, out_dtype=torch.float32)
        record("one_rounding", torch.equal(linear(x, w, bias), wide.to(torch.bfloat16)), f"bias={bias is not None}")

    x3 = rand(2, 5, k, dtype="bfloat16")
    y3 = linear(x3, w)
    record("leading_dims", y3.shape == (2, 5, n) and torch.equal(y3.reshape(10, n), linear(x3.reshape(10, k), w)),
           f"shape {tuple(y3.shape)}")
    record("leading_dims", linear(x3[:0].reshape(0, k), w).shape == (0, n), "M = 0")
    return results


def test_pick_config_fills_the_sms():
    pytest.importorskip("triton")
    import dataclasses

    import torch

    from onepath.ops.cuda import linear as mm

    skinny, dense = mm.SKINNY_TILES, mm.DENSE_TILES
    # up to 16 rows: the swapped 16x128 tile where N gives it half the SMs, else the swapped 16x64
    assert mm.pick_config(1, 11008, torch.bfloat16, 132) == skinny[0], "86 tiles of 16x128"
    assert mm.pick_config(16, 4096, torch.bfloat16, 132) == skinny[1], "64 tiles of 16x128 fall short of 66"
    assert mm.pick_config(1, 1024, torch.bfloat16, 132) == skinny[-1]
    assert all(c.swap for c in skinny)
    # 17..32 rows: 32x128 where it gives half the SMs a tile, else the swapped tiles alike
    small = mm.SMALL_TILES
    assert mm.pick_config(17, 4096, torch.bfloat16, 132) == small[-1], "128 tiles of 16x64"
    assert mm.pick_config(32, 11008, torch.bfloat16, 132) == small[0], "86 tiles of 32x128"
    assert mm.pick_config(32, 6144, torch.bfloat16, 132) == small[1], "96 tiles of 16x128"
    assert mm.pick_config(32, 2048, torch.bfloat16, 132) == small[-1]
    assert mm.pick_config(32, 151936, torch.bfloat16, 132, torch.float32) == small[0]
    assert mm.pick_config(32, 1024, torch.bfloat16, 132) == small[-1], "none gives half the SMs a tile: the smallest"
    assert mm.pick_config(33, 4096, torch.bfloat16, 132) == dense[-1], "past 32 rows: the dense ladder"
    assert mm.pick_config(256, 4096, torch.bfloat16, 132) == dense[2], "128 tiles of 64x128 fill half"
    assert mm.pick_config(256, 2048, torch.bfloat16, 132) == dense[3]
    assert mm.pick_config(256, 1024, torch.bfloat16, 132) == dense[-1]
    # 128x256 gives 86 tiles, one round on 132 SMs; 64x128 gives 344, three rounds of a quarter the outputs
    # at 0.8 the speed: 0.94 of the time (it ran 43.4 against 46.2 us, kernels-matmul-ladder-m32-512.json)
    assert mm.pick_config(256, 11008, torch.bfloat16, 132) == dense[2]
    deep = dataclasses.replace(dense[1], num_stages=mm.DEEP_RING_STAGES)
    assert mm.pick_config(1024, 6144, torch.bfloat16, 132) == deep, "3 rounds of 128x128 tiles model below 2 of 128x256"
    # the FP32-output LM head at training M: 128x128 (64x128 ran it 1.08x slower, kernels-matmul-sweep-large-tiles.json),
    # with the fifth stage up to DEEP_RING_M rows
    assert mm.pick_config(1000, 151936, torch.bfloat16, 132, torch.float32) == deep
    assert all(mm.pick_config(m, 151936, torch.bfloat16, 132, torch.float32) == dense[1] for m in (4096, 6000, 8192))
    # 128-row tiles once M fills three quarters of one: llama's 4096x11008 at M = 96 (one round of 86 tiles), not 80
    assert mm.pick_config(96, 11008, torch.bfloat16, 132) == deep
    assert mm.pick_config(80, 11008, torch.bfloat16, 132).block_m == 64
    assert mm.pick_config(4096, 4096, torch.bfloat16, 132) == dense[0]
    assert mm.pick_config(4096, 4096, torch.float32, 132) == mm.TILE_FP32
    lm_head = mm.pick_config(8192, 151936, torch.bfloat16, 132, torch.float32)
    assert lm_head.block_m * lm_head.block_n <= mm.MAX_TILE_FP32_OUT
    assert all(c.block_m >= 64 for c in (*mm.TILES_16BIT, *dense)), "past 16 rows, every tile is on wgmma"


def _compile_sm90(cfg, dtype: str, out: str):
    """The kernel compiled for sm_90 by the Triton wheel's own ptxas: (ptx, shared bytes)."""
    from onepath.ops.cuda import linear as mm

    consts = dict(HAS_BIAS=True, TMA=cfg.tma, EVEN_M=False, LAST_ROWS_BACK=True, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  GROUP_M=cfg.group_m, NUM_SMS=132, SWAP=cfg.swap)
    sig = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "bias_ptr": f"*{dtype}", "out_ptr": f"*{out}",
           **{n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om")}}
    if cfg.tma:
        sig["x_desc"] = f"tensordesc<{dtype}[{cfg.block_m}, {cfg.block_k}]>"
        sig["w_desc"] = f"tensordesc<{dtype}[{cfg.block_n}, {cfg.block_k}]>"
    else:
        consts.update(x_desc=None, w_desc=None)
    aligned = ("x_ptr", "w_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om")
    return compile_sm90(mm._linear_kernel, sig, consts, aligned, cfg)


def test_every_config_compiles_for_sm90_on_wgmma_within_shared_memory():
    """What the launcher can pick builds for the H200: within its shared memory; 16-bit inputs on
    wgmma, except the 16- and 32-row tiles on mma.sync (whose bits tests/ops/test_linear_gpu.py proves
    equal); fp32 inputs on FMA (ieee, no TF32 tensor-core path). SWAP_TILES, 16 tokens with the
    weight rows as the MMA's M, build on wgmma too."""
    import dataclasses

    from onepath.ops.cuda import linear as mm

    cases = [(dataclasses.replace(c, tma=tma), "bf16", out) for c in (*mm.TILES_16BIT, *mm.DENSE_TILES, *mm.SKINNY_TILES,
                                                                        *mm.SMALL_TILES, *mm.dense_candidates(512),
                                                                        *mm.SWAP_TILES)
             for tma in (False, True) for out in ("bf16", "fp32") if out == "bf16" or c.block_m * c.block_n <= mm.MAX_TILE_FP32_OUT]
    cases += [(mm.TILES_16BIT[-1], "fp16", "fp16"), (mm.TILE_FP32, "fp32", "fp32")]
    bad = []
    for cfg, dtype, out in cases:
        ptx, shared = _compile_sm90(cfg, dtype, out)
        mma_rows = cfg.block_n if cfg.swap else cfg.block_m
        tensor_core = ("mma.sync" in ptx and "wgmma" not in ptx) if mma_rows < 64 else \
            ("wgmma.mma_async" in ptx and "mma.sync" not in ptx)
        no_mma = "wgmma" not in ptx and "mma.sync" not in ptx
        if shared > SM90_SHARED_BYTES or not (no_mma if dtype == "fp32" else tensor_core):
            bad.append((cfg, dtype, out, shared, "wgmma" in ptx, "mma.sync" in ptx))
    assert not bad, f"(config, in, out, shared bytes, wgmma, mma.sync) that break the build contract: {bad}"


interpreted, test_linear_interpreted = interpreted_checks(__file__, "linear", CHECKS)


if __name__ == "__main__":
    print_checks(_run_checks)
