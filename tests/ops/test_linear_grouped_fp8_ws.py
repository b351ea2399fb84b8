"""onepath/ops/cuda/linear_grouped_fp8_ws.py on the CPU: its tile map (pure torch) and its kernel's sm_90 builds.

The tile map: on random counts with empty groups and groups of 1, 127, 128, 129 rows, every row of every group
is stored by exactly one tile of that group, every tile starts at a multiple of 4 rows (the FP32 scales' TMA box:
an unaligned innermost coordinate is an illegal instruction on the GPU), the real tiles come first (their count
in the map's head) and the rest are marked (-1, 0, 0, 0); device counts (their sum unknown on the host, rows past
it) give the list's map followed by marked entries; max_m_tiles bounds the real tiles of any counts summing to at
most M. Negative control: the map without the alignment (tiles from each group's first row) fails the check.
The builds (linear_fp8_ws's grouped kernel, compiled for sm_90 with ptxas from the launcher's own arguments, CPU
tensors standing in): the dense kernel's checks (tests/ops/test_linear_fp8_ws.py: the Triton kernel's fp8 wgmma
chains, FMA promotion, setmaxnreg partitions, three TMA loads a stage, wait1 kept, no spills, shared memory), no
TMA store, and the epilogue's masked gl.store vectorized to 16 bytes where N is a multiple of 16. Negative
control: the dense kernel's build fails the grouped epilogue's checks. The bits are
tests/ops/test_linear_grouped_fp8_gpu.py's (Gluon is not interpreted).
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from onepath.ops.cuda.linear_grouped_fp8_ws import ENTRY, max_m_tiles, tile_map

COUNTS = [0, 1, 127, 0, 128, 129, 300, 0, 5, 0]


def _entries(tiles: torch.Tensor):
    return int(tiles[0]), tiles[1:].view(-1, ENTRY)


def _stored(counts: list[int], tiles: torch.Tensor, block_m: int):
    """(row -> group of the tile storing it, -1 if none; times each row is stored) from the real tiles: a tile
    stores its rows inside its group's [begin, end)."""
    real, entries = _entries(tiles)
    total = sum(counts)
    group_of, times = torch.full((total,), -1), torch.zeros(total, dtype=torch.long)
    for g, first, begin, end in entries[:real].tolist():
        assert 0 <= first < end <= total and begin - 4 < first and begin < end, (g, first, begin, end)
        rows = torch.arange(max(first, begin), min(first + block_m, end))
        group_of[rows] = g
        times[rows] += 1
    return group_of, times


def _misaligned(tiles: torch.Tensor) -> list[int]:
    """The real tiles' first rows whose scales' box would start inside a 16-byte unit."""
    real, entries = _entries(tiles)
    return [first for first in entries[:real, 1].tolist() if first * 4 % 16]


@pytest.mark.parametrize("block_m", [128, 64])
@pytest.mark.parametrize("seed", range(4))
def test_every_row_of_every_group_is_covered_once_by_a_tile_of_its_group(seed, block_m):
    gen = torch.Generator().manual_seed(seed)
    counts = COUNTS if seed == 0 else [int(c) if c % 3 else 0 for c in torch.randint(0, 400, (17,), generator=gen)]
    tiles = tile_map(counts, sum(counts), block_m, "cpu")
    group_of, times = _stored(counts, tiles, block_m)
    assert torch.equal(times, torch.ones_like(times)), "rows stored other than once"
    assert torch.equal(group_of, torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)))
    assert not _misaligned(tiles)
    real, entries = _entries(tiles)
    starts = torch.tensor([0, *counts]).cumsum(0)
    assert real == entries.shape[0] == sum(-(-(c + int(starts[g]) % 4) // block_m) for g, c in enumerate(counts) if c)
    # each tile starts block_m rows after the last in its group, at the group's first row rounded down to 4 otherwise
    for (g, first, begin, end), prev in zip(entries.tolist(), [None, *entries.tolist()]):
        assert (begin, end) == (starts[g], starts[g + 1])
        assert first == starts[g] - starts[g] % 4 or (prev[0] == g and first == prev[1] + block_m)


def test_negative_control_tiles_from_each_groups_first_row_are_misaligned():
    """The map as it was (a group's tiles from its first row) on the counts that faulted on the GPU: the group of
    127 rows starts at row 1, so its scales' box would start 4 bytes into a 16-byte unit."""
    counts = [0, 1, 127, 128, 129, 300, 0]
    starts = torch.tensor([0, *counts]).cumsum(0)
    entries = [[g, int(starts[g]) + 128 * t, int(starts[g]), int(starts[g + 1])]
               for g, c in enumerate(counts) for t in range(-(-c // 128))]
    old = torch.tensor([len(entries), *sum(entries, [])], dtype=torch.int32)
    assert _misaligned(old) == [1, 385, 513, 641]
    assert not _misaligned(tile_map(counts, sum(counts), 128, "cpu"))


def test_device_counts_give_the_lists_map_then_marked_entries():
    """A counts tensor (the dispatch's, int64) over M rows, more than they sum to: the map's length is
    max_m_tiles(M, G), its real tiles the list's, the rest (-1, 0, 0)."""
    m = sum(COUNTS) + 77
    listed = tile_map(COUNTS, sum(COUNTS), 128, "cpu")
    on_device = tile_map(torch.tensor(COUNTS), m, 128)
    real, entries = _entries(on_device)
    assert entries.shape[0] == max_m_tiles(m, len(COUNTS), 128) > real
    assert torch.equal(on_device[:listed.shape[0]], listed)
    assert torch.equal(entries[real:], torch.tensor([-1, 0, 0, 0]).expand(entries.shape[0] - real, ENTRY))
    assert torch.equal(tile_map(torch.tensor(COUNTS, dtype=torch.int32), m, 128), on_device)


def test_empty_groups_and_no_rows():
    """Every group empty (device counts: the sum is not known): no real tile, every entry marked; empty groups
    before, between and after others are passed over."""
    tiles = tile_map(torch.zeros(6, dtype=torch.long), 300, 128)
    real, entries = _entries(tiles)
    assert real == 0 and (entries[:, 0] == -1).all() and (entries[:, 1:] == 0).all()
    counts = [0, 0, 3, 0, 0, 200, 0]
    real, entries = _entries(tile_map(counts, 203, 128, "cpu"))
    assert entries.tolist() == [[2, 0, 0, 3], [5, 0, 3, 203], [5, 128, 3, 203]] and real == 3
    # a group starting at a multiple of 4 keeps its first row
    real, entries = _entries(tile_map([4, 130], 134, 128, "cpu"))
    assert entries.tolist() == [[0, 0, 0, 4], [1, 4, 4, 134], [1, 132, 4, 134]] and real == 3


def test_max_m_tiles_bounds_any_counts():
    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        groups, m = int(torch.randint(1, 20, (1,), generator=gen)), int(torch.randint(1, 700, (1,), generator=gen))
        cuts = torch.randint(0, m + 1, (groups - 1,), generator=gen).sort().values
        counts = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.randint(0, m + 1, (1,), generator=gen)]))
        counts = counts.clamp(min=0)
        for block_m in (64, 128):
            starts = counts.cumsum(0) - counts
            real = int(torch.where(counts > 0, (counts + starts % 4 + block_m - 1) // block_m, 0).sum())
            assert real <= max_m_tiles(m, groups, block_m), (counts.tolist(), m)
            assert int(tile_map(counts, m, block_m)[0]) == real


def test_pick_takes_the_warp_specialized_kernel_from_128_rows_a_group_on_hopper(monkeypatch):
    from onepath.ops.cuda import linear_grouped_fp8 as gm

    cpu = torch.device("cpu")
    assert gm.pick_grouped_kernel(128 * 128, 128, 2048, torch.bfloat16, cpu) is None  # not Hopper
    monkeypatch.setattr(gm, "is_hopper", lambda device: True)
    monkeypatch.setattr(gm, "interpreting", lambda: False)
    assert gm.GROUPED_WS_BY_DEFAULT  # on since it passed and was timed on a GPU
    assert gm.pick_grouped_kernel(128 * 128, 128, 2048, torch.bfloat16, cpu) == gm.GROUPED_WS_CONFIG
    assert gm.pick_grouped_kernel(8192 * 8, 128, 768, torch.float32, cpu) == gm.GROUPED_WS_CONFIG
    assert gm.pick_grouped_kernel(256 * 8, 128, 2048, torch.bfloat16, cpu) is None  # decode: the Triton tiles
    assert gm.pick_grouped_kernel(128 * 128, 128, 200, torch.bfloat16, cpu) is None  # K rows not 16-byte multiples
    monkeypatch.setattr(gm, "interpreting", lambda: True)
    assert gm.pick_grouped_kernel(128 * 128, 128, 2048, torch.bfloat16, cpu) is None
    monkeypatch.setattr(gm, "interpreting", lambda: False)
    monkeypatch.setattr(gm, "GROUPED_WS_BY_DEFAULT", False)
    assert gm.pick_grouped_kernel(128 * 128, 128, 2048, torch.bfloat16, cpu) is None


# ---- sm_90 builds ----------------------------------------------------------------------------------------------

def _grouped_build(v, counts, n, k, out_dtype):
    from onepath.numerics.quant import FP8Tensor, quantize
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT
    from onepath.ops.cuda.linear_fp8_ws import grouped_fp8_gemm_ws_kernel
    from onepath.ops.cuda.linear_grouped_fp8_ws import launch_args
    from tests.ops.test_linear_fp8_ws import _compile_like_jit

    gen = torch.Generator().manual_seed(0)
    m = sum(counts)
    qa = quantize(torch.randn(m, k, generator=gen), FP8_ACT)
    parts = [quantize(torch.randn(n, k, generator=gen) * 0.05, FP8_WEIGHT) for _ in counts]
    qw = FP8Tensor(torch.stack([p.codes for p in parts]), torch.stack([p.scales for p in parts]), parts[0].block,
                   parts[0].rule)
    _, args, consts = launch_args(qa, qw, tile_map(counts, m, v.block_m, "cpu"), torch.empty(m, n, dtype=out_dtype), v)
    return _compile_like_jit(grouped_fp8_gemm_ws_kernel, args, dict(consts, num_warps=4))


def _epilogue_problems(ptx: str, sass: str, vectorized: bool) -> list[str]:
    stores = re.findall(r"st\.global\.(\S+)", ptx)
    checks = {
        "no TMA store (it would write the next group's rows)": "cp.async.bulk.tensor.2d.global.shared::cta" not in ptx,
        "masked gl.store of the tile": bool(stores) and "STG" in sass,
        "the stores 16 bytes a thread": not vectorized or (stores and set(stores) == {"v4.b32"}),
    }
    return [name for name, ok in checks.items() if not ok]


def _configs():
    from onepath.ops.cuda.linear_fp8 import DECODE_WS_CONFIG
    from onepath.ops.cuda.linear_fp8_ws import WSConfig
    from onepath.ops.cuda.linear_grouped_fp8 import GROUPED_WS_CONFIG
    return [GROUPED_WS_CONFIG, DECODE_WS_CONFIG, WSConfig(256, 4)]


SHAPES = {"gate_up": (1536, 2048, torch.bfloat16), "down_fp32": (2048, 768, torch.float32),
          "awkward": (200, 1000, torch.float32)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("v", _configs(), ids=str)
def test_grouped_kernel_builds_for_sm90_with_the_dense_kernels_pipeline_and_a_masked_store(v, shape):
    pytest.importorskip("triton.backends.nvidia")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: Gluon kernels are compiled, not interpreted")
    from tests.ops.test_linear_fp8_ws import _problems

    n, k, out_dtype = SHAPES[shape]
    compiled = _grouped_build(v, [100, 0, 300, 37], n, k, out_dtype)
    ptx, sass = compiled.asm["ptx"], compiled.asm["sass"]
    problems = [p for p in _problems(v, ptx, sass, compiled.metadata.shared) if p != "TMA stores"]
    problems += _epilogue_problems(ptx, sass, vectorized=n % 16 == 0)
    assert not problems, f"{v} {shape}: {problems}"


def test_negative_control_the_dense_build_fails_the_grouped_epilogue_checks():
    pytest.importorskip("triton.backends.nvidia")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: Gluon kernels are compiled, not interpreted")
    from onepath.ops.cuda.linear_grouped_fp8 import GROUPED_WS_CONFIG
    from tests.ops.test_linear_fp8_ws import _build

    dense = _build(GROUPED_WS_CONFIG)
    assert set(_epilogue_problems(dense.asm["ptx"], dense.asm["sass"], True)) == {
        "no TMA store (it would write the next group's rows)", "masked gl.store of the tile",
        "the stores 16 bytes a thread"}
    awkward = _grouped_build(GROUPED_WS_CONFIG, [100, 0, 300, 37], 200, 1000, torch.bfloat16)
    assert _epilogue_problems(awkward.asm["ptx"], awkward.asm["sass"], True) == ["the stores 16 bytes a thread"]
