"""Time the grouped expert GEMM (ops/cuda/linear_grouped.py) against our dense GEMM at equal work.

    python bench/kernels_moe.py [--out bench/results/moe/kernels-moe.json] [--tokens 256 8192]

Qwen3-30B-A3B's experts (hidden 2048, moe_intermediate 768, 128 experts, top-8), random routing.
Per (tokens, projection): median microseconds (triton.testing.do_bench, L2 flushed) of
  grouped     one grouped launch over tokens x 8 rows packed by expert (the launcher's host work included);
  dense       ops/cuda/linear.py on one [tokens x 8, K] x [K, N] problem: the same FLOPs, one weight;
  loop        ops/cuda/linear.py once per expert: the path the grouped kernel replaces;
  cublas loop F.linear once per expert (the baseline's path); torch._grouped_mm where torch has it;
  grouped_graph  the grouped launch with the counts on the device, replayed from a CUDA graph (the
              engine's decode path: no host work, no L2 flush; the weights are far past L2 anyway).
TFLOP/s for all, GB/s of the bytes the grouped call must move (the routed experts' weights, x, out),
and grouped / dense TFLOP/s (target >= 0.70). At decode the grouped call reads 128 weights where the
dense one reads one, so there it is bound by HBM: grouped_roofline_us = the bytes it must move /
4.8 TB/s, grouped_fraction_of_hbm = roofline / grouped us (grouped_graph_...: of the graph replays),
and grouped_over_dense_bound = dense us / roofline us, the most grouped / dense that reading those
bytes allows (below the 0.70 target where the target cannot be met). The HBM peak is the device's
(onepath/bench/roofline.hbm_peak: H200 4.8 TB/s, H100 3.35 TB/s).

Block-FP8 W8A8 (ops/cuda/linear_grouped_fp8.py; the experts of an FP8 MoE, each expert's weight quantised
128x128, the rows 1x128), per row as well:
  grouped_fp8        one grouped FP8 launch on pre-quantised operands, the launcher's pick of kernel
                     (pick_grouped_kernel; the launcher's host work included);
  grouped_fp8_graph  the same with the counts on the device, replayed from a CUDA graph;
  quant_grouped_fp8_graph  the activation quantiser and the grouped launch together, replayed (the MoE's path);
  grouped_fp8_ws, grouped_fp8_ws_graph  the warp-specialized kernel forced (GROUPED_WS_CONFIG; Hopper only,
                     None elsewhere), eager and replayed; grouped_fp8_triton_graph  the Triton kernel forced, replayed;
fp8_over_bf16 = grouped_graph us / grouped_fp8_graph us (target >= 1.5 at 8192 tokens), fp8_ws_over_bf16 the
same of grouped_fp8_ws_graph, and
grouped_fp8_fraction_of_hbm = the FP8 bytes the call must move / the HBM peak / grouped_fp8_graph us
(target >= 0.8 at 256 tokens). Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.bench.results import KERNEL_TIMING, environment, kernel_us, print_table, save_json  # noqa: E402

HIDDEN, MOE_INTERMEDIATE, NUM_EXPERTS, TOP_K = 2048, 768, 128, 8
# (name, N, K, out dtype): the fused gate/up projection and the down projection (FP32 out, as ops.expert_down)
PROJECTIONS = [("gate_up", 2 * MOE_INTERMEDIATE, HIDDEN, torch.bfloat16),
               ("down", HIDDEN, MOE_INTERMEDIATE, torch.float32)]
TOKENS = [256, 8192]  # a decode step's batch, a training micro-batch
TARGET = 0.70
FP8_TARGETS = {"fp8_over_bf16_at_8192": 1.5, "grouped_fp8_fraction_of_hbm_at_256": 0.8}


def must_move(counts: list[int], n: int, k: int, out_dtype: torch.dtype) -> int:
    """Bytes a grouped call over BF16 x and weights must move at least: every routed expert's weight
    once, x's counted rows once, the output rows once."""
    rows = sum(counts)
    return 2 * (sum(1 for c in counts if c) * n * k + rows * k) + rows * n * torch.finfo(out_dtype).bits // 8


def must_move_fp8(counts: list[int], n: int, k: int, out_dtype: torch.dtype) -> int:
    """Bytes a grouped block-FP8 call must move at least: every routed expert's codes and 128x128 block
    scales once, x's codes and 1x128 scales once, the output rows once."""
    rows, kb = sum(counts), -(-k // 128)
    weights = sum(1 for c in counts if c) * (n * k + 4 * -(-n // 128) * kb)
    return weights + rows * (k + 4 * kb) + rows * n * torch.finfo(out_dtype).bits // 8


def routed_counts(tokens: int, gen: torch.Generator) -> list[int]:
    experts = torch.rand(tokens, NUM_EXPERTS, generator=gen, device="cuda").topk(TOP_K, dim=-1).indices
    return torch.bincount(experts.flatten(), minlength=NUM_EXPERTS).tolist()


def stock_grouped_mm():
    """torch._grouped_mm (x [M, K], w [E, K, N], offs = cumulative row ends, int32) where it runs here."""
    if not hasattr(torch, "_grouped_mm"):
        return None
    try:
        x = torch.ones(32, 64, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(2, 32, 64, device="cuda", dtype=torch.bfloat16)
        torch._grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([16, 32], device="cuda", dtype=torch.int32))
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    return lambda x, w, offs: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)


def stock_us(time_us, fn) -> float | None:
    """fn's time, or None where torch refuses the shapes (a stock kernel's limits are not ours to fix)."""
    try:
        return time_us(fn)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        print(f"torch._grouped_mm: {type(e).__name__}: {str(e)[:200]}")
        return None


def graph_us(fn, rep_ms: int) -> float | None:
    """fn's time in CUDA-graph replays, or None (said) where it does not capture."""
    try:
        return kernel_us(fn, rep_ms, graph=True)
    except RuntimeError as e:
        print(f"grouped_graph: {type(e).__name__}: {str(e)[:200]}")
        return None


def fp8_us(x, w, counts, out_dtype, rep_ms: int) -> dict:
    """The grouped block-FP8 timings of the module docstring, on x and w quantised as an FP8 MoE does."""
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT
    from onepath.ops.cuda import sm_count
    from onepath.ops.cuda.linear_fp8 import is_hopper
    from onepath.ops.cuda.linear_grouped_fp8 import GROUPED_WS_CONFIG, linear_grouped_fp8, pick_grouped_fp8_config
    from onepath.ops.cuda.quant import quantize_fp8
    from onepath.ops.linear_quant import quantize_experts

    qw, qa = quantize_experts(w, FP8_WEIGHT), quantize_fp8(x, FP8_ACT)
    sizes = torch.tensor(counts, device="cuda")
    # the Triton kernel's tile as the launcher picks it for device counts (even groups)
    rows, groups = sum(counts), len(counts)
    tile = pick_grouped_fp8_config([-(-rows // groups)] * groups, w.shape[1], sm_count(x.device))
    hopper = is_hopper(x.device)
    return dict(
        grouped_fp8=kernel_us(lambda: linear_grouped_fp8(qa, qw, counts, out_dtype), rep_ms),
        grouped_fp8_graph=graph_us(lambda: linear_grouped_fp8(qa, qw, sizes, out_dtype), rep_ms),
        quant_grouped_fp8_graph=graph_us(lambda: linear_grouped_fp8(quantize_fp8(x, FP8_ACT), qw, sizes, out_dtype),
                                         rep_ms),
        grouped_fp8_ws=kernel_us(lambda: linear_grouped_fp8(qa, qw, counts, out_dtype, config=GROUPED_WS_CONFIG),
                                 rep_ms) if hopper else None,
        grouped_fp8_ws_graph=graph_us(lambda: linear_grouped_fp8(qa, qw, sizes, out_dtype, config=GROUPED_WS_CONFIG),
                                      rep_ms) if hopper else None,
        grouped_fp8_triton_graph=graph_us(lambda: linear_grouped_fp8(qa, qw, sizes, out_dtype, config=tile), rep_ms))


def run(args) -> dict:
    from onepath.bench.roofline import hbm_peak
    from onepath.ops.cuda.linear_grouped import linear_grouped, pick_grouped_config
    from onepath.ops.cuda.linear import linear, sm_count

    time_us = lambda fn: kernel_us(fn, args.rep_ms)
    sms = sm_count(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    grouped_mm = stock_grouped_mm()
    hbm, hbm_source = hbm_peak(torch.cuda.get_device_name())
    result = dict(environment("cuda"), command="python bench/kernels_moe.py " + " ".join(sys.argv[1:]),
                  shape=dict(hidden=HIDDEN, moe_intermediate=MOE_INTERMEDIATE, experts=NUM_EXPERTS, top_k=TOP_K),
                  timing=KERNEL_TIMING + "; *_graph: CUDA graph replays (triton do_bench_cudagraph), median",
                  target_grouped_over_dense=TARGET, fp8_targets=FP8_TARGETS, hbm_bytes_per_s=hbm,
                  hbm_source=hbm_source, rows=[])
    table, fp8_table = [], []
    for tokens in args.tokens:
        counts = routed_counts(tokens, gen)
        offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
        rows = sum(counts)
        for name, n, k, out_dtype in PROJECTIONS:
            w = (torch.randn(NUM_EXPERTS, n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()
            x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
            cfg = pick_grouped_config(counts, n, x.dtype, sms, out_dtype)
            flops = 2.0 * rows * n * k
            moved = must_move(counts, n, k, out_dtype)
            roofline_us = moved / hbm * 1e6
            sizes = torch.tensor(counts, device="cuda")
            per_expert = lambda fn: [fn(p, w[e]) for e, p in enumerate(x.split(counts)) if p.shape[0]]
            us = dict(
                grouped=time_us(lambda: linear_grouped(x, w, counts, out_dtype=out_dtype)),
                dense=time_us(lambda: linear(x, w[0], out_dtype=out_dtype)),
                loop=time_us(lambda: per_expert(lambda p, we: linear(p, we, out_dtype=out_dtype))),
                cublas_loop=time_us(lambda: per_expert(F.linear)),
                torch_grouped_mm=stock_us(time_us, lambda: grouped_mm(x, w, offs)) if grouped_mm else None,
                grouped_graph=graph_us(lambda: linear_grouped(x, w, sizes, out_dtype=out_dtype), args.rep_ms),
            )
            if args.fp8:
                us.update(fp8_us(x, w, counts, out_dtype, args.rep_ms))
            tflops = {key: flops / t * 1e-6 if t else None for key, t in us.items()}
            row = dict(tokens=tokens, rows=rows, projection=name, N=n, K=k, out_dtype=str(out_dtype),
                       config=f"{cfg.block_m}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}" + " tma" * cfg.tma,
                       empty_experts=counts.count(0), max_rows_per_expert=max(counts), us=us, tflops=tflops,
                       grouped_gb_s=moved / us["grouped"] * 1e-3,
                       grouped_over_dense=tflops["grouped"] / tflops["dense"],
                       grouped_roofline_us=roofline_us,
                       grouped_fraction_of_hbm=roofline_us / us["grouped"],
                       grouped_graph_fraction_of_hbm=roofline_us / us["grouped_graph"] if us["grouped_graph"] else None,
                       grouped_over_dense_bound=us["dense"] / roofline_us)
            if args.fp8:
                fp8_roofline_us = must_move_fp8(counts, n, k, out_dtype) / hbm * 1e6
                fp8_graph, ws_graph, bf16_graph = us["grouped_fp8_graph"], us["grouped_fp8_ws_graph"], us["grouped_graph"]
                row.update(grouped_fp8_roofline_us=fp8_roofline_us,
                           grouped_fp8_fraction_of_hbm=fp8_roofline_us / fp8_graph if fp8_graph else None,
                           fp8_over_bf16=bf16_graph / fp8_graph if fp8_graph and bf16_graph else None,
                           fp8_ws_over_bf16=bf16_graph / ws_graph if ws_graph and bf16_graph else None)
            result["rows"].append(row)
            save_json(result, Path(args.out))
            table.append([str(tokens), name, row["config"], us["grouped"], us["grouped_graph"], us["dense"], us["loop"],
                          us["cublas_loop"], us["torch_grouped_mm"], tflops["grouped"], tflops["dense"],
                          row["grouped_gb_s"], row["grouped_fraction_of_hbm"], row["grouped_graph_fraction_of_hbm"],
                          row["grouped_over_dense"], row["grouped_over_dense_bound"]])
            if args.fp8:
                fp8_table.append([str(tokens), name, us["grouped_fp8"], us["grouped_fp8_graph"],
                                  us["quant_grouped_fp8_graph"], us["grouped_fp8_ws_graph"],
                                  us["grouped_fp8_triton_graph"], us["grouped_graph"], row["fp8_over_bf16"],
                                  row["fp8_ws_over_bf16"], row["grouped_fp8_fraction_of_hbm"]])
        torch.cuda.empty_cache()
    if args.fp8:
        print_table("Block-FP8 grouped expert GEMM (us: median; targets " + str(FP8_TARGETS) + ")",
                    ["tokens", "proj", "fp8 us", "fp8 graph us", "quant+fp8 graph us", "ws graph us",
                     "triton graph us", "bf16 graph us", "fp8/bf16 speed", "ws/bf16 speed", "fp8 of HBM"], fp8_table)
    print_table(f"MoE expert GEMMs, {NUM_EXPERTS} experts top-{TOP_K}, hidden {HIDDEN}, moe_intermediate "
                f"{MOE_INTERMEDIATE} (us: median; target grouped/dense >= {TARGET})",
                ["tokens", "proj", "config", "grouped us", "graph us", "dense us", "loop us", "cuBLAS loop us",
                 "_grouped_mm us", "grouped TF/s", "dense TF/s", "grouped GB/s", "of HBM", "graph of HBM",
                 "grouped/dense", "bound"], table)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/moe/kernels-moe.json")
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="tokens per call (rows = tokens x top-8)")
    p.add_argument("--rep-ms", type=int, default=200, help="do_bench time budget per measurement")
    p.add_argument("--no-fp8", dest="fp8", action="store_false", help="leave out the block-FP8 grouped timings")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("kernels_moe: no CUDA device here; nothing timed (run it on a CUDA GPU)")
        return
    run(args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
