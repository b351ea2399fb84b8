"""cache_rows: rows written to a paged cache come back from any slots (FP8 by the KV rule), -1 slots as exact zeros,
and a read's gradient reaches this forward's rows (straight through the quantisation)."""
import pytest
import torch

from onepath.numerics.quant import FP8Tensor, quantize_fp8
from onepath.numerics.spec import FP8_KV, ExecutionSpec
from onepath.ops import cache_rows


def caches(width, blocks=5, block=4):
    plain = torch.zeros(blocks, block, 1, width)
    fp8 = FP8Tensor(torch.zeros(blocks, block, 1, width, dtype=torch.float8_e4m3fn), torch.zeros(blocks, block, 1, 1),
                    (1, width), FP8_KV)
    return plain, fp8


def test_write_then_read_any_slots(consistent, gen):
    plain, fp8 = caches(8)
    rows = torch.randn(6, 1, 8, generator=gen)
    slots = torch.tensor([17, 2, 9, 0, 11, 5])
    cache_rows.write(consistent, plain, slots, rows)
    read = torch.tensor([[9, -1, 17], [5, 0, -1]])
    got = cache_rows.read(consistent, plain, read, torch.float32)
    assert torch.equal(got[0, 0], rows[2]) and torch.equal(got[1, 1], rows[3])
    assert torch.equal(got[0, 1], torch.zeros(1, 8)) and torch.equal(got[1, 2], torch.zeros(1, 8))
    fp8_spec = ExecutionSpec.default(quant="fp8_kv")
    cache_rows.write(fp8_spec, fp8, slots, rows)
    want = quantize_fp8(rows, FP8_KV).dequantize()
    assert torch.equal(cache_rows.read(fp8_spec, fp8, slots[None], torch.float32)[0], want)
    with pytest.raises(TypeError, match="FP8 cache under a spec without attention.kv"):
        cache_rows.write(consistent, fp8, slots, rows)


def test_read_gradient_reaches_the_fresh_rows(consistent, gen):
    plain, _ = caches(3)
    fresh = torch.randn(4, 1, 3, generator=gen, requires_grad=True)
    slots = torch.tensor([3, 8, 1, 6])
    cache_rows.write(consistent, plain, slots, fresh)
    picks = torch.tensor([[2, 0, -1], [3, 3, 1]])
    got = cache_rows.read(consistent, plain, slots[picks.clamp(min=0)].masked_fill(picks < 0, -1), torch.float32,
                          fresh, picks)
    (got * torch.arange(1.0, 7.0).view(2, 3, 1, 1)).sum().backward()
    assert fresh.grad[:, 0, 0].tolist() == [2.0, 6.0, 1.0, 9.0]
    with pytest.raises(RuntimeError, match="whole sequences"):
        cache_rows.read(consistent, plain, slots[None], torch.float32, fresh, torch.tensor([[0, 1, -1, 3]]))
