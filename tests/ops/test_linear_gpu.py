"""onepath.ops.cuda.linear on the GPU: a row's bits do not depend on the batch (bitwise), the values
are right (a stated bound against an fp64 product), the runs repeat, and every tile config the
launcher may pick for some M gives the same bits. Negative control: cuBLAS (F.linear) fails the
same batch test. Whole file: well under a minute on an H200, most of it Triton compiles.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from onepath.ops.cuda.linear import (DENSE_TILES, SKINNY_TILES, SMALL_TILES, SWAP_TILES, TILES_16BIT,  # noqa: E402
                                     TileConfig, dense_candidates, linear, pick_config)

# (K, N): Qwen-0.5B-like MLP (896 -> 4864), 1024 -> 3072, square 4096, an LM head (kept at 32000
# columns to stay light), and an awkward size whose K and N tiles are all ragged.
SHAPES = [(1024, 3072), (4096, 4096), (2048, 32000), (896, 4864), (1000, 1000)]
MS = [1, 2, 3, 7, 16, 24, 31, 64, 100, 128, 255, 256, 1000, 4096]
PROBE_ROWS = 3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _randn(*shape, gen, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


def _weight(k, n, dtype=torch.bfloat16, seed=0):
    return _randn(n, k, gen=_gen(seed), dtype=dtype, scale=k ** -0.5)


def _embedded(fn, probe, m, gen):
    """fn on a random batch of m rows with the probe block at a random offset: the probe's rows."""
    if m < probe.shape[0]:
        return fn(probe[:m]), slice(0, m)
    batch = _randn(m, probe.shape[1], gen=gen, dtype=probe.dtype)
    off = int(torch.randint(m - probe.shape[0] + 1, (1,), generator=gen, device="cuda"))
    batch[off:off + probe.shape[0]] = probe
    return fn(batch)[off:off + probe.shape[0]], slice(0, probe.shape[0])


def _batch_mismatches(fn, k, ms, seed, dtype=torch.bfloat16):
    gen = _gen(seed)
    probe = _randn(PROBE_ROWS, k, gen=gen, dtype=dtype)
    alone = fn(probe)
    bad = []
    for m in ms:
        got, rows = _embedded(fn, probe, m, gen)
        if not torch.equal(got, alone[rows]):
            bad.append((m, (got.float() - alone[rows].float()).abs().max().item()))
    return bad


def _error_bound(x, w, exact, out_dtype):
    # |out - exact| <= u|exact| + 2 K 2^-24 (|x| |w|^T): an FP32 sum of K exact products in any
    # order (fp32 inputs: products rounded too, covered by the factor 2), then one rounding to
    # out_dtype (u = 2^-8 bf16, 2^-10 fp16, 2^-23 fp32). Too loose to catch TF32: see the exact case.
    u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}[out_dtype]
    a = x.double().abs() @ w.double().abs().T
    return u * exact.abs() + 2 * x.shape[1] * 2.0 ** -24 * a


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("k,n", SHAPES)
def test_rows_do_not_depend_on_the_batch(k, n):
    w = _weight(k, n)
    bad = _batch_mismatches(lambda x: linear(x, w), k, MS, seed=k + n)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    detail = [(m, pick_config(m, n, torch.bfloat16, sms), d) for m, d in bad]
    assert not bad, f"K={k} N={n}: probe rows changed inside batches of M (M, config, max diff): {detail}"


@pytest.mark.parametrize("k,n", SHAPES)
def test_values_within_bound_and_deterministic(k, n):
    w = _weight(k, n)
    x = _randn(1000, k, gen=_gen(1))
    out = linear(x, w)
    exact = x.double() @ w.double().T
    err = (out.double() - exact).abs()
    assert out.dtype == torch.bfloat16 and out.shape == (1000, n)
    assert (err <= _error_bound(x, w, exact, torch.bfloat16)).all(), f"K={k} N={n}: max err {err.max().item():.3g}"
    assert torch.equal(linear(x, w), out), f"K={k} N={n}: two runs on the same input differ"
    big = _randn(4096, k, gen=_gen(2))
    assert torch.equal(linear(big, w), linear(big, w)), f"K={k} N={n}, M=4096: two runs differ"


@pytest.mark.gpu_smoke
def test_cublas_is_not_batch_invariant():
    """Negative control: the same test catches cuBLAS's M-dependent kernel choice (M >= 64)."""
    found = []
    for k, n in SHAPES:
        w = _weight(k, n)
        found += [(k, n, m) for m, _ in _batch_mismatches(lambda x: F.linear(x, w), k, [m for m in MS if m >= 64],
                                                          seed=k + n)]
    assert found, "F.linear kept every probe row's bits: the batch test cannot tell (CUBLAS_WORKSPACE_CONFIG=:0:0 set?)"


@pytest.mark.parametrize("k,n", [(4096, 4096), (1000, 1000)])
def test_every_tile_config_gives_the_same_bits(k, n):
    """pick_config may change the tile with M only because the tile never changes the bits: rows,
    columns, K step (64, 128, 256), warps, TMA or pointer loads, wgmma or (16- and 32-row tiles) mma.sync,
    and SWAP_TILES (the weight rows as the MMA's M, the tokens as its N; by TMA and by pointer loads).
    Control: the same kernel summing K's two halves apart (a split-K) gives other bits."""
    w = _weight(k, n)
    x = _randn(300, k, gen=_gen(3))
    ref = linear(x, w, config=TILES_16BIT[0])
    deeper = [TileConfig(bm, bn, warps, stages, tma=tma, block_k=bk) for bm, bn, warps, stages in
              ((16, 32, 1, 4), (64, 64, 4, 3), (128, 128, 8, 2)) for bk in (128, 256) for tma in (False, True)]
    deeper = [c for c in deeper if c.pipeline_bytes() <= 200 * 1024] + [TileConfig(128, 256, 8, 4, tma=True)]
    configs = [*TILES_16BIT, *(TileConfig(c.block_m, c.block_n, c.num_warps, c.num_stages, tma=True) for c in TILES_16BIT),
               *DENSE_TILES, *SKINNY_TILES, *SMALL_TILES, *dense_candidates(512), *deeper,
               *SWAP_TILES, *(replace(c, tma=False) for c in SWAP_TILES)]
    outs = {c: linear(x, w, config=c) for c in configs}
    bad = [(c, (out.float() - ref.float()).abs().max().item()) for c, out in outs.items() if not torch.equal(out, ref)]
    assert not bad, f"K={k} N={n}: configs whose bits differ from {TILES_16BIT[0]}: {bad}"
    half = k // 2
    split = (linear(x[:, :half], w[:, :half], out_dtype=torch.float32)
             + linear(x[:, half:], w[:, half:], out_dtype=torch.float32)).bfloat16()
    assert not torch.equal(split, ref), "a split-K sum gave the same bits: the check cannot tell"


@pytest.mark.parametrize("k,n", [(896, 4864), (2048, 32000)])
def test_bias_and_fp32_output(k, n):
    w = _weight(k, n)
    b = _randn(n, gen=_gen(4))
    fn = lambda x: linear(x, w, b, out_dtype=torch.float32)  # noqa: E731
    bad = _batch_mismatches(fn, k, [1, 64, 255, 4096], seed=5)
    assert not bad, f"K={k} N={n} bias, fp32 out: probe rows changed inside batches (M, max diff): {bad}"
    x = _randn(257, k, gen=_gen(6))
    out = fn(x)
    exact = x.double() @ w.double().T + b.double()
    err = (out.double() - exact).abs()
    assert out.dtype == torch.float32
    assert (err <= _error_bound(x, w, exact, torch.float32)).all(), f"max err {err.max().item():.3g}"
    # the bias joins the FP32 accumulator; one round-to-nearest-even gives the bf16 result
    assert torch.equal(linear(x, w, b), out.to(torch.bfloat16))


def test_fp32_inputs_are_not_tf32():
    k, n = 1024, 3072
    w = _weight(k, n, dtype=torch.float32)
    bad = _batch_mismatches(lambda x: linear(x, w), k, [1, 64, 1000], seed=7, dtype=torch.float32)
    assert not bad, f"fp32: probe rows changed inside batches (M, max diff): {bad}"
    x = _randn(64, k, gen=_gen(8), dtype=torch.float32)
    exact = x.double() @ w.double().T
    err = (linear(x, w).double() - exact).abs()
    assert (err <= _error_bound(x, w, exact, torch.float32)).all(), f"fp32 max err {err.max().item():.3g}"
    # Exact case: +-1 times integers below 2^13, sums below 2^23: every fp32 step is exact, while
    # TF32 (10 mantissa bits) would round the weights (the TF32 mm bug of batch_invariant_ops #23).
    gen = _gen(10)
    signs = (torch.randint(0, 2, (5, k), generator=gen, device="cuda") * 2 - 1).float()
    ints = torch.randint(0, 8192, (n, k), generator=gen, device="cuda").float()
    assert torch.equal(linear(signs, ints), (signs.double() @ ints.double().T).float()), "fp32 inputs ran as TF32"


def test_fp16_rows_do_not_depend_on_the_batch():
    k, n = 1024, 3072
    w = _weight(k, n, dtype=torch.float16)
    bad = _batch_mismatches(lambda x: linear(x, w), k, [1, 7, 64, 255, 1000], seed=9, dtype=torch.float16)
    assert not bad, f"fp16: probe rows changed inside batches (M, max diff): {bad}"


def test_operand_alignment_does_not_change_bits():
    """A view at a 2-byte offset compiles a kernel without 16-byte vector loads (and skips TMA):
    other loads, same values, same dot. (On CPU a GEMM's bits did follow the alignment.)"""
    k, n, m = 1024, 3072, 100
    w = _weight(k, n)
    flat = _randn(m * k + 1, gen=_gen(11))
    shifted = flat[1:].view(m, k)
    assert shifted.data_ptr() % 16 != 0
    for cfg in (None, TileConfig(64, 64, 4, 4, tma=True)):
        assert torch.equal(linear(shifted, w, config=cfg), linear(shifted.clone(), w, config=cfg)), cfg
