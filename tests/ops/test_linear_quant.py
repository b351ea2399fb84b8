"""Quantised linear layers (block-FP8 W8A8, NVFP4 W4A16 and W4A4) on the consistent CPU backend: a row's
bits do not depend on its batch (baseline, same quantisers, one library GEMM: a negative control),
quantisation really happens, the gradient is the plain linear's (straight-through), the weight cache
follows the weight's version."""
import pytest
import torch

from onepath.numerics.quant import quantize
from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT, QuantSpec, ExecutionSpec, check_same_spec
from onepath.ops import linear as L
from onepath.ops.linear_quant import fma, fp8_gemm, refresh_quantized

PRESETS = ("fp8", "nvfp4_w4a16", "nvfp4_w4a4")


def spec(preset, mode="consistent"):
    return ExecutionSpec.default(mode, "cpu", quant=preset)


def wide(rows, k, gen):
    """Gaussian values whose 16-element blocks span 2^-6..2^6: with narrow ranges the few-bit NVFP4
    products sum exactly in FP32 in any order, and the baseline could not show a difference."""
    exps = torch.randint(-6, 7, (rows, k // 16 + 1), generator=gen).repeat_interleave(16, 1)[:, :k]
    return torch.randn(rows, k, generator=gen) * 2.0 ** exps


def rows_alone_vs_batches(spec, k, gen) -> list[bool]:
    w = wide(70, k, gen) * 0.1
    b = torch.randn(70, generator=gen)
    probe = wide(1, k, gen)
    alone = L.linear(spec, probe, w, b)
    same = []
    for m in (2, 3, 15, 16, 17, 40, 100):
        batch = wide(m, k, gen)
        pos = int(torch.randint(0, m, (1,), generator=gen))
        batch[pos] = probe[0]
        same.append(torch.equal(L.linear(spec, batch, w, b)[pos:pos + 1], alone))
    return same


@pytest.mark.parametrize("preset", PRESETS)
def test_rows_alone_equal_rows_in_batches_with_negative_control(preset, gen):
    for k in (40, 200, 256):  # one short K block, a ragged tail, whole blocks
        assert all(rows_alone_vs_batches(spec(preset), k, gen)), f"{preset} K={k}"
    assert not all(rows_alone_vs_batches(spec(preset, "baseline"), 200, gen)), "baseline never differed"


@pytest.mark.parametrize("preset", PRESETS)
def test_quantisation_happens_and_stays_close(preset, gen):
    x, w = torch.randn(9, 200, generator=gen), torch.randn(33, 200, generator=gen) * 0.1
    plain = L.linear(ExecutionSpec.default("consistent", "cpu"), x, w)
    quantised = L.linear(spec(preset), x, w)
    assert not torch.equal(quantised, plain)
    rel = ((quantised - plain).norm() / plain.norm()).item()
    assert rel < (0.05 if preset == "fp8" else 0.25), rel


def test_fp8_gemm_is_the_dequantised_product_up_to_fp32_rounding(gen):
    x, w = torch.randn(6, 300, generator=gen), torch.randn(130, 300, generator=gen)
    qa, qw = quantize(x, FP8_ACT), quantize(w, FP8_WEIGHT)
    exact = qa.dequantize().double() @ qw.dequantize().double().T
    got = fp8_gemm(qa, qw).double()
    assert ((got - exact).abs() <= 4 * 2.0 ** -24 * (qa.dequantize().abs().double() @ qw.dequantize().abs().double().T)).all()


def test_fma_rounds_once(gen):
    a, b, c = torch.randn(3, 4096, generator=gen)
    got = fma(a, b * 1e-3, c * 1e-3)
    # exact products and sums of FP32 fit in float64 here; its rounding to FP32 is the reference up to
    # a double rounding, which a tie in FP64 of random data practically never meets
    assert torch.equal(got, (a.double() * (b * 1e-3).double() + (c * 1e-3).double()).float())
    assert not torch.equal(got, a * (b * 1e-3) + c * 1e-3), "mul-then-add rounded the same everywhere"


@pytest.mark.parametrize("preset", PRESETS)
def test_gradient_is_the_plain_linear_on_unquantised_operands(preset, gen):
    x = torch.randn(21, 150, generator=gen, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(30, 150, generator=gen) * 0.1)
    b = torch.nn.Parameter(torch.randn(30, generator=gen))
    g = torch.randn(21, 30, generator=gen)
    L.linear(spec(preset), x, w, b).backward(g)
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    (x2 @ w2.T + b2).backward(g)
    for got, want in zip((x.grad, w.grad, b.grad), (x2.grad, w2.grad, b2.grad)):
        torch.testing.assert_close(got, want)


def storage(q) -> list[torch.Tensor]:
    return [q.codes, q.scales] if hasattr(q, "codes") else list(q)


@pytest.mark.parametrize("preset", PRESETS)
def test_refresh_rewrites_the_cache_without_a_forward(preset, gen):
    """The engine's weights_changed: a graph replay does not pass through Python, so the cache is
    refreshed eagerly, in place; a parameter that did not change keeps its cache untouched."""
    s = spec(preset)
    layer = torch.nn.Linear(150, 30, bias=False)
    other = torch.nn.Linear(150, 30, bias=False)
    x = torch.randn(4, 150, generator=gen)
    L.linear(s, x, layer.weight), L.linear(s, x, other.weight)
    before = [t.clone() for t in storage(other.weight._quantized[1])]
    ptrs = [t.data_ptr() for t in storage(layer.weight._quantized[1])]
    new = torch.randn(30, 150, generator=gen) * 0.1
    with torch.no_grad():
        layer.weight.copy_(new)
    refresh_quantized(torch.nn.ModuleList([layer, other]))
    expected = L.linear(s, x, torch.nn.Parameter(new))  # a fresh parameter quantises `new` itself
    refreshed = storage(layer.weight._quantized[1])
    assert [t.data_ptr() for t in refreshed] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(refreshed, storage(quantize_like(new, s))))
    assert all(torch.equal(a, b) for a, b in zip(storage(other.weight._quantized[1]), before))
    assert torch.equal(L.linear(s, x, layer.weight), expected)


def test_refresh_keeps_the_baselines_widened_weight_widened(gen):
    """The baseline's CUDA FP8 weights are prepared widened for the library's GEMM (library_k): a refresh after an
    in-place update rewrites the widened copy in its own storage (a captured graph reads it), still widened: the
    new codes in the first K columns, zeros past them."""
    from onepath.ops.linear_quant import prepared_weight, scaled_mm_k, widened

    q = spec("fp8").op("linear").weight
    layer = torch.nn.Linear(384, 256, bias=False)
    first = prepared_weight(layer.weight, q, torch.float32, library_k=True)
    ptrs, old = [t.data_ptr() for t in storage(first)], first.codes.clone()
    new = torch.randn(256, 384, generator=gen) * 0.1
    with torch.no_grad():
        layer.weight.copy_(new)
    refresh_quantized(layer)
    refreshed = layer.weight._quantized[1]
    want = widened(quantize(new, q), scaled_mm_k(384))
    assert [t.data_ptr() for t in storage(refreshed)] == ptrs and refreshed.codes.shape == (256, 512)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(storage(refreshed), storage(want)))
    assert not torch.equal(old.float(), want.codes.float())  # the refresh changed the codes it holds


def quantize_like(weight, s):
    from onepath.ops.linear_quant import prepared_weight
    return prepared_weight(torch.nn.Parameter(weight.clone()), s.op("linear").weight, torch.float32)


@pytest.mark.parametrize("preset", PRESETS)
def test_weight_cache_follows_in_place_updates(preset, gen):
    s = spec(preset)
    x = torch.randn(4, 150, generator=gen)
    w = torch.nn.Parameter(torch.randn(30, 150, generator=gen) * 0.1)
    first = L.linear(s, x, w)
    cached = w._quantized
    assert torch.equal(L.linear(s, x, w), first) and w._quantized is cached
    new = torch.randn(30, 150, generator=gen) * 0.1
    with torch.no_grad():
        w.copy_(new)  # the engine's sync: bumps w._version
    assert torch.equal(L.linear(s, x, w), L.linear(s, x, new)) and w._quantized is not cached
    # rewritten in the cache's own storage: a CUDA graph captured on it reads the new weights
    assert [t.data_ptr() for t in storage(w._quantized[1])] == [t.data_ptr() for t in storage(cached[1])]
    fresh = torch.nn.Parameter(new.clone())
    fresh.quant_cache = False
    assert torch.equal(L.linear(s, x, fresh), L.linear(s, x, w)) and not hasattr(fresh, "_quantized")


def test_engine_and_trainer_with_different_quantisation_are_refused():
    check_same_spec(spec("fp8"), spec("fp8"))
    for a, b in (("fp8", "nvfp4_w4a4"), ("nvfp4_w4a16", "nvfp4_w4a4"), ("fp8", None)):
        with pytest.raises(RuntimeError, match="one numeric contract"):
            check_same_spec(spec(a), spec(b))


def test_unsupported_pairing_is_refused(gen):
    from dataclasses import replace
    s = spec("fp8")
    bad = replace(s, ops={**s.ops, "linear": replace(s.ops["linear"], act=None)})
    with pytest.raises(ValueError, match="not a supported pairing"):
        L.linear(bad, torch.randn(2, 8), torch.randn(3, 8))
    bad = replace(s, ops={**s.ops, "linear": replace(s.ops["linear"], weight=QuantSpec(block=(128, 64)))})
    with pytest.raises(ValueError, match="FP8 GEMM takes"):
        L.linear(bad, torch.randn(2, 8), torch.randn(3, 8))


@pytest.mark.parametrize("preset", PRESETS)
def test_leading_dims_and_no_rows(preset, gen):
    x, w = torch.randn(2, 3, 40, generator=gen), torch.randn(20, 40, generator=gen)
    y = L.linear(spec(preset), x, w)
    assert y.shape == (2, 3, 20) and torch.equal(y.reshape(6, 20), L.linear(spec(preset), x.reshape(6, 40), w))
    assert L.linear(spec(preset), x[:0].reshape(0, 40), w).shape == (0, 20)


def test_baselines_library_fp8_call_pads_rows_and_keeps_the_librarys_refusal(monkeypatch):
    """The baseline's CUDA block-FP8 linear as it calls torch._scaled_mm, on the CPU with a stand-in for the
    library that checks the layout it is given (rows a multiple of SCALED_MM_ROWS, 1x128 activation scales
    outer-dim major, 128x128 weight scales whose columns start 16-byte aligned: K/128 a multiple of 4, where the
    H100's library gave wrong products otherwise) and multiplies the dequantised operands: every batch size's rows
    come back unpadded and equal to the unwidened product, K = 384 widened to 512 (the weight as given, or prepared
    widened once); K = 1000 (a partial scale block) refused by the library; a refusal, or products off the
    dequantised GEMM's at a shape's first call, is kept with its reason and the dequantised GEMM answers instead."""
    import sys
    import types

    import onepath.ops.linear_quant as LQ
    from onepath.numerics.quant import quantize
    from onepath.numerics.spec import ExecutionSpec

    op = ExecutionSpec.default("baseline", "cuda", quant="fp8").op("linear")
    fake = types.ModuleType("onepath.ops.cuda.quant")
    fake.quantize_fp8 = lambda x, spec: quantize(x, spec)
    monkeypatch.setitem(sys.modules, "onepath.ops.cuda.quant", fake)
    monkeypatch.setattr(LQ, "_SCALED_MM_REFUSED", {})
    calls = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        m, k = a.shape
        if k % 128:  # as the library: its scale blocks are whole 128-wide blocks of K
            raise RuntimeError(f"Invalid scaling configuration: K {k}")
        assert m % LQ.SCALED_MM_ROWS == 0 and scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m)
        assert scale_b.shape == (k // 128, b.shape[1] // 128) and scale_b.stride() == (1, k // 128)
        assert (k // 128) % 4 == 0, f"K {k}: the weight scales' columns would not start 16-byte aligned"
        calls.append((m, k))
        wide_a = a.float() * scale_a.repeat_interleave(128, 1)
        wide_b = b.float() * scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)
        return (wide_a @ wide_b).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    assert [LQ.scaled_mm_k(k) for k in (384, 512, 1000, 1152, 1536, 2816)] == [512, 512, 1000, 1536, 1536, 3072]
    gen = torch.Generator().manual_seed(3)
    for k in (384, 512):
        w = torch.randn(256, k, generator=gen)
        qw = quantize(w, op.weight)
        prepared = LQ.prepared_weight(torch.nn.Parameter(w.clone()), op.weight, torch.float32, library_k=True)
        assert prepared.codes.shape == (256, 512) and prepared.scales.shape == (2, 4)
        assert not prepared.codes[:, k:].float().any() and torch.equal(prepared.codes[:, :k].float(), qw.codes.float())
        for m in (1, 37, 48):
            x = torch.randn(m, k, generator=gen)
            qa = quantize(x, op.act)
            want = LQ.dequantized_gemm(qa, qw).float()
            for weight in (qw, prepared):
                got = LQ.fp8_library_cuda(op, x, x, weight, None, torch.float32)
                assert got.shape == (m, 256) and LQ._SCALED_MM_REFUSED[(256, 512)] is None
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # m = 1, 37, 48 padded to whole multiples of SCALED_MM_ROWS, K = 384 widened to 512
    assert calls == [(m, 512) for m in (16, 16, 48, 48, 48, 48)] * 2

    # a K that is not a multiple of 128 (the last scale block partial) is the library's to refuse: the dequantised GEMM
    qw4 = quantize(torch.randn(64, 1000, generator=gen), op.weight)
    for m in (1, 37):
        x = torch.randn(m, 1000, generator=gen)
        got = LQ.fp8_library_cuda(op, x, x, qw4, None, torch.float32)
        assert torch.equal(got, LQ.dequantized_gemm(quantize(x, op.act), qw4).float())
    assert LQ._SCALED_MM_REFUSED[(64, 1000)] == "RuntimeError: Invalid scaling configuration: K 1000"

    # a shape whose first product the library gets wrong is refused by the first call's check: the dequantised GEMM
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kwargs: scaled_mm(*args, **kwargs) * 1.5)
    qw3 = quantize(torch.randn(384, 512, generator=gen), op.weight)
    zeros = torch.zeros(2, 512)  # a zero product tells nothing: the shape stays undecided
    assert not LQ.fp8_library_cuda(op, zeros, zeros, qw3, None, torch.float32).any()
    assert (384, 512) not in LQ._SCALED_MM_REFUSED
    x = torch.randn(3, 512, generator=gen)
    got = LQ.fp8_library_cuda(op, x, x, qw3, None, torch.float32)
    assert torch.equal(got, LQ.dequantized_gemm(quantize(x, op.act), qw3).float())
    assert LQ._SCALED_MM_REFUSED[(384, 512)].startswith("wrong products: max |difference| 0.5")

    def refuse(*args, **kwargs):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nmore")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    qw2 = quantize(torch.randn(128, 256, generator=gen), op.weight)
    x = torch.randn(5, 256, generator=gen)
    got = LQ.fp8_library_cuda(op, x, x, qw2, None, torch.float32)
    assert torch.equal(got, LQ.dequantized_gemm(quantize(x, op.act), qw2).float())
    assert LQ._SCALED_MM_REFUSED[(128, 512)] == "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul"
