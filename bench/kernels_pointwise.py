"""Bandwidth benchmark of RMSNorm, SiLU-mul, RoPE, log-probs and the sampler: ours vs the stock torch path vs
the HBM bound.

The bound is bytes moved / the measured device-copy ceiling (GPU.md: about 4.2 TB/s read+write on the H200).
The sampler rows run the engine's whole sampler as ModelRunner calls it (keys a host list), FP32 logits
without top-k/top-p: fused (ops.sample_with_logprobs) and as three calls (ops.probs -> ops.sample ->
ops.token_logprobs); their bytes are one read of the logits, the least any sampler moves. Stock: softmax,
torch.multinomial, log_softmax.
Run on the GPU: `python bench/kernels_pointwise.py --out bench/results/pointwise/kernels-pointwise.json` (--graph: CUDA
graph replays, without the launch cost that dominates the small rows; each row says how it was timed).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

COPY_TB_S = 4.2
ROWS = (1, 64, 256, 4096, 16384)


def _time_us(fn, args) -> tuple[float, str]:
    """fn's median microseconds and how they were taken: with --graph, CUDA graph replays (no launch cost,
    as the engine's decode runs), falling back to eager launches where fn cannot be captured."""
    from onepath.bench.results import kernel_us
    if args.graph:
        try:
            return kernel_us(fn, args.rep_ms, graph=True), "graph"
        except Exception:  # noqa: BLE001 - e.g. a host-to-device copy of pageable memory inside fn
            torch.cuda.synchronize()
    return kernel_us(fn, args.rep_ms), "eager"


def _stock_sampler(logits, temperature):
    x = logits / temperature[:, None]
    tokens = torch.multinomial(torch.softmax(x, dim=-1), 1)[:, 0]
    return tokens, torch.log_softmax(x, dim=-1).gather(-1, tokens[:, None])[:, 0]


def cases(m: int):
    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops import Ops
    from onepath.ops import logprobs as LP
    from onepath.ops import rmsnorm as RN
    from onepath.ops import rope as RP
    from onepath.ops import silu_mul as SM
    from onepath.ops.cuda import logprobs, rmsnorm, rope, silu_mul
    g = torch.Generator(device="cuda").manual_seed(m)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    hidden, inter, heads, head_dim, vocab = 1024, 3072, 16, 128, 151936
    x, w = torch.randn(m, hidden, generator=g, **bf16), torch.randn(hidden, generator=g, **bf16)
    gate, up = torch.randn(m, inter, generator=g, **bf16), torch.randn(m, inter, generator=g, **bf16)
    q = torch.randn(m, heads, head_dim, generator=g, **bf16)
    pos = torch.randint(0, 4096, (m,), device="cuda", generator=g)
    ang = torch.rand(4096, head_dim // 2, device="cuda", generator=g)
    cos, sin = ang.cos(), ang.sin()
    logits = torch.randn(m, vocab, generator=g, device="cuda")
    tokens = torch.randint(0, vocab, (m,), device="cuda", generator=g)
    temp = torch.ones(m, device="cuda")
    yield ("rmsnorm 1024", 2 * x.numel() * 2 + w.numel() * 2,
           lambda: rmsnorm.rmsnorm(x, w, 1e-6), lambda: RN.reference(x, w, 1e-6))
    yield ("silu_mul 3072", 3 * gate.numel() * 2,
           lambda: silu_mul.silu_mul(gate, up), lambda: SM.reference(gate, up))
    yield ("rope 16x128", 2 * q.numel() * 2 + m * head_dim * 4,
           lambda: rope.rope(q, pos, cos, sin), lambda: RP.reference(q, cos[pos], sin[pos]))
    if m <= 4096:
        ops, keys = Ops(ExecutionSpec.default("consistent", "cuda")), list(range(m))
        yield ("logprobs V=151936 fp32", logits.numel() * 4,
               lambda: logprobs.token_logprobs(logits, tokens, temp, None),
               lambda: LP.reference(logits, tokens, temp, None))
        yield ("sampler fused V=151936", logits.numel() * 4,
               lambda: ops.sample_with_logprobs(logits, temp, keys), lambda: _stock_sampler(logits, temp))
        yield ("sampler 3 calls V=151936", logits.numel() * 4,
               lambda: ops.token_logprobs(logits, ops.sample(ops.probs(logits, temp), keys), temp),
               lambda: _stock_sampler(logits, temp))


def run(args) -> dict:
    rows = []
    print(f"{'op':<26} {'M':>6} {'ours us':>9} {'stock us':>9} {'vs stock':>8} {'ours GB/s':>10} {'of bound':>8}")
    for m in args.rows:
        for name, nbytes, ours, stock in cases(m):
            if args.ops and not name.startswith(tuple(args.ops)):
                continue
            (t_ours, how_ours), (t_stock, how_stock) = _time_us(ours, args), _time_us(stock, args)
            gbs = nbytes / t_ours / 1e3
            row = dict(op=name, M=m, bytes=nbytes, ours_us=t_ours, stock_us=t_stock, speed_vs_stock=t_stock / t_ours,
                       ours_gb_s=gbs, fraction_of_bound=gbs / (COPY_TB_S * 1e3), ours_timing=how_ours,
                       stock_timing=how_stock)
            rows.append(row)
            print(f"{name:<26} {m:>6} {t_ours:>9.1f} {t_stock:>9.1f} {row['speed_vs_stock']:>8.2f} {gbs:>10.0f} "
                  f"{row['fraction_of_bound']:>8.2f}")
    import triton
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, command=" ".join(["python"] + sys.argv),
                timing=("CUDA graph replays (do_bench_cudagraph median) where capturable, else eager"
                        if args.graph else "triton.testing.do_bench median"),
                bound=f"bytes / {COPY_TB_S} TB/s device copy", rows=rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/pointwise/kernels-pointwise.json")
    p.add_argument("--rows", type=int, nargs="+", default=ROWS)
    p.add_argument("--rep-ms", type=int, default=50)
    p.add_argument("--graph", action="store_true", help="time CUDA graph replays (no launch cost)")
    p.add_argument("--ops", nargs="+", help="only the ops whose name starts with one of these (e.g. logprobs sampler)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("kernels_pointwise: no CUDA device here; nothing timed (run it on a CUDA GPU)")
        return
    with open(args.out, "w") as f:
        json.dump(run(args), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
