"""bench/grouped_variants.py's variants give the shipped grouped GEMM's bits: run by Triton's CPU
interpreter (TRITON_INTERPRET=1) on awkward shapes, and built for sm_90.

The interpreter's dot is test_grouped_matmul_interpret.py's row-independent model of the MMA chain,
so what must match is each element's K walk: every variant (tile shapes, TMA or pointer loads, the
grids, the kernel before with its tile list) gives every counted row ops/cuda/linear.py's bits on the
row's expert, with the sizes as a list or a device tensor. The negative control, a K step of 32
instead of 64 (another chain of roundings), must differ. Hopper's MMA bits are the GPU bench's
check (torch.equal on every row it times).
"""
from __future__ import annotations

import pytest
from tests.interpret import SM90_SHARED_BYTES, compile_sm90, interpreted_checks, patch_gemm_interpreter, print_checks

COUNTS = [0, 1, 37, 0, 6, 70]
SHAPES = [(72, 200), (200, 136)]  # (N, K): K tails of 8 and 8 past whole 64-wide steps


def _run_checks() -> dict:
    import torch

    patch_gemm_interpreter()

    from bench.grouped_variants import case, dense_rows, fits, run_variant, variants
    from onepath.ops.cuda import linear as mm
    from tests.interpret import check_recorder

    results, record = check_recorder()
    gen = torch.Generator().manual_seed(0)
    every = {str(v): v for v in [*variants(256), *variants(8192)]}
    control = []
    for n, k in SHAPES:
        w = torch.randn(len(COUNTS), n, k, generator=gen).bfloat16()
        # the counted rows, then rows past the sizes (NaN: never read into a stored row)
        x = torch.cat([torch.randn(sum(COUNTS), k, generator=gen), torch.full((5, k), float("nan"))]).bfloat16()
        rows = sum(COUNTS)
        for out_dtype in (torch.bfloat16, torch.float32):
            want = dense_rows(x, w, COUNTS, out_dtype)
            for name, v in every.items():
                if not fits(v.tile, out_dtype):
                    continue
                got = run_variant(v, x, w, torch.tensor(COUNTS), out_dtype)[:rows]
                record(name, torch.equal(got, want), f"N={n} K={k} {out_dtype} device sizes")
                if v.table or v.tile is None:  # the eager paths: sizes as a list
                    got = run_variant(v, x[:rows], w, COUNTS, out_dtype)
                    record(name, torch.equal(got, want), f"N={n} K={k} {out_dtype} list sizes")
            # control: the dense kernel split along K (two accumulators, added at the end) gives other
            # bits (the checks can fail; a rounding may hide it in one case, not in all)
            half = k // 2

            def split_k(p, we):
                return (mm.matmul(p[:, :half], we[:, :half], out_dtype=torch.float32)
                        + mm.matmul(p[:, half:], we[:, half:], out_dtype=torch.float32)).to(out_dtype)
            other = torch.cat([split_k(p, w[e]) for e, p in enumerate(x[:rows].split(COUNTS))])
            control.append(not torch.equal(other, want))
    record("negative_control_differs", any(control), "a split-K sum gave the dense bits in every case")

    # the masked case: whole 16-row chunks per expert, the buffer models/moe.py sizes for any routing
    from onepath.models.moe import CAPACITY, max_chunks

    x, w, counts, layout = case(5, 24, 16, torch.Generator().manual_seed(1), device="cpu")
    nan_rows = x.isnan().any(-1)
    record("masked_case", layout == "masked" and all(c % CAPACITY == 0 for c in counts)
           and x.shape[0] == max_chunks(5 * 8, len(counts), CAPACITY) * CAPACITY
           and not nan_rows[:sum(counts)].any() and bool(nan_rows[sum(counts):].all()), f"counts {counts}")
    return results


def _names() -> list[str]:
    from bench.grouped_variants import variants
    return list(dict.fromkeys(str(v) for v in [*variants(256), *variants(8192)]))


interpreted, test_variant_bits_equal_dense_interpreted = interpreted_checks(
    __file__, "grouped variants", [*_names(), "negative_control_differs", "masked_case"])


def test_every_variant_compiles_for_sm90_on_wgmma_within_shared_memory():
    """What the GPU bench times builds for the H200 (the wheel's ptxas, no GPU): wgmma only, TMA
    where the variant says so, within 227 KiB of shared memory; the kernel before too."""
    import torch

    from bench.grouped_variants import TILES_16BIT, _table_kernel, fits, variants
    from onepath.ops.cuda import linear as mm
    from tests.ops.test_grouped_matmul_interpret import _compile_sm90

    pytest.importorskip("triton.backends.nvidia")
    bad = []
    builds = {(v.tile, v.x_tma) for v in [*variants(256), *variants(8192)] if v.tile is not None}
    for cfg, x_tma in builds:
        for out, out_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            if not fits(cfg, out_dtype):
                continue
            ptx, shared = _compile_sm90(cfg, "bf16", out, x_tma)
            if (shared > SM90_SHARED_BYTES or "wgmma.mma_async" not in ptx or "mma.sync" in ptx
                    or ("cp.async.bulk.tensor" in ptx) != cfg.tma):
                bad.append((cfg, x_tma, out, shared))
    for cfg in TILES_16BIT:
        consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=mm.BLOCK_K, GROUP_M=cfg.group_m, NUM_SMS=132)
        sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "tiles_ptr": "*i32",
               **{a: "i32" for a in ("max_m_tiles", "N", "K", "stride_xm", "stride_we", "stride_wn", "stride_om")}}
        aligned = ("x_ptr", "w_ptr", "out_ptr", "N", "K", "stride_xm", "stride_we", "stride_wn", "stride_om")
        ptx, shared = compile_sm90(_table_kernel, sig, consts, aligned, cfg)
        if shared > SM90_SHARED_BYTES or "wgmma.mma_async" not in ptx:
            bad.append(("table", cfg, shared))
    assert not bad, f"(config, out, shared bytes) that break the build contract: {bad}"


if __name__ == "__main__":
    print_checks(_run_checks)
