import pytest

from onepath.engine.block_manager import BlockManager
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.sequence import Sequence


def make_seq(request_id, n):
    return Sequence(request_id, list(range(n)), SamplingParams())


def test_blocks_needed_counts_only_extra_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq(0, 9)
    assert bm.blocks_needed(seq, 9) == 3
    bm.allocate(seq, 5)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 5
    assert bm.blocks_needed(seq, 3) == 0  # 8 tokens fit in the 2 blocks held
    assert bm.blocks_needed(seq, 4) == 1


def test_allocation_is_fifo_and_deterministic():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = make_seq(0, 3), make_seq(1, 5)
    bm.allocate(a, 3)
    bm.allocate(b, 5)
    assert a.block_table == [0, 1] and b.block_table == [2, 3, 4]
    bm.free(a)
    assert a.block_table == [] and list(bm.free_block_ids) == [5, 1, 0]


def test_slot_mapping():
    bm = BlockManager(num_blocks=8, block_size=4)
    filler, seq = make_seq(0, 4), make_seq(1, 10)
    bm.allocate(filler, 4)
    bm.allocate(seq, 10)
    assert seq.block_table == [1, 2, 3]
    assert [bm.slot(seq, p) for p in range(10)] == list(range(4, 14))
    seq.block_table = [5, 0, 7]
    assert [bm.slot(seq, p) for p in range(10)] == [20, 21, 22, 23, 0, 1, 2, 3, 28, 29]


def test_no_leak_after_free():
    bm = BlockManager(num_blocks=16, block_size=3)
    seqs = [make_seq(i, 2 + 3 * i) for i in range(5)]
    for s in seqs:
        assert bm.can_allocate(s, s.num_tokens)
        bm.allocate(s, s.num_tokens)
    used = [b for s in seqs for b in s.block_table]
    assert len(used) == len(set(used)) == 16 - bm.num_free_blocks
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == 16 and not bm.used_block_ids


def test_allocate_refuses_past_capacity():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(7, 9)
    assert not bm.can_allocate(seq, 9)
    with pytest.raises(RuntimeError, match="request 7 needs 3 more KV blocks"):
        bm.allocate(seq, 9)
    assert bm.num_free_blocks == 2 and seq.block_table == []


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(0, 4)
    bm.allocate(seq, 4)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(KeyError):
        bm.free(seq)


@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (4, 0)])
def test_bad_sizes_name_the_value(num_blocks, block_size):
    with pytest.raises(ValueError, match=r"\b0 must be >= 1"):
        BlockManager(num_blocks, block_size)
