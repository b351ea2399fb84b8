"""linear_fp8's pick between its two kernels (ops/cuda/linear_fp8.py, pick_kernel): the warp-specialized
Gluon kernel from WS_MIN_ROWS rows on, on Hopper (capability 9.0 exactly), not interpreted, with rows TMA
reads and writes in place; the Triton tiles everywhere else. The pick may follow M only because both
kernels give the same bits (tests/ops/test_linear_fp8_gpu.py); here, without a GPU, that it never
hands the Gluon kernel a case it cannot take or would copy for.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from onepath.ops.cuda import linear_fp8 as mm  # noqa: E402
from onepath.ops.cuda.linear import TileConfig  # noqa: E402

CUDA = torch.device("cuda", 0)
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture
def hopper(monkeypatch):
    """pick_kernel as on an H200 (132 SMs), outside the interpreter."""
    monkeypatch.setattr(mm, "is_hopper", lambda device: device.type == "cuda")
    monkeypatch.setattr(mm, "sm_count", lambda device: 132)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_gluon_from_ws_min_rows_on_and_its_decode_layout_below(hopper, out_dtype):
    for m in (mm.WS_MIN_ROWS, 777, 4100):
        for n, k in ((6152, 4096), (200, 208), (2048, 2048)):
            assert mm.pick_kernel(m, n, k, out_dtype, CUDA) == mm.WS_CONFIG, (m, n, k, out_dtype)
    for m in (1, 37, mm.WS_MIN_ROWS - 1):
        assert mm.pick_kernel(m, 6152, 4096, out_dtype, CUDA) == mm.DECODE_WS_CONFIG, m


@pytest.mark.parametrize("n,k,out_dtype", [
    (2048, 1000, torch.bfloat16),  # codes rows of 1000 bytes: TMA would read a padded copy of A and W
    (2048, 2060, torch.float32),
    (1001, 2048, torch.bfloat16),  # output rows of 2002 bytes: stored through a padded buffer and a copy
    (1002, 2048, torch.float32),
    (2048, 2048, torch.float64),  # no epilogue for it
])
def test_triton_where_the_gluon_kernel_would_copy_or_cannot_store(hopper, n, k, out_dtype):
    assert isinstance(mm.pick_kernel(4096, n, k, out_dtype, CUDA), TileConfig)
    assert isinstance(mm.pick_kernel(64, n, k, out_dtype, CUDA), TileConfig)


def test_triton_on_cpu_under_the_interpreter_and_off_hopper(hopper, monkeypatch):
    assert isinstance(mm.pick_kernel(4096, 2048, 2048, torch.bfloat16, torch.device("cpu")), TileConfig)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(mm.pick_kernel(4096, 2048, 2048, torch.bfloat16, CUDA), TileConfig)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(mm, "is_hopper", lambda device: False)
    assert isinstance(mm.pick_kernel(4096, 2048, 2048, torch.bfloat16, CUDA), TileConfig)


@pytest.mark.parametrize("capability,want", [((9, 0), True), ((10, 0), False), ((12, 0), False), ((8, 9), False)])
def test_is_hopper_means_capability_9_0_exactly(monkeypatch, capability, want):
    """wgmma and setmaxnreg are sm_90a's: Blackwell (10.x, 12.x) and Ada (8.9) take the Triton kernel."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert mm.is_hopper.__wrapped__(CUDA) is want
    assert mm.is_hopper.__wrapped__(torch.device("cpu")) is False


def test_linear_fp8_runs_the_picked_or_the_given_kernel(hopper, monkeypatch):
    """The default follows pick_kernel; config= forces a Triton tile or the Gluon kernel (launches recorded,
    not run); empty inputs launch nothing."""
    from onepath.numerics.quant import FP8Tensor, quantize
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT

    ran = []
    monkeypatch.setattr(mm, "is_hopper", lambda device: True)
    monkeypatch.setattr(mm, "linear_fp8_ws", lambda qa, qw, bias, out_dtype, config: ran.append(str(config)))

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kw: ran.append(f"triton {kw['BLOCK_M']}x{kw['BLOCK_N']}")

    monkeypatch.setattr(mm, "_linear_fp8_kernel", Launch())
    gen = torch.Generator().manual_seed(0)
    qa = quantize(torch.randn(mm.WS_MIN_ROWS, 256, generator=gen), FP8_ACT)
    qw = quantize(torch.randn(2048, 256, generator=gen) * 0.05, FP8_WEIGHT)
    row = FP8Tensor(qa.codes[:1], qa.scales[:1], qa.block)
    mm.linear_fp8(qa, qw)
    mm.linear_fp8(row, qw)
    mm.linear_fp8(qa, qw, config=mm.TILES_FP8[0])
    mm.linear_fp8(row, qw, config=mm.WS_CONFIG)
    tile = f"triton {mm.TILES_FP8[0].block_m}x{mm.TILES_FP8[0].block_n}"
    assert ran == [str(mm.WS_CONFIG), str(mm.DECODE_WS_CONFIG), tile, str(mm.WS_CONFIG)]
    empty = mm.linear_fp8(FP8Tensor(qa.codes[:, :0], qa.scales[:, :0], qa.block), FP8Tensor(
        qw.codes[:, :0], qw.scales[:, :0], qw.block), torch.ones(2048), torch.float32)
    assert len(ran) == 4 and torch.equal(empty, torch.ones(mm.WS_MIN_ROWS, 2048))


def test_ws_tma_scales_keeps_the_quantisers_layout_and_copies_any_other():
    """The ws kernel's TMA reads sa [M, G] by column from 16-byte aligned columns: the layout the quantisers write
    (quant_rows.scales_by_column) passes as is; a row-major one (the CPU reference quantiser's) is copied into it,
    values unchanged."""
    from onepath.ops.cuda.quant_rows import scales_by_column as allocate
    from onepath.ops.cuda.linear_fp8_ws import tma_scales

    gen = torch.Generator().manual_seed(0)
    for m, g in [(1, 1), (1, 3), (5, 1), (5, 3), (37, 9), (64, 32)]:
        rows = torch.randn(m, g, generator=gen)
        copied = tma_scales(rows)
        assert torch.equal(copied, rows)
        assert copied.stride(0) == 1 and copied.stride(1) % 4 == 0 and copied.stride(1) >= m, copied.stride()
        # row-major columns start one float apart, not 16 bytes: copied, unless there is one column
        assert (copied.data_ptr() == rows.data_ptr()) == (g == 1), (m, g)
        written = allocate(m, g, "cpu").copy_(rows)
        assert tma_scales(written).data_ptr() == written.data_ptr()
        # as the quantiser returns them reshaped: a size-1 dimension may come with any stride, still no copy
        reshaped = written.reshape(1, m, g)[0] if m > 1 else written.reshape(m, g)
        assert tma_scales(reshaped).data_ptr() == written.data_ptr()
