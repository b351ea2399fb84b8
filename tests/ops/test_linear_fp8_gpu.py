"""linear_fp8's two kernels on the GPU: the warp-specialized Gluon kernel (ops/cuda/linear_fp8_ws.py) gives
the Triton kernel's bits (torch.equal) on fresh random inputs of awkward sizes, both epilogues (bf16 with
bias, FP32), in its training layout (WS_CONFIG) and its decode one (DECODE_WS_CONFIG); a row alone (M = 1,
the decode layout) equals the same row inside a batch of 4100 rows (the training layout), which is what
lets linear_fp8 pick the kernel by M; the runs repeat. Negative control: a
BF16 GEMM of the dequantised operands, close in value, differs in bits on the same case.
Hopper only (the Gluon kernel is sm_90a's). Whole file: well under a minute on an H200, most of it compiles.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                                 reason="the warp-specialized kernel needs Hopper (capability 9.0)")]
pytest.importorskip("triton")

from onepath.numerics.quant import FP8Tensor, quantize  # noqa: E402
from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT  # noqa: E402
from onepath.ops.cuda.linear import linear, sm_count  # noqa: E402
from onepath.ops.cuda.linear_fp8 import DECODE_WS_CONFIG, WS_CONFIG, linear_fp8, pick_config, pick_kernel  # noqa: E402

DEVICE = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
MS = [1, 37, 128, 130, 511, 512, 777, 2048, 4100]
NS = [200, 1000, 1001, 2048, 6144 + 8]  # 1001: the Gluon kernel's output goes through a padded buffer
KS = [208, 1000, 2048, 4096]  # 1000: its codes through a padded copy
EPILOGUES = [(torch.bfloat16, True), (torch.float32, False)]  # (out_dtype, bias)
BIG = (4100, 6144 + 8, 4096)


def _activations(m, k, seed):
    """Rows of magnitudes 2^-6..2^6: the scales differ from row to row."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mag = torch.exp2(torch.randint(-6, 7, (m, 1), generator=gen, device="cuda").float())
    return quantize(torch.randn(m, k, generator=gen, device="cuda") * mag, FP8_ACT)


def _weight(n, k, seed, bias):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qw = quantize(torch.randn(n, k, generator=gen, device="cuda") * 0.05, FP8_WEIGHT)
    return qw, torch.randn(n, generator=gen, device="cuda").bfloat16() if bias else None


def _operands(m, n, k, seed, bias):
    return (_activations(m, k, seed), *_weight(n, k, seed + 1, bias))


def _triton(qa, qw, b, out_dtype):
    """The Triton kernel at the tile linear_fp8 gives the shape when it does not take the Gluon one."""
    m, n = qa.codes.shape[0], qw.codes.shape[0]
    return linear_fp8(qa, qw, b, out_dtype, config=pick_config(m, n, sm_count(DEVICE)))


@pytest.mark.parametrize("config", [WS_CONFIG, DECODE_WS_CONFIG], ids=str)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", NS)
def test_ws_kernel_gives_the_triton_kernels_bits(n, k, config):
    bad = []
    for out_dtype, bias in EPILOGUES:
        qw, b = _weight(n, k, seed=n * 13 + k, bias=bias)
        for m in MS:
            qa = _activations(m, k, seed=m * 7 + n * 13 + k + bias)
            ws = linear_fp8(qa, qw, b, out_dtype, config=config)
            want = _triton(qa, qw, b, out_dtype)
            picked = linear_fp8(qa, qw, b, out_dtype)
            assert ws.shape == want.shape == (m, n) and ws.dtype == want.dtype == out_dtype
            if not (torch.equal(ws, want) and torch.equal(picked, want)):
                bad.append((m, str(out_dtype), int((ws != want).sum()), int((picked != want).sum())))
    assert not bad, f"N={n} K={k}: (M, out dtype, elements the ws kernel / the default pick got wrong): {bad}"


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("n,k", [BIG[1:], (200, 208), (2048, 2048)])
@pytest.mark.parametrize("out_dtype,bias", EPILOGUES, ids=["bf16_bias", "fp32"])
def test_a_row_alone_equals_the_row_inside_a_batch_the_ws_kernel_takes(n, k, out_dtype, bias):
    m = BIG[0]
    assert pick_kernel(m, n, k, out_dtype, DEVICE) == WS_CONFIG
    assert pick_kernel(1, n, k, out_dtype, DEVICE) in (DECODE_WS_CONFIG, pick_config(1, n, sm_count(DEVICE)))
    qa, qw, b = _operands(m, n, k, seed=n + k, bias=bias)
    batch = linear_fp8(qa, qw, b, out_dtype)
    # tile edges of both kernels (64 and 128 rows), the middle, the ragged last tile
    rows = [0, 63, 64, 127, 128, 2049, 4095, 4096, m - 1]
    bad = []
    for i in rows:
        alone = linear_fp8(FP8Tensor(qa.codes[i:i + 1], qa.scales[i:i + 1], qa.block), qw, b, out_dtype)
        if not torch.equal(alone[0], batch[i]):
            bad.append((i, (alone[0].float() - batch[i].float()).abs().max().item()))
    assert not bad, f"N={n} K={k} {out_dtype}: rows alone differ from the same rows in M={m} (row, max diff): {bad}"


@pytest.mark.parametrize("out_dtype,bias", EPILOGUES, ids=["bf16_bias", "fp32"])
def test_runs_repeat(out_dtype, bias):
    qa, qw, b = _operands(*BIG, seed=1, bias=bias)
    first = linear_fp8(qa, qw, b, out_dtype)
    for _ in range(3):
        assert torch.equal(linear_fp8(qa, qw, b, out_dtype), first)


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("out_dtype,bias", EPILOGUES, ids=["bf16_bias", "fp32"])
def test_negative_control_a_bf16_gemm_of_the_dequantised_operands_differs(out_dtype, bias):
    """The equality above can fail: the same maths with the operands rounded to bf16 and one FP32
    accumulation over K (our BF16 GEMM) is close in value but not in bits."""
    qa, qw, b = _operands(*BIG, seed=2, bias=bias)
    ws = linear_fp8(qa, qw, b, out_dtype)
    control = linear(qa.dequantize(torch.bfloat16), qw.dequantize(torch.bfloat16), b, out_dtype=out_dtype)
    diff = (control.float() - ws.float()).abs().max().item()
    assert diff <= 0.05 * ws.float().abs().max().item(), f"the control is not the same GEMM: max diff {diff}"
    assert not torch.equal(control, ws), "a bf16 GEMM of the dequantised operands matched the fp8 kernel's bits"


@pytest.mark.parametrize("m", [1, 37, 512])
def test_baseline_runs_the_librarys_blockwise_fp8_gemm(m, monkeypatch):
    """baseline's block-FP8 GEMM on CUDA is torch._scaled_mm's blockwise kernel (1x128 activation, 128x128
    weight scales) where the weight's shape allows: values within FP8 accumulation error of the dequantised
    GEMM, K = 2816 and 1152 too (K / 128 not a multiple of 4: widened to scaled_mm_k, where the unwidened call's
    products were wrong, bench/results/linear/scaled-mm-k-blocks-h100.txt); a K the library refuses (1000) takes
    the dequantised GEMM itself, its bits exactly."""
    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops import linear_quant as LQ

    op = ExecutionSpec.default("baseline", "cuda", quant="fp8").op("linear")
    monkeypatch.setattr(LQ, "_SCALED_MM_REFUSED", {})  # each case decides afresh, at its own row count
    for n, k in ((1024, 2048), (6144, 4096), (1024, 2816), (2048, 1152), (1000, 1000)):
        gen = torch.Generator(device="cuda").manual_seed(m + n)
        x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
        qw, b = _weight(n, k, m, bias=True)
        got = LQ.FP8_GEMMS["baseline", "cuda"](op, x, x, qw, b, torch.bfloat16)
        want = LQ.dequantized_gemm(quantize(x, op.act), qw, b).to(torch.bfloat16)
        if k % 128:
            assert LQ._SCALED_MM_REFUSED[(n, k)] is not None and torch.equal(got, want)
        else:
            wide = LQ.scaled_mm_k(k)
            assert LQ._SCALED_MM_REFUSED[(n, wide)] is None, (n, k, LQ._SCALED_MM_REFUSED[(n, wide)])
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
