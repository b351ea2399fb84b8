"""bench/kernels_linear.py's decode sweep: the tile names --configs accepts and refuses, and the grid it builds
(the timing is GPU-only)."""
import argparse

import pytest

from onepath.bench.kernels_linear import DECODE_SWEEP, SHARED_BYTES, decode_cases, decode_configs, decode_shapes, parse_tile
from onepath.ops.cuda.linear import TileConfig


def test_tile_names_map_to_configs():
    assert parse_tile("128x256x64w8s4T") == TileConfig(128, 256, 8, 4, tma=True, block_k=64)
    assert parse_tile("16x32x256w2s4P") == TileConfig(16, 32, 2, 4, tma=False, block_k=256)
    assert parse_tile("16x64x256w4s4TS") == TileConfig(16, 64, 4, 4, tma=True, block_k=256, swap=True)


@pytest.mark.parametrize("name", ["128x256w8s4T", "128x256x64w8s4", "128x256x64w8s4X", "axbxcw1s1T"])
def test_a_bad_tile_name_says_the_form(name):
    with pytest.raises(argparse.ArgumentTypeError, match="expected e.g. 128x256x64w8s4T"):
        parse_tile(name)


def test_the_grid_follows_m_and_fits_shared_memory():
    skinny, wide = decode_configs(1), decode_configs(256)
    assert {c.block_m for c in skinny} == {16, 64} and {c.block_m for c in wide} == {64, 128}
    assert {c.block_k for c in skinny} == {64, 128, 256, 512}
    for c in (*skinny, *wide):
        assert c.pipeline_bytes() <= SHARED_BYTES, c
    assert sum(c.tma for c in wide) * 2 == len(wide), "each tile with pointer and TMA loads"


def test_shapes_and_ms_narrow_the_sweep():
    args = argparse.Namespace(ms=[1, 16], shapes=["square", "o_proj 2048->1024"], configs=None)
    shapes = decode_shapes(args)
    assert [(s[0], s[4]) for s in shapes] == [("square 4096x4096", (1, 16)), ("qwen3 o_proj 2048->1024", (1, 16))]
    fixed = [parse_tile("64x128x128w4s4T")]
    everywhere = decode_shapes(argparse.Namespace(ms=[128, 4096], shapes=None, configs=fixed))
    assert len(everywhere) == len(DECODE_SWEEP) and all(s[4] == (128, 4096) for s in everywhere)
    assert len(decode_cases(everywhere, fixed)) == 2 * len(DECODE_SWEEP)


def test_k_step_summary_compares_the_same_tile_only():
    from onepath.bench.kernels_linear import k_step_summary

    def entry(m, bn, bk, us, bm=64, tma=True):
        return dict(shape="s", M=m, us=us, config=dict(block_m=bm, block_n=bn, num_warps=4, tma=tma, block_k=bk))
    sweep = [entry(256, 32, 64, 3.0), entry(256, 32, 128, 2.0), entry(256, 32, 256, 1.5),  # 2.0x
             entry(256, 64, 64, 1.0), entry(256, 64, 128, 1.0),                              # 1.0x
             entry(256, 128, 64, 9.0),                                                        # no deeper step
             entry(256, 32, 128, 0.1, tma=False), entry(256, 32, 256, 0.1, bm=16),          # other tiles
             entry(1, 32, 64, 1.2), entry(1, 32, 256, 1.0)]                                   # 1.2x
    summary = k_step_summary(sweep)
    assert summary["m_gt_16"] == dict(cases=2, median=1.5, min=1.0, max=2.0)
    assert summary["m_le_16"]["cases"] == 1 and abs(summary["m_le_16"]["median"] - 1.2) < 1e-12


def test_rank_picks_reads_later_sweeps_over_earlier_ones(tmp_path):
    """A case counts only where every tile a rule may take was timed; a later file's case replaces an earlier
    one's whole; each rule's tile is timed against the best."""
    import dataclasses
    import json

    import torch

    from onepath.bench.kernels_linear import rank_picks
    from onepath.ops.cuda.linear import DENSE_TILES, SMALL_TILES, dense_candidates, pick_config

    def sweep(path, cases):
        entries = [dict(shape="s", K=4096, N=n, M=m, config=dataclasses.asdict(c), us=us_of(c))
                   for m, n, us_of in cases for c in {*DENSE_TILES, *dense_candidates(m), *SMALL_TILES}]
        path.write_text(json.dumps(dict(sweep=entries)))
        return path

    wide = pick_config(256, 11008, torch.bfloat16, 132)
    small = pick_config(32, 4096, torch.bfloat16, 132)
    assert small in SMALL_TILES
    early = sweep(tmp_path / "early.json", [(256, 11008, lambda c: 1.0)])
    late = sweep(tmp_path / "late.json", [(256, 11008, lambda c: 1.0 if c == wide else 2.0),
                                          (32, 4096, lambda c: 1.0 if c == small else 1.5)])
    result = rank_picks([early, late])
    by_m = {row["M"]: row for row in result["rows"]}
    assert by_m[256]["source"] == "late.json" and by_m[256]["pick_vs_best"] == 1.0
    assert by_m[256]["half_sms"] != by_m[256]["pick"] and by_m[256]["half_sms_vs_best"] == 2.0, \
        "the half-the-SMs rule picked 128x256 here"
    assert by_m[32]["pick_vs_best"] == 1.0 and by_m[32]["dense_model_vs_best"] == 1.5, "M = 32 took a 64-row tile before"
    assert result["summary"]["M <= 32"]["cases"] == 1
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(dict(sweep=[e for e in json.loads(late.read_text())["sweep"]
                                              if e["M"] == 256 and e["config"] != dataclasses.asdict(wide)])))
    with pytest.raises(ValueError):  # no case left to rank: every tile a rule may take is needed
        rank_picks([partial])


def test_paired_timing_runs_ours_cublas_cublas_ours(monkeypatch):
    """The table times each side twice, ours, cuBLAS, cuBLAS, ours (a drift between cases reaches both alike),
    and keeps the lower of each side's two."""
    import onepath.bench.kernels_linear as K

    calls, clock = [], iter([5.4, 4.1, 4.0, 4.3])
    monkeypatch.setattr(K, "_time_us", lambda fn, rep_ms: (calls.append(fn()), next(clock))[1])
    ours, cublas = K.paired_us(lambda: "ours", lambda: "cublas", 10)
    assert calls == ["ours", "cublas", "cublas", "ours"]
    assert (ours, cublas) == ([5.4, 4.3], [4.1, 4.0]) and (min(ours), min(cublas)) == (4.3, 4.0)
