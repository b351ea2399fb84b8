"""Which formulation of the grouped expert GEMM streams the experts' weights fastest: the data behind
ops/cuda/linear_grouped.py's tiles and grid.

    python lab/grouped_variants.py [--out lab/results/grouped-variants.json]

Qwen3-30B-A3B's experts (bench/kernels_moe.py's shapes: 128 experts, top-8; gate_up N 1536 K 2048 bf16
out, down N 2048 K 768 fp32 out), random routing, at 64 tokens in the engine's masked layout (16-row
chunks, the buffer sized for any routing, its unused tail NaN), 256, 1024 and 8192 tokens contiguous.
Variants (one line each in the table):
  shipped                    linear_grouped as its launcher picks (tile, TMA, grid)
  table                      the kernel before (git 633912b): M tiles listed by torch ops on the device
                             (m_tiles_device), a persistent kernel with pointer loads, TILES_16BIT's tiles
  BMxBNwWsS                  the shipped kernel forced to that tile: the weight by TMA, x as the
                             launcher decides (by TMA with 128-row tiles only), one program per SM
    + ptr | xtma | xptr      both operands by pointer loads | x by TMA too | x by pointer loads
    + per_tile | 2sms        one program per tile (the grid bounded as for device counts) | two per SM
Timing: replays of a CUDA graph of the call with device counts (the MoE decode step's path; no host
work), median; eager_us (triton do_bench, L2 flushed, host counts: the launcher's host work included,
as kernels_moe.py's "grouped") for shipped and table. References: ops/cuda/linear.py on the same rows
against one weight (same FLOPs), torch._grouped_mm. HBM roofline: the bytes the call must move
(every routed expert's weight once, x's and out's counted rows) / 4.8 TB/s.
Bits: each variant's counted rows vs the shipped kernel's and vs ops/cuda/linear.py on each expert's
rows (torch.equal); "best" is the fastest variant with both equal. Each variant runs under its own
try: one that fails to build is a row with its error. Cases run most important first, and variants
past --budget-s are skipped (recorded), so one call stays under 3 minutes. Without CUDA it says so
and exits 0.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from bench.kernels_moe import HBM_BYTES_PER_S, NUM_EXPERTS, PROJECTIONS, TOP_K, must_move  # noqa: E402
from onepath.bench.results import environment, kernel_us, print_table, save_json  # noqa: E402
from onepath.ops.cuda.linear import BLOCK_K, TILES_16BIT, TileConfig, tile_coords, sm_count  # noqa: E402

TOKENS = (256, 64, 1024, 8192)  # most important first: the budget cuts the last
MASKED_TOKENS = 64  # models/moe.py MASKED_MAX_TOKENS: decode steps up to it run the masked layout


@dataclass(frozen=True)
class Variant:
    tile: TileConfig | None = None  # None: the launcher's pick
    grid: str = "sms"  # "sms": one program per SM, "2sms": two, "per_tile": one per tile
    x_tma: bool | None = None  # x's tiles by TMA (with the weight's): None as the launcher decides
    table: bool = False  # the kernel before

    def __str__(self) -> str:
        if self.table:
            return "table"
        if self.tile is None:
            return "shipped"
        t = self.tile
        flags = [f for f, on in (("ptr", not t.tma), ("xtma", self.x_tma), ("xptr", self.x_tma is False),
                                 (self.grid, self.grid != "sms")) if on]
        return " ".join([f"{t.block_m}x{t.block_n}w{t.num_warps}s{t.num_stages}", *flags])


def _tile(bm, bn, warps, stages, tma=True) -> TileConfig:
    return TileConfig(bm, bn, num_warps=warps, num_stages=stages, tma=tma)


def variants(tokens: int) -> list[Variant]:
    """Decode (<= 1024 tokens, up to ~90 rows per expert): 64-row tiles, 128 or 256 wide, deeper
    pipelines, x by TMA too, both by pointers, the three grids; training (8192): 128-row tiles, x by
    pointers, the grids."""
    base = [Variant(), Variant(table=True)]
    if tokens <= 1024:
        small, wide = _tile(64, 128, 4, 4), _tile(64, 256, 4, 3)
        return base + [Variant(small), Variant(small, "2sms"), Variant(small, "per_tile"), Variant(small, x_tma=True),
                       Variant(replace(small, tma=False)), Variant(_tile(64, 128, 4, 6)),
                       Variant(_tile(64, 128, 4, 6), "per_tile"), Variant(wide), Variant(wide, "per_tile"),
                       Variant(wide, x_tma=True), Variant(_tile(64, 256, 8, 4)), Variant(_tile(64, 64, 4, 6)),
                       Variant(_tile(128, 128, 4, 4))]
    big = _tile(128, 256, 8, 3)
    square = _tile(128, 128, 4, 4)
    return base + [Variant(big), Variant(big, "per_tile"), Variant(big, x_tma=False), Variant(square),
                   Variant(square, "per_tile"), Variant(_tile(128, 128, 8, 3)), Variant(_tile(64, 128, 4, 4))]


def fits(tile: TileConfig | None, out_dtype: torch.dtype) -> bool:
    """An FP32 output tile goes through shared memory: 128x256's does not fit beside its stages."""
    return tile is None or out_dtype != torch.float32 or tile.block_m * tile.block_n <= 128 * 128


def run_variant(v: Variant, x: torch.Tensor, w: torch.Tensor, counts, out_dtype: torch.dtype) -> torch.Tensor:
    from onepath.ops.cuda.linear_grouped import linear_grouped

    if v.table:
        return table_linear_grouped(x, w, counts, out_dtype)
    programs = None
    if v.tile is not None:
        sms = sm_count(x.device)
        m, groups, n = x.shape[0], w.shape[0], w.shape[1]
        tiles = (-(-m // v.tile.block_m) + min(groups, m)) * -(-n // v.tile.block_n)
        programs = {"sms": min(sms, tiles), "2sms": min(2 * sms, tiles), "per_tile": tiles}[v.grid]
    return linear_grouped(x, w, counts, out_dtype=out_dtype, config=v.tile, programs=programs, x_tma=v.x_tma)


# ---- the kernel before (git 633912b), for comparison: tile list on the device, persistent, pointer loads ----

def table_config(counts: list[int], n: int, num_sms: int, out_dtype: torch.dtype) -> TileConfig:
    configs = [c for c in TILES_16BIT if not (out_dtype == torch.float32 and c.block_m * c.block_n > 128 * 128)]
    largest = max(counts, default=0)
    for c in configs:
        if c.block_m <= max(64, largest) and sum(-(-m // c.block_m) for m in counts) * -(-n // c.block_n) >= num_sms:
            return c
    return configs[-1]


def m_tiles_device(counts: torch.Tensor, block_m: int, max_tiles: int) -> torch.Tensor:
    counts = counts.to(torch.int64)
    per_group = (counts + block_m - 1) // block_m
    tile_end, row_end = torch.cumsum(per_group, 0), torch.cumsum(counts, 0)
    i = torch.arange(max_tiles, device=counts.device)
    group = torch.searchsorted(tile_end, i, right=True).clamp_(max=counts.numel() - 1)
    first = (row_end - counts)[group] + (i - (tile_end - per_group)[group]) * block_m
    return torch.cat([tile_end[-1:], group, first, row_end[group]]).to(torch.int32)


@triton.jit(do_not_specialize=["max_m_tiles"])
def _table_kernel(x_ptr, w_ptr, out_ptr, tiles_ptr, max_m_tiles, N, K, stride_xm, stride_we, stride_wn, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  NUM_SMS: tl.constexpr):
    num_m_tiles = tl.load(tiles_ptr)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(tl.program_id(axis=0), num_m_tiles * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = tile_coords(tile_id, num_m_tiles, num_pid_n, GROUP_M)
        group = tl.load(tiles_ptr + 1 + pid_m)
        first = tl.load(tiles_ptr + 1 + max_m_tiles + pid_m)
        end = tl.load(tiles_ptr + 1 + 2 * max_m_tiles + pid_m)
        offs_m = first + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_m < end
        rows = tl.where(row_ok, offs_m, 0)
        cols = tl.where(offs_n < N, offs_n, 0)
        w_group = w_ptr + group.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BLOCK_K)):
            k_left = K - ki * BLOCK_K
            a = tl.load(x_ptr + rows[:, None] * stride_xm + (ki * BLOCK_K + offs_k)[None, :],
                        mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(w_group + cols[None, :] * stride_wn + (ki * BLOCK_K + offs_k)[:, None],
                        mask=offs_k[:, None] < k_left, other=0.0)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


def table_linear_grouped(x, w, counts, out_dtype):
    from onepath.ops.host import to_device

    (m, k), (groups, n, _) = x.shape, w.shape
    sms = sm_count(x.device)
    on_device = isinstance(counts, torch.Tensor)
    config = table_config([-(-m // groups)] * groups if on_device else counts, n, sms, out_dtype)
    out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    if on_device:
        max_m_tiles = -(-m // config.block_m) + groups
        tiles = m_tiles_device(counts, config.block_m, max_m_tiles)
    else:
        listed = [[], [], []]
        start = 0
        for g, rows in enumerate(counts):
            for first in range(start, start + rows, config.block_m):
                for column, value in zip(listed, (g, first, start + rows)):
                    column.append(value)
            start += rows
        max_m_tiles = len(listed[0])
        tiles = to_device([max_m_tiles, *listed[0], *listed[1], *listed[2]], torch.int32, x.device)
    _table_kernel[(min(sms, max_m_tiles * -(-n // config.block_n)),)](
        x, w, out, tiles, max_m_tiles, n, k, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=BLOCK_K, GROUP_M=config.group_m, NUM_SMS=sms,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


# ---- cases ----

def case(tokens: int, n: int, k: int, gen: torch.Generator, device="cuda"):
    """(x, w, group sizes as a list, the layout): top-8 of random scores per token, packed by expert;
    at MASKED_TOKENS or fewer in the masked layout (models/moe.py experts_masked's buffer: whole
    16-row chunks per expert, zero rows in the chunks, the unused tail NaN: never read into a stored row)."""
    from onepath.models.moe import CAPACITY, max_chunks

    experts = torch.rand(tokens, NUM_EXPERTS, generator=gen, device=device).topk(TOP_K, dim=-1).indices
    pairs = torch.bincount(experts.flatten(), minlength=NUM_EXPERTS).tolist()
    w = (torch.randn(NUM_EXPERTS, n, k, generator=gen, device=device) * k ** -0.5).bfloat16()
    if tokens > MASKED_TOKENS:
        return torch.randn(sum(pairs), k, generator=gen, device=device).bfloat16(), w, pairs, "contiguous"
    counts = [-(-p // CAPACITY) * CAPACITY for p in pairs]
    x = torch.full((max_chunks(tokens * TOP_K, NUM_EXPERTS, CAPACITY) * CAPACITY, k), float("nan"), device=device,
                   dtype=torch.bfloat16)
    x[:sum(counts)] = 0
    start = 0
    for p, c in zip(pairs, counts):
        x[start:start + p] = torch.randn(p, k, generator=gen, device=device).bfloat16()
        start += c
    return x, w, counts, "masked"


def dense_rows(x, w, counts, out_dtype):
    """ops/cuda/linear.py on each expert's rows: the bits every grouped row must have."""
    from onepath.ops.cuda.linear import linear

    used = x[:sum(counts)]
    return torch.cat([linear(part, w[e], out_dtype=out_dtype) for e, part in enumerate(used.split(counts))])


def time_us(fn, rep_ms: int) -> tuple[float, str]:
    """CUDA-graph replays where the call captures, else do_bench (L2 flushed)."""
    try:
        return kernel_us(fn, rep_ms, graph=True), "cudagraph"
    except Exception:  # noqa: BLE001 -- a call that does not capture is still timed
        torch.cuda.synchronize()
        return kernel_us(fn, rep_ms), "do_bench"


def stock_grouped_mm(x, w, counts):
    """torch._grouped_mm over the counted rows (w as [E, K, N], offs the rows' cumulative ends), where torch has it."""
    if not hasattr(torch, "_grouped_mm"):
        return None
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    return lambda: torch._grouped_mm(x[:sum(counts)], w.transpose(1, 2), offs=offs)


def run(args) -> dict:
    from onepath.ops.cuda.linear import linear

    began = time.monotonic()
    over_budget = lambda: time.monotonic() - began > args.budget_s
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = dict(environment("cuda"), command="python lab/grouped_variants.py " + " ".join(sys.argv[1:]),
                  sms=sm_count(torch.device("cuda")), hbm_bytes_per_s=HBM_BYTES_PER_S,
                  timing="CUDA graph replays (triton do_bench_cudagraph), median, device counts; eager_us: "
                         "triton do_bench median, L2 flushed, host counts", cases=[])
    table, summary = [], []
    for tokens in args.tokens:
        for name, n, k, out_dtype in PROJECTIONS:
            x, w, counts, layout = case(tokens, n, k, gen)
            sizes = torch.tensor(counts, device="cuda")  # int64, as the MoE dispatch's
            rows = sum(counts)
            moved = must_move(counts, n, k, out_dtype)
            roofline = moved / HBM_BYTES_PER_S * 1e6
            want = dense_rows(x, w, counts, out_dtype)
            try:
                shipped = run_variant(Variant(), x, w, sizes, out_dtype)[:rows]
            except Exception as e:  # noqa: BLE001 -- the variants still run, compared with the dense rows
                shipped = None
                print(f"shipped: {type(e).__name__}: {str(e)[:300]}", flush=True)
                torch.cuda.synchronize()
            row = dict(tokens=tokens, layout=layout, projection=name, N=n, K=k, out_dtype=str(out_dtype), rows=rows,
                       buffer_rows=x.shape[0], experts_used=sum(1 for c in counts if c), must_move_bytes=moved,
                       roofline_us=roofline, variants=[], refs={})
            print(f"\n{tokens} tokens ({layout}, {rows} rows), {name} N={n} K={k}: roofline {roofline:.0f} us",
                  flush=True)
            dense_x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
            refs = dict(dense=lambda: linear(dense_x, w[0], out_dtype=out_dtype),
                        torch_grouped_mm=stock_grouped_mm(x, w, counts))
            for ref, fn in refs.items():
                try:
                    row["refs"][ref] = time_us(fn, args.rep_ms)[0] if fn else None
                except Exception as e:  # noqa: BLE001 -- a stock kernel's limits are not ours to fix
                    row["refs"][ref] = None
                    print(f"  {ref}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            for v in [v for v in variants(tokens) if fits(v.tile, out_dtype)]:
                entry = dict(variant=str(v))
                if over_budget():
                    entry["error"] = f"skipped: past the {args.budget_s} s budget"
                    row["variants"].append(entry)
                    continue
                try:
                    y = run_variant(v, x, w, sizes, out_dtype)[:rows]
                    entry.update(equal_shipped=shipped is not None and torch.equal(y, shipped),
                                 equal_dense=torch.equal(y, want),
                                 rows_differing_dense=int((y != want).any(-1).sum()))
                    entry["us"], entry["timing"] = time_us(lambda: run_variant(v, x, w, sizes, out_dtype), args.rep_ms)
                    entry.update(tb_s=moved / entry["us"] * 1e-6, fraction_of_hbm=roofline / entry["us"])
                    if v.tile is None or v.table:  # host sizes take the counted rows only
                        entry["eager_us"] = kernel_us(lambda: run_variant(v, x[:rows], w, counts, out_dtype),
                                                      args.rep_ms)
                except Exception as e:  # noqa: BLE001 -- a variant that does not build is a result
                    entry = dict(variant=str(v), error=f"{type(e).__name__}: {str(e)[:300]}")
                    torch.cuda.synchronize()
                row["variants"].append(entry)
                print(f"  {entry['variant']:<24} " + (entry.get("error") or f"{entry['us']:8.1f} us "
                      f"{entry['tb_s']:5.2f} TB/s {entry['fraction_of_hbm']:.2f} of HBM, bits == shipped "
                      f"{entry['equal_shipped']}, == dense {entry['equal_dense']}"), flush=True)
                save_json(result | dict(cases=result["cases"] + [row]), Path(args.out))
            timed = [e for e in row["variants"] if "us" in e]
            shipped_us = next((e["us"] for e in timed if e["variant"] == "shipped"), None)
            for e in timed:
                e["vs_shipped"] = shipped_us / e["us"] if shipped_us else None
            good = [e for e in timed if e["equal_dense"] and (shipped is None or e["equal_shipped"])]
            row["best"] = min(good, key=lambda e: e["us"])["variant"] if good else None
            result["cases"].append(row)
            save_json(result, Path(args.out))
            for e in row["variants"]:
                bits = None if "us" not in e else "equal" if e["equal_shipped"] and e["equal_dense"] else "DIFFER"
                table.append([f"{tokens} {layout}", name, e["variant"], e.get("us"), e.get("eager_us"), e.get("tb_s"),
                              e.get("fraction_of_hbm"), e.get("vs_shipped"), bits,
                              "best" if e["variant"] == row["best"] else ""] if "us" in e
                             else [f"{tokens} {layout}", name, e["variant"], e["error"]])
            summary.append([f"{tokens} {layout}", name, row["rows"], roofline, shipped_us, row["refs"]["dense"],
                            row["refs"]["torch_grouped_mm"], row["best"]])
            torch.cuda.empty_cache()
    print_table(f"Grouped GEMM variants, {NUM_EXPERTS} experts top-{TOP_K} (us: graph replays, median; eager: "
                "host counts, do_bench; TB/s of the bytes the call must move; fraction of 4.8 TB/s)",
                ["tokens", "proj", "variant", "us", "eager us", "TB/s", "of HBM", "vs shipped", "bits", ""], table)
    print_table("Per case (us; roofline: the bytes the call must move at 4.8 TB/s; dense: one weight, same rows)",
                ["tokens", "proj", "rows", "roofline us", "shipped us", "dense us", "_grouped_mm us", "best"], summary)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="lab/results/grouped-variants.json")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--rep-ms", type=int, default=10, help="time budget of each timing")
    p.add_argument("--budget-s", type=float, default=150, help="variants past this many seconds are skipped")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("grouped_variants: no CUDA device here; nothing timed (run it on the GPU machine)")
        return
    run(args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
