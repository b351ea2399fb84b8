"""Time onepath.ops.cuda.linear against cuBLAS (F.linear) over decode to prefill M.

    python bench/kernels_linear.py [--out bench/results/linear/kernels-linear.json] [--sweep]
    python bench/kernels_linear.py --decode-sweep --graph --out bench/results/linear/kernels-matmul-decode-sweep.json
    python bench/kernels_linear.py --summarize bench/results/linear/kernels-matmul-decode-sweep.json
    python bench/kernels_linear.py --rank-picks A.json B.json [--out bench/results/linear/kernels-matmul-pick-model.json]
    python bench/kernels_linear.py --past-m --graph --out bench/results/linear/kernels-matmul-past-m.json

Per (shape, M): median microseconds of both (triton.testing.do_bench, L2 flushed between calls, as
a decode step reads each layer's weight from HBM; each side timed twice, ours, cuBLAS, cuBLAS, ours, the lower
kept: `paired_us`), TFLOP/s, GB/s of the bytes a call must move,
and speed vs cuBLAS (cuBLAS time / ours); --cublas-kernels records the kernels cuBLAS launched (a split-K
shows its reduce kernel). --sweep also times every candidate tile config (pointer and TMA loads) and records
whether its bits equal the default's: the data for choosing the table.
--decode-sweep does the same at decode M (1..256) over a grid that also varies BLOCK_K (fewer, longer
K steps: a program's walk over K is a chain of dependent steps, the latency a skinny GEMM waits on),
on the listed shapes and the projections of the Qwen3-0.6B/1.7B shapes at a batch of 256; its
Triton builds are compiled first by --jobs processes, then timed one by one; --configs times given tiles
instead of the grid, and --last-rows-past-m with the last row tile running past M (the comparison for
linear.LAST_ROWS_BACK). --rank-picks (no GPU) reads such sweeps, a later file's cases replacing an earlier
one's, and for each case where every tile a rule may take was timed compares pick_config's tile and the
two rules before it with the best of them (rank_picks). --past-m times a row tile past M with its x box and its
store each whole or past M: which of the two costs.
Without CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


from onepath.bench.results import KERNEL_TIMING, environment, kernel_us, save_json

# (name, K, N, out_dtype): the MLP and attention projections of the target models, and an LM head.
SHAPES = [
    ("square 4096x4096", 4096, 4096, torch.bfloat16),
    ("qwen mlp 1024->3072", 1024, 3072, torch.bfloat16),
    ("qwen3 o_proj 2048->1024", 2048, 1024, torch.bfloat16),
    ("llama mlp 4096->11008", 4096, 11008, torch.bfloat16),
    ("qwen3 lm head 1024->151936 fp32", 1024, 151936, torch.float32),
]
MS = [1, 16, 64, 128, 256, 1024, 4096, 8192]
SWEEP_MS = [1, 64, 256, 1024, 8192]
CEILINGS = {"bf16_gemm_tflops_cublas_8192": 789, "device_copy_tb_s": 4.2}


def _baseline(out_dtype):
    """cuBLAS with the same output dtype where torch has it (mm.dtype), else F.linear's bf16."""
    if out_dtype == torch.float32:
        try:
            a = torch.ones(2, 16, device="cuda", dtype=torch.bfloat16)
            torch.mm(a, a.T, out_dtype=torch.float32)
            return "torch.mm(out_dtype=float32)", lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    return "F.linear", lambda x, w: F.linear(x, w)


GRAPH = False  # --graph: time CUDA-graph replays (no Python launch cost; L2 not flushed)


def _time_us(fn, rep_ms):
    return kernel_us(fn, rep_ms, graph=GRAPH)


def paired_us(ours_fn, base_fn, rep_ms) -> tuple[list[float], list[float]]:
    """Two timings of each side, in the order ours, cuBLAS, cuBLAS, ours, so a drift in the GPU's state between
    cases (each shape's M = 1 follows the previous shape's M = 8192) reaches both sides alike; the table takes
    the lower of each side's two (why: docs/gpu-performance.md, the BF16 GEMM)."""
    first, base = _time_us(ours_fn, rep_ms), [_time_us(base_fn, rep_ms), _time_us(base_fn, rep_ms)]
    return [first, _time_us(ours_fn, rep_ms)], base


def _sweep_configs():
    """The shipped tiles, other wgmma tiles (narrower N: more programs at decode, where N / BLOCK_N programs
    are all there are), and mma.sync tiles whose warps hold 16 whole rows (as the attention's decode program,
    which keeps the 64-row program's bits): the sweep's same_bits_as_default says whether each may join."""
    from onepath.ops.cuda.linear import TILES_16BIT, TileConfig

    extra = [TileConfig(128, 64, 4, 4), TileConfig(64, 256, 8, 3), TileConfig(128, 256, 8, 4),
             TileConfig(128, 128, 4, 4), TileConfig(64, 64, 4, 6), TileConfig(64, 32, 4, 8),
             TileConfig(64, 16, 4, 8), TileConfig(16, 32, 1, 6), TileConfig(16, 64, 1, 4), TileConfig(32, 32, 2, 6)]
    base = [*TILES_16BIT, *extra]
    return base + [TileConfig(c.block_m, c.block_n, c.num_warps, c.num_stages, c.group_m, tma=True) for c in base]


# (name, K, N, out_dtype, Ms) of the decode sweep: the table's decode rows below 0.9 of cuBLAS, and the
# model projections (stacked qkv and gate_up) that a rollout's batch of 256 runs.
DECODE_SWEEP = [
    ("square 4096x4096", 4096, 4096, torch.bfloat16, (1, 16, 64)),
    ("qwen mlp 1024->3072", 1024, 3072, torch.bfloat16, (1, 64, 256)),
    ("qwen3 o_proj 2048->1024", 2048, 1024, torch.bfloat16, (1, 16, 64, 256)),
    ("llama mlp 4096->11008", 4096, 11008, torch.bfloat16, (1, 16, 256)),
    ("qwen3 lm head 1024->151936 fp32", 1024, 151936, torch.float32, (1, 256)),
    ("qwen3-0.6b qkv 1024->4096", 1024, 4096, torch.bfloat16, (256,)),
    ("qwen3-0.6b gate_up 1024->6144", 1024, 6144, torch.bfloat16, (256,)),
    ("qwen3-0.6b down 3072->1024", 3072, 1024, torch.bfloat16, (256,)),
    ("qwen3-1.7b qkv 2048->4096", 2048, 4096, torch.bfloat16, (256,)),
    ("qwen3-1.7b o_proj 2048->2048", 2048, 2048, torch.bfloat16, (256,)),
    ("qwen3-1.7b gate_up 2048->12288", 2048, 12288, torch.bfloat16, (256,)),
    ("qwen3-1.7b down 6144->2048", 6144, 2048, torch.bfloat16, (256,)),
    ("qwen3-1.7b lm head 2048->151936 fp32", 2048, 151936, torch.float32, (256,)),
]
SHARED_BYTES = 220 * 1024  # what a config's pipeline may take of the 227 KiB (the epilogue needs some)


def _sweep_entry(name, x, w, out_dtype, config, ref, cublas_us, rep_ms) -> dict:
    """One candidate tile on one case: whether its bits equal the default's, its time, or why it did not build."""
    from onepath.ops.cuda.linear import linear

    entry = dict(shape=name, K=x.shape[1], N=w.shape[0], M=x.shape[0], config=dataclasses.asdict(config))
    try:
        entry["same_bits_as_default"] = torch.equal(linear(x, w, out_dtype=out_dtype, config=config), ref)
        entry["us"] = _time_us(lambda: linear(x, w, out_dtype=out_dtype, config=config), rep_ms)
        entry["speed_vs_cublas"] = cublas_us / entry["us"]
    except Exception as e:  # noqa: BLE001 -- a config that does not build is a result
        entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return entry


def decode_configs(m: int):
    """16-row mma.sync tiles (one warp) up to M = 16, and there 16-token tiles with the operands swapped (64 or
    128 weight rows as wgmma's M, TileConfig.swap); 64-row wgmma tiles at every M, 128-row ones from M = 128;
    each with BLOCK_K 64, 128 or 256 and pointer or TMA loads, where the stages fit."""
    from onepath.ops.cuda.linear import TileConfig

    grid = []
    if m <= 16:
        grid += [(16, bn, 1, s, bk, False) for bn in (32, 64) for s in (4, 8) for bk in (64, 128, 256)]
        # more programs (16 columns), deeper K steps, two or four warps a tile
        grid += [(16, 16, 1, 4, 256, False), (16, 32, 1, 3, 512, False), (16, 32, 2, 4, 256, False),
                 (16, 64, 2, 4, 256, False), (16, 128, 4, 3, 128, False)]
        grid += [(16, bn, 4, s, bk, True) for bn in (64, 128) for s in (4, 6) for bk in (128, 256)]
    grid += [(64, bn, 4, s, bk, False) for bn in (32, 64, 128) for s in (3, 4, 6) for bk in (64, 128, 256)]
    if m >= 128:
        grid += [(128, bn, 8, s, bk, False) for bn in (128, 256) for s in (3, 4) for bk in (64, 128)]
    tiles = [TileConfig(bm, bn, w, s, tma=tma, block_k=bk, swap=swap)
             for bm, bn, w, s, bk, swap in grid for tma in (False, True)]
    return [c for c in tiles if c.pipeline_bytes() <= SHARED_BYTES]


def decode_shapes(args):
    """DECODE_SWEEP narrowed to --shapes (substrings of the names) and --ms; with --configs, every shape
    at every --ms."""
    return [(name, k, n, out_dtype, tuple(args.ms) if args.configs else tuple(m for m in ms if m in args.ms))
            for name, k, n, out_dtype, ms in DECODE_SWEEP if not args.shapes or any(part in name for part in args.shapes)]


def parse_tile(name: str):
    """'128x256x64w8s4T' (rows x columns x K step, warps, stages, T for TMA or P for pointer loads; a trailing
    S: the operands swapped, TileConfig.swap, e.g. 16x64x256w4s4TS)."""
    import re

    from onepath.ops.cuda.linear import TileConfig

    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)([TP])(S?)", name)
    if not match:
        raise argparse.ArgumentTypeError(f"tile {name!r}: expected e.g. 128x256x64w8s4T (T: TMA, P: pointer loads; "
                                         "a trailing S swaps the operands, e.g. 16x64x256w4s4TS)")
    bm, bn, bk, warps, stages = map(int, match.groups()[:5])
    return TileConfig(bm, bn, warps, stages, tma=match.group(6) == "T", block_k=bk, swap=match.group(7) == "S")


def decode_cases(shapes, configs=None):
    return [(name, k, n, out_dtype, m, c) for name, k, n, out_dtype, ms in shapes
            for m in ms for c in (configs or decode_configs(m))]


def _compile_shard(shard: list, last_rows_back: bool = True) -> int:
    """Build (and run once) each case's kernel so the timing process finds it in Triton's cache."""
    from onepath.ops.cuda import linear as mm
    from onepath.ops.cuda.linear import linear

    mm.LAST_ROWS_BACK = last_rows_back
    failed = 0
    for k, n, out_dtype, m, c in shard:
        try:
            linear(torch.zeros(m, k, device="cuda", dtype=torch.bfloat16),
                   torch.zeros(n, k, device="cuda", dtype=torch.bfloat16), out_dtype=out_dtype, config=c)
        except Exception:  # noqa: BLE001 -- the timing pass records the error
            failed += 1
    torch.cuda.synchronize()
    return failed


def _precompile(cases, jobs: int, last_rows_back: bool) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # one case per build: a config's kernel differs by whether M fills its tiles and by the output dtype
    builds = {}
    for _, k, n, out_dtype, m, c in cases:
        builds.setdefault((c, m % c.block_m == 0, out_dtype), (k, n, out_dtype, m, c))
    unique = list(builds.values())
    shards = [unique[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = sum(pool.map(_compile_shard, shards, [last_rows_back] * len(shards)))
    print(f"precompiled {len(unique)} builds in {jobs} processes ({failed} failed)", flush=True)


def run_decode_sweep(args) -> dict:
    from onepath.ops.cuda.linear import linear, pick_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = decode_shapes(args)
    cases = decode_cases(shapes, args.configs)
    if args.jobs > 1:
        _precompile(cases, args.jobs, not args.last_rows_past_m)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, sweep = [], []
    for name, k, n, out_dtype, ms in shapes:
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
        base_name, base_fn = _baseline(out_dtype)
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            default = pick_config(m, n, torch.bfloat16, sms, out_dtype)
            ref = linear(x, w, out_dtype=out_dtype)
            cublas = _time_us(lambda: base_fn(x, w), args.rep_ms)
            ours = _time_us(lambda: linear(x, w, out_dtype=out_dtype), args.rep_ms)
            rows.append(dict(shape=name, K=k, N=n, M=m, config=dataclasses.asdict(default), ours_us=ours,
                             cublas_us=cublas, baseline=base_name, speed_vs_cublas=cublas / ours))
            here = []
            for c in args.configs or decode_configs(m):
                here.append(_sweep_entry(name, x, w, out_dtype, c, ref, cublas, args.rep_ms))
            sweep += here
            timed = sorted((e for e in here if "us" in e), key=lambda e: e["us"])
            best = ", ".join(f"{_tile_name(e['config'])} {e['us']:.1f}" for e in timed[:3])
            print(f"{name:34s} M={m:4d} cuBLAS {cublas:6.1f} default {_tile_name(rows[-1]['config'])} {ours:6.1f} "
                  f"| best {best} | same bits {sum(e['same_bits_as_default'] for e in timed)}/{len(timed)}",
                  flush=True)
            del x
        del w
        torch.cuda.empty_cache()
    return _result(sms, rows=rows, sweep=sweep, k_step_summary=k_step_summary(sweep))


def k_step_summary(sweep: list[dict]) -> dict:
    """Per M class (up to 16 rows, more): how much longer a 64-row TMA tile took with 64-deep K steps than the
    same tile (columns, warps) with the best of its 128- and 256-deep ones: median, min and max over cases."""
    best = {}
    for e in sweep:
        c = e["config"]
        if "us" in e and c["block_m"] == 64 and c["tma"]:
            key = (e["shape"], e["M"], c["block_n"], c["num_warps"])
            steps = best.setdefault(key, {})
            steps[c["block_k"]] = min(steps.get(c["block_k"], float("inf")), e["us"])
    ratios = {"m_le_16": [], "m_gt_16": []}
    for (_, m, _, _), steps in best.items():
        deeper = min(steps.get(128, float("inf")), steps.get(256, float("inf")))
        if 64 in steps and deeper < float("inf"):
            ratios["m_le_16" if m <= 16 else "m_gt_16"].append(steps[64] / deeper)
    return {name: dict(cases=len(r), median=statistics.median(r), min=min(r), max=max(r))
            for name, r in ratios.items() if r}


def summarize(path: Path) -> None:
    """Add k_step_summary to a decode sweep's results file (one written before the summary existed)."""
    result = json.loads(path.read_text())
    result["k_step_summary"] = k_step_summary(result["sweep"])
    save_json(result, path)
    print(json.dumps(result["k_step_summary"], indent=1))


def _ladder_before(m: int, out_dtype: torch.dtype):
    """The dense tiles before SMALL_TILES and the deeper 128x128 ring: DENSE_TILES, 128-row ones once M filled one."""
    from onepath.ops.cuda.linear import DENSE_TILES, stages_output
    return [c for c in DENSE_TILES if c.block_m <= max(64, m) and stages_output(c, out_dtype)]


def _half_the_sms_rule(m: int, n: int, out_dtype: torch.dtype, sms: int):
    """The dense pick before DENSE_SPEED: the largest ladder tile that still gives half the SMs a tile."""
    from onepath.ops.cuda.linear import first_filling
    return first_filling(_ladder_before(m, out_dtype), m, n, sms // 2)


RULES = ("pick", "dense_model", "half_sms")  # rank_picks: pick_config now, and the two rules before it


def rank_picks(paths: list[Path], sms: int = 132) -> dict:
    """Per swept case past SKINNY_M, the time of each rule's tile against the best of the tiles any rule may
    take there: pick_config's (SMALL_TILES up to SMALL_M rows, dense_candidates past them), the DENSE_SPEED model
    over the ladder before (_ladder_before; what every M past SKINNY_M took before SMALL_TILES) and the rule
    before that (the largest ladder tile still giving half the SMs one). A case counts where all were timed."""
    from onepath.ops.cuda.linear import (SKINNY_M, SMALL_M, SMALL_TILES, TileConfig, dense_candidates, dense_pick,
                                        pick_config, stages_output)

    cases = {}  # (shape, K, N, M) -> the file it was read from and its times by tile
    for path in paths:
        read = {}
        for e in json.loads(path.read_text())["sweep"]:
            if "us" in e and e["M"] > SKINNY_M:
                case = read.setdefault((e["shape"], e["K"], e["N"], e["M"]), dict(source=path.name, us={}))
                case["us"][TileConfig(**e["config"])] = e["us"]
        cases.update(read)  # a later file's case replaces the whole case
    rows = []
    for (shape, k, n, m), case in sorted(cases.items()):
        out_dtype = torch.float32 if "fp32" in shape else torch.bfloat16
        before = _ladder_before(m, out_dtype)
        pool = {*dense_candidates(m, out_dtype), *before,
                *(c for c in SMALL_TILES if m <= SMALL_M and stages_output(c, out_dtype))}
        if not all(c in case["us"] for c in pool):
            continue
        best = min(case["us"][c] for c in pool)
        tiles = dict(pick=pick_config(m, n, torch.bfloat16, sms, out_dtype),
                     dense_model=dense_pick(m, n, sms, out_dtype, before), half_sms=_half_the_sms_rule(m, n, out_dtype, sms))
        row = dict(shape=shape, K=k, N=n, M=m, source=case["source"], best_us=best)
        for rule, tile in tiles.items():
            row[rule] = _tile_name(dataclasses.asdict(tile))
            row[f"{rule}_vs_best"] = case["us"][tile] / best
        rows.append(row)
    if not rows:
        raise ValueError(f"rank_picks: no case in {[p.name for p in paths]} has every tile pick_config may take timed")
    geo = lambda xs: float(torch.tensor(xs, dtype=torch.float64).log().mean().exp())  # noqa: E731
    summary = {}
    for name, chosen in (("all", rows), (f"M <= {SMALL_M}", [r for r in rows if r["M"] <= SMALL_M]),
                         (f"M > {SMALL_M}", [r for r in rows if r["M"] > SMALL_M])):
        if chosen:
            summary[name] = dict(cases=len(chosen), **{rule: dict(
                geomean_vs_best=geo([r[f"{rule}_vs_best"] for r in chosen]),
                worst_vs_best=max(r[f"{rule}_vs_best"] for r in chosen)) for rule in RULES})
    for r in sorted(rows, key=lambda r: -r["pick_vs_best"])[:10]:
        print(f"{r['shape']:38s} M={r['M']:4d} " + "  ".join(f"{rule} {r[rule]:24s} {r[f'{rule}_vs_best']:.2f}"
                                                          for rule in RULES))
    print(json.dumps(summary, indent=1))
    return dict(environment("cpu"), command="python " + " ".join(sys.argv), sources=[p.name for p in paths],
                sms=sms, summary=summary, rows=rows)


# (K, N, M, M rounded up to the tile, tile) of --past-m: row tiles past M by 8..32 rows
PAST_M_CASES = [(k, n, m, full, tile) for k, n in ((4096, 4096), (4096, 11008)) for m, full, tile in (
    (32, 64, "64x32x256w4s4T"), (32, 64, "64x64x128w4s6T"), (40, 64, "64x64x128w4s6T"), (96, 128, "64x64x128w4s6T"),
    (96, 128, "128x128x64w4s4T"), (24, 32, "32x128x128w4s4T"))]


def run_past_m(args) -> dict:
    """Which part of a row tile past M costs: the TMA box of x reaching past M, or the store masked to M? The
    kernel is launched on x padded with zero rows to a whole tile, its box over M rows or over all of them, and
    told M or the whole tile's rows (the store masked to M or not): four launches of one tile per case, with
    the bits of the M rows checked against linear()."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from onepath.ops.cuda import linear as mm

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for k, n, m, full, name in PAST_M_CASES:
        cfg = parse_tile(name)
        w = (torch.randn(n, k, device="cuda") * k ** -0.5).bfloat16()
        x = torch.randn(full, k, device="cuda").bfloat16()
        x[m:] = 0
        out = torch.empty(full, n, device="cuda", dtype=torch.bfloat16)
        w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
        ref = mm.linear(x[:m], w, config=cfg)

        def launch(box_rows, m_kernel):
            x_desc = TensorDescriptor.from_tensor(x[:box_rows], [cfg.block_m, cfg.block_k])
            return lambda: mm.launch(x, w, None, out, m_kernel, cfg, x_desc, w_desc, last_rows_back=False)

        row = dict(K=k, N=n, M=m, tile_rows=full, tile=name)
        for case, box_rows, m_kernel in (("box_past_m_store_masked", m, m), ("box_whole_store_masked", full, m),
                                         ("box_past_m_store_whole", m, full), ("box_whole_store_whole", full, full)):
            fn = launch(box_rows, m_kernel)
            fn()
            row[f"{case}_same_bits"] = torch.equal(out[:m], ref)
            row[f"{case}_us"] = _time_us(fn, args.rep_ms)
        rows.append(row)
        print(f"K={k} N={n} M={m} {name}: " + "  ".join(f"{c} {row[c + '_us']:.1f}" for c in (
            "box_past_m_store_masked", "box_whole_store_masked", "box_past_m_store_whole", "box_whole_store_whole")),
            flush=True)
    return _result(sms, rows=rows)


def _kernel_names(fn) -> list[str]:
    """The CUDA kernels one call of fn launches (torch.profiler), e.g. whether cuBLAS split K."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:120] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _result(sms: int, **fields) -> dict:
    return dict(environment("cuda"), sms=sms, command="python " + " ".join(sys.argv),
                timing="do_bench_cudagraph median (graph replay, L2 not flushed)" if GRAPH else KERNEL_TIMING, **fields)


def _tile_name(c: dict) -> str:
    return (f"{c['block_m']}x{c['block_n']}x{c.get('block_k', 64)}w{c['num_warps']}s{c['num_stages']}"
            f"{' tma' if c['tma'] else ''}{' swap' if c.get('swap') else ''}")


def run(args) -> dict:
    from onepath.ops.cuda.linear import linear, pick_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, sweep = [], []
    head = f"{'shape':34s} {'M':>5s} {'config':>14s} {'ours us':>9s} {'cuBLAS us':>9s} {'speed':>6s} " \
           f"{'ours TF/s':>9s} {'cuBLAS TF/s':>11s} {'ours GB/s':>9s}"
    print(head)
    for name, k, n, out_dtype in SHAPES:
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
        base_name, base_fn = _baseline(out_dtype)
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            cfg = pick_config(m, n, torch.bfloat16, sms, out_dtype)
            flops = 2.0 * m * n * k
            moved = 2 * (m * k + n * k) + m * n * torch.finfo(out_dtype).bits // 8
            ours_runs, cublas_runs = paired_us(lambda: linear(x, w, out_dtype=out_dtype), lambda: base_fn(x, w),
                                                args.rep_ms)
            ours, cublas = min(ours_runs), min(cublas_runs)
            row = dict(shape=name, K=k, N=n, M=m, out_dtype=str(out_dtype), config=dataclasses.asdict(cfg),
                       ours_us=ours, cublas_us=cublas, ours_us_runs=ours_runs, cublas_us_runs=cublas_runs,
                       baseline=base_name, speed_vs_cublas=cublas / ours,
                       ours_tflops=flops / ours * 1e-6, cublas_tflops=flops / cublas * 1e-6,
                       ours_gb_s=moved / ours * 1e-3, cublas_gb_s=moved / cublas * 1e-3)
            if args.cublas_kernels:
                row["cublas_kernels"] = _kernel_names(lambda: base_fn(x, w))
            rows.append(row)
            tile = f"{cfg.block_m}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}"
            print(f"{name:34s} {m:5d} {tile:>14s} {ours:9.1f} {cublas:9.1f} {cublas / ours:6.2f} "
                  f"{row['ours_tflops']:9.1f} {row['cublas_tflops']:11.1f} {row['ours_gb_s']:9.0f}", flush=True)
            if args.sweep and m in SWEEP_MS:
                ref = linear(x, w, out_dtype=out_dtype)
                for c in _sweep_configs():
                    sweep.append(_sweep_entry(name, x, w, out_dtype, c, ref, cublas, args.rep_ms))
                here = [e for e in sweep if e["M"] == m and e["shape"] == name]
                timed = [e for e in here if "us" in e]
                if timed:
                    best = min(timed, key=lambda e: e["us"])
                    c = best["config"]
                    print(f"{'':34s} {'':5s} sweep: best {c['block_m']}x{c['block_n']}w{c['num_warps']}s"
                          f"{c['num_stages']}{' tma' if c['tma'] else ''} {best['us']:.1f} us, "
                          f"{len(timed)}/{len(here)} compiled, all same bits: "
                          f"{all(e['same_bits_as_default'] for e in timed)}", flush=True)
            del x
        del w
        torch.cuda.empty_cache()
    return _result(sms, ceilings=CEILINGS, rows=rows, sweep=sweep)


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/linear/kernels-linear.json")
    p.add_argument("--sweep", action="store_true", help="also time every candidate tile config")
    p.add_argument("--ms", type=int, nargs="+", default=MS)
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench time budget per measurement")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays: the kernel without launch cost")
    p.add_argument("--decode-sweep", action="store_true", help="sweep tiles and BLOCK_K at decode M (see above)")
    p.add_argument("--jobs", type=int, default=12, help="processes that compile the decode sweep's builds first")
    p.add_argument("--shapes", nargs="+", help="decode sweep: only the shapes whose names contain one of these")
    p.add_argument("--summarize", type=Path, help="add the K-step summary to this decode sweep's results file; no GPU")
    p.add_argument("--last-rows-past-m", action="store_true",
                   help="the last row tile runs past M (linear.LAST_ROWS_BACK off): the comparison")
    p.add_argument("--configs", nargs="+", type=parse_tile,
                   help="decode sweep: these tiles (e.g. 128x256x64w8s4T) at every --ms instead of the grid")
    p.add_argument("--cublas-kernels", action="store_true",
                   help="record the kernels each cuBLAS call launches (torch.profiler): split-K shows as a reduce kernel")
    p.add_argument("--past-m", action="store_true",
                   help="time a row tile past M with its x box and its store each whole or past M (PAST_M_CASES)")
    p.add_argument("--rank-picks", nargs="+", type=Path, metavar="SWEEP",
                   help="no GPU: pick_config and the rule before it against the best tile in these sweeps")
    args = p.parse_args(argv)
    if args.rank_picks:
        save_json(rank_picks(args.rank_picks), Path(args.out))
        print(f"wrote {args.out}")
        return
    if args.summarize:
        summarize(args.summarize)
        return
    if not torch.cuda.is_available():
        print("kernels_linear: no CUDA device here; nothing timed (run it on a CUDA GPU)")
        return
    global GRAPH
    GRAPH = args.graph
    if args.last_rows_past_m:
        from onepath.ops.cuda import linear as mm
        mm.LAST_ROWS_BACK = False
    runner = run_decode_sweep if args.decode_sweep else run_past_m if args.past_m else run
    save_json(runner(args), Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
