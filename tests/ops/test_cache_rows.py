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


@pytest.mark.parametrize("quant", [None, "fp8_kv"])
def test_a_staged_row_reads_the_bits_it_has_once_copied_into_a_ring(quant, gen):
    """stage() stores a forward's rows as a write would (FP8 by the KV rule); read() takes a position from the stage
    where `rows` points into it, from the cache elsewhere; copy() moves staged rows into the cache as stored. A row
    read from the stage and read back from the ring after the copy has the same bits; with no cache (a forward of
    whole sequences) the stage alone is read."""
    spec = ExecutionSpec.default(quant=quant)
    plain, fp8 = caches(8, blocks=2, block=3)
    ring = fp8 if quant else plain
    x = torch.randn(5, 1, 8, generator=gen) * 3
    staged = cache_rows.stage(spec, x, quantised=quant is not None)
    rows = torch.tensor([[4, -1, 0], [2, 3, -1]])
    from_stage = cache_rows.read(spec, ring, torch.full_like(rows, -1), torch.float32, staged=staged, rows=rows)
    cache_rows.copy(ring, torch.tensor([5, 0, 2, 3]), staged, torch.tensor([4, 0, 2, 3]))
    slots = torch.tensor([[5, -1, 0], [2, 3, -1]])
    from_ring = cache_rows.read(spec, ring, slots, torch.float32)
    assert torch.equal(from_stage, from_ring)
    assert torch.equal(from_stage[0, 1], torch.zeros(1, 8))
    alone = cache_rows.read(spec, None, torch.full_like(rows, -1), torch.float32, staged=staged, rows=rows)
    assert torch.equal(alone, from_stage)
    mixed = cache_rows.read(spec, ring, torch.tensor([[5, 0, -1]]), torch.float32, staged=staged,
                            rows=torch.tensor([[-1, -1, 1]]))
    row1 = cache_rows.read(spec, None, torch.tensor([-1]), torch.float32, staged=staged, rows=torch.tensor([1]))
    assert torch.equal(mixed[0, :2], from_ring[0, [0, 2]]) and torch.equal(mixed[0, 2], row1[0])
    if quant:  # the FP8 round trip is real
        assert not torch.equal(from_stage[0, 0], x[4])
    else:
        assert torch.equal(from_stage[0, 0], x[4])
