"""The Mamba-2 scan (ops.ssd): decode's replay of the open chunk against the one-step recurrence, and prefill against
the HBM and tensor-core bounds. Nemotron-3-Nano's mixer by default (64 heads of 64, 8 groups, state 128, chunk 128).

    python bench/kernels_ssd.py [--out bench/results/ssd/kernels-ssd.json] [--graph]
    python bench/kernels_ssd.py --device cpu    # the same measurements at a tiny shape (--tiny), on the CPU

decode: B sequences each decode one token at position p = a context rounded down to the chunk, plus an offset j
in the chunk (the replay's cost follows j, not the context: the state at the chunk's start carries the rest).
  replay_us       consistent mode: the token computed by the chunk formula over the open chunk's j earlier tokens
                  (ops/cuda/ssd.py on CUDA; at j = Q - 1 the chunk closes and the boundary state is formed too)
  one_step_us     baseline mode: the stock one-step recurrence on the running state
  replay_over_one_step, and one_step_floor_us: the state read and written once a sequence at the HBM peak
  replay_bytes    what the replay must read at least: the boundary state and the open chunk's x, dt and B
prefill: T tokens in sequences of --prefill-length from position 0 (the trainer's forward, a prompt's prefill).
  us, tflops (the chunked formula's dot FLOPs: C B^T per head, W x, C S^T, and the chunk's state update),
  gb_s (x, dt, B, C read, y written, FP32), fraction_of_bound = max(bytes / HBM peak, flops / tensor peak) / us;
  one_rounding_us (CUDA, BF16): the kernel with its FP32 dot operands rounded to BF16 once (split=False), what the
  shipped hi + lo split costs; warpsW_us (--warps W ...): the kernel launched with W warps.
Timing on CUDA: triton.testing.do_bench's median (L2 flushed), or CUDA-graph replays with --graph (decode);
on the CPU the median of --reps calls. Peaks by device name (bench/roofline.py).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from onepath.bench.results import KERNEL_TIMING, environment, kernel_us, save_json
from onepath.bench.roofline import hbm_peak, tensor_peak
from onepath.numerics.spec import ExecutionSpec
from onepath.ops.spans import SeqSpans
from onepath.ops.ssd import NO_LIMIT, SSDState, ssd

NEMOTRON_3_NANO = dict(heads=64, head_dim=64, groups=8, state=128, chunk=128)
TINY = dict(heads=4, head_dim=8, groups=2, state=8, chunk=16)
DECODE_BATCHES = [1, 64, 256]
CONTEXTS = [1024, 8192]
PREFILL = [(256, 150), (16, 1024), (1, 8192)]  # (sequences, tokens each)


def spec(mode: str, device: str, chunk: int) -> ExecutionSpec:
    return ExecutionSpec.default(mode, device).with_op("ssd", chunk=chunk)


def timer(args):
    """(fn -> microseconds): do_bench or CUDA-graph replays on CUDA, the median of --reps calls on the CPU."""
    if args.device == "cuda":
        return lambda fn: kernel_us(fn, args.rep_ms, graph=args.graph)

    def cpu_us(fn):
        fn()
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6
    return cpu_us


def params(s: dict, device: str, gen: torch.Generator):
    h = s["heads"]
    return (torch.log(1 + 15 * torch.rand(h, generator=gen)).to(device), torch.ones(h, device=device),
            (torch.rand(h, generator=gen) * 4 - 6).to(device))


def tokens(s: dict, t: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    h, p, g, n = s["heads"], s["head_dim"], s["groups"], s["state"]
    return (torch.randn(t, h, p, generator=gen).to(device, dtype), torch.randn(t, h, generator=gen).to(device),
            torch.randn(t, g, n, generator=gen).to(device, dtype), torch.randn(t, g, n, generator=gen).to(device, dtype))


def decode(args, s: dict, dtype: torch.dtype, gen: torch.Generator) -> list[dict]:
    """Replay vs one-step at each batch, context and offset; the slots filled with random state."""
    rows, time_us = [], timer(args)
    q, h, p, n = s["chunk"], s["heads"], s["head_dim"], s["state"]
    peak, _ = hbm_peak(environment(args.device)["gpu"])
    for batch in args.batches:
        for context in args.contexts:
            for offset in args.offsets:
                position = context // q * q + offset
                a_log, d, dt_bias = params(s, args.device, gen)
                inputs = tokens(s, batch, dtype, args.device, gen)
                positions = torch.full((batch,), position, dtype=torch.long, device=args.device)
                slots = torch.arange(batch, device=args.device)
                row = dict(batch=batch, context=context, position=position, offset=offset)
                for mode, key in (("consistent", "replay_us"), ("baseline", "one_step_us")):
                    state = SSDState.empty(batch, h, p, s["groups"], n, q, dtype, torch.float32, args.device)
                    for t in (state.ssm, state.x, state.dt, state.B):
                        t.copy_(torch.randn(t.shape, generator=gen).abs().to(t.dtype) * 0.1)
                    sp = spec(mode, args.device, q)
                    row[key] = time_us(lambda: ssd(sp, *inputs, a_log, d, dt_bias, SeqSpans.decode(positions, slots),
                                                   state))
                state_bytes = h * p * n * 4
                row.update(replay_over_one_step=row["replay_us"] / row["one_step_us"],
                           one_step_floor_us=batch * 2 * state_bytes / peak * 1e6,
                           replay_bytes=batch * (state_bytes + offset * (h * p * dtype.itemsize + h * 4
                                                                         + s["groups"] * n * dtype.itemsize)))
                rows.append(row)
                print(f"decode B={batch:4d} context {context:6d} offset {offset:4d}: replay {row['replay_us']:9.1f} us, "
                      f"one-step {row['one_step_us']:9.1f} us ({row['replay_over_one_step']:.2f}x), "
                      f"one-step floor {row['one_step_floor_us']:.1f} us", flush=True)
    return rows


def prefill_flops(s: dict, tokens_: int, chunks: int) -> float:
    """The chunked formula's dot FLOPs: per chunk and head C B^T (Q x Q x N), W x (Q x Q x P), C S^T (Q x N x P)
    and the state update (P x Q x N)."""
    q, h, p, n = s["chunk"], s["heads"], s["head_dim"], s["state"]
    return 2.0 * chunks * h * (q * q * n + q * q * p + q * n * p + p * q * n)


def prefill(args, s: dict, dtype: torch.dtype, gen: torch.Generator) -> list[dict]:
    rows, time_us = [], timer(args)
    q = s["chunk"]
    env = environment(args.device)["gpu"]
    hbm, tensor = hbm_peak(env)[0], tensor_peak(env)[0]
    sp = spec("consistent", args.device, q)
    for seqs, length in args.prefill:
        t = seqs * length
        a_log, d, dt_bias = params(s, args.device, gen)
        inputs = tokens(s, t, dtype, args.device, gen)
        spans = SeqSpans.of([i * length for i in range(seqs + 1)], [length] * seqs, device=args.device)
        us = time_us(lambda: ssd(sp, *inputs, a_log, d, dt_bias, spans))
        flops = prefill_flops(s, t, seqs * -(-length // q))
        moved = sum(x.numel() * x.element_size() for x in inputs) + t * s["heads"] * s["head_dim"] * 4
        bound_us = max(moved / hbm, flops / tensor) * 1e6
        row = dict(sequences=seqs, length=length, tokens=t, us=us, tflops=flops / us * 1e-6, gb_s=moved / us * 1e-3,
                   hbm_bound_us=moved / hbm * 1e6, tensor_bound_us=flops / tensor * 1e6,
                   fraction_of_bound=bound_us / us)
        split = ""
        if args.device == "cuda" and dtype.itemsize == 2:  # what the split dots cost: the kernel with one rounding
            from onepath.ops.cuda.ssd import ssd as kernel
            row["one_rounding_us"] = time_us(lambda: kernel(*inputs, a_log, d, dt_bias, spans, None, q, NO_LIMIT,
                                                            torch.float32, split=False))
            split = f", one rounding {row['one_rounding_us']:.1f} us"
            for warps in args.warps:  # the scan's launch at other warp counts (its spills: lab/ssd_split.py)
                row[f"warps{warps}_us"] = time_us(lambda w=warps: kernel(*inputs, a_log, d, dt_bias, spans, None, q,
                                                                         NO_LIMIT, torch.float32, num_warps=w))
                split += f", {warps} warps {row[f'warps{warps}_us']:.1f} us"
        rows.append(row)
        print(f"prefill {seqs:4d} x {length:5d}: {us:10.1f} us, {flops / us * 1e-6:7.2f} TFLOP/s, "
              f"{moved / us * 1e-3:7.1f} GB/s, {bound_us / us:.3f} of the bound{split}", flush=True)
    return rows


def run(args) -> dict:
    s = dict(TINY if args.tiny else NEMOTRON_3_NANO)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    env = environment(args.device)
    return dict(env, command="python " + " ".join(sys.argv), shape=s, dtype=str(dtype).removeprefix("torch."),
                timing=("CUDA graph replays" if args.graph else KERNEL_TIMING) if args.device == "cuda"
                else f"median of {args.reps} calls",
                peaks=dict(hbm=hbm_peak(env["gpu"]), tensor=tensor_peak(env["gpu"])),
                decode=decode(args, s, dtype, gen), prefill=prefill(args, s, dtype, gen))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a tiny mixer (4 heads of 8, state 8, chunk 16; always on "
                   "the CPU)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help=f"decode batches (default {DECODE_BATCHES})")
    p.add_argument("--contexts", type=int, nargs="+", default=None, help=f"decode contexts (default {CONTEXTS})")
    p.add_argument("--offsets", type=int, nargs="+", default=None,
                   help="decode offsets in the chunk (default 0, 1, Q/4, Q/2, Q - 1)")
    p.add_argument("--prefill", type=lambda v: tuple(map(int, v.split("x"))), nargs="+", default=None,
                   metavar="SEQSxLEN", help=f"prefill batches (default {' '.join(f'{a}x{b}' for a, b in PREFILL)})")
    p.add_argument("--graph", action="store_true", help="CUDA: time CUDA-graph replays (no launch cost)")
    p.add_argument("--warps", type=int, nargs="*", default=[], help="CUDA: prefill also at these warp counts")
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--reps", type=int, default=5, help="CPU: calls timed")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/ssd/kernels-ssd-DEVICE.json)")
    args = p.parse_args(argv)
    args.tiny = args.tiny or args.device == "cpu"  # the CPU's torch path at Nemotron's shape would take hours
    q = (TINY if args.tiny else NEMOTRON_3_NANO)["chunk"]
    args.batches = args.batches or ([1, 4] if args.tiny else DECODE_BATCHES)
    args.contexts = args.contexts or ([2 * q] if args.tiny else CONTEXTS)
    args.offsets = args.offsets or sorted({0, 1, q // 4, q // 2, q - 1})
    args.prefill = args.prefill or ([(4, 40), (1, 100)] if args.tiny else PREFILL)
    bad = [o for o in args.offsets if not 0 <= o < q]
    if bad:
        p.error(f"--offsets {bad[0]} is outside the chunk: give offsets in [0, {q})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    out = Path(args.out or f"bench/results/ssd/kernels-ssd-{args.device}.json")
    save_json(result, out)
    print(f"wrote {out}")
    return 0
