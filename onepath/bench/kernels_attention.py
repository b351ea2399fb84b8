"""Time onepath.ops.cuda.attention (paged, batch-invariant) against torch SDPA flash on dense K/V.

    python bench/kernels_attention.py [--out bench/results/attention/kernels-attention.json] [--variants V ...] [--graph]

Decode: B sequences x context L, one query each, Qwen3-0.6B heads (H 16, Hkv 8, D 128), bf16, block 16,
random non-contiguous block tables (--kv fp8: an FP8 cache, the spec's FP8_KV, codes and per-token power-of-two
scales; fp8_fp32: the same with FP32 scales, dequantised by an FP32 product;
--max-context: the split-KV grid sized as an engine's graphs size it); ours with the split-KV launch and the
in-register launch, vs SDPA flash (Lq = 1) on dense, GQA-expanded K/V (no paging cost, no invariance):
median microseconds, GB/s of the K/V a step must read. Prefill: B x L causal tokens, ours vs SDPA flash
(is_causal), TFLOP/s. --variants times other settings (q_rows, kv_tile, kv_split, num_warps give other bits:
for choosing the contract; num_stages, decode_program and table_asm move none; "default" decodes on the 16-row
decode program); --graph times CUDA graph replays. Without CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


from onepath.bench.results import KERNEL_TIMING, environment, kernel_us, save_json

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16
DECODE_BATCH = [1, 8, 32, 64, 128, 256]
DECODE_CONTEXT = [512, 1024, 2048, 4096]
PREFILL = [(8, 2048), (4, 4096), (1, 8192), (32, 512)]
CEILINGS = {"bf16_gemm_tflops_cublas_8192": 789, "device_copy_tb_s": 4.2}


def _paged(lengths, gen):
    """A paged bf16 cache holding `lengths` tokens per sequence in shuffled blocks, and the dense copy."""
    blocks = [-(-n // BLOCK) for n in lengths]
    perm = torch.randperm(sum(blocks), device="cuda", generator=gen)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32, device="cuda")
    at = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = perm[at:at + n]
        at += n
    shape = (sum(blocks), BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    v_cache = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    return k_cache, v_cache, tables


def _dense(cache, tables, length):
    """[B, H, L, D] for SDPA: the paged K or V gathered and expanded to the query heads."""
    j = torch.arange(length, device="cuda")
    slots = tables[:, j // BLOCK].long() * BLOCK + j % BLOCK
    x = cache.view(-1, KV_HEADS, HEAD_DIM)[slots]                         # [B, L, Hkv, D]
    return x.repeat_interleave(HEADS // KV_HEADS, dim=2).transpose(1, 2).contiguous()


def _inputs(batch, length, queries, gen, kv="bf16"):
    """B sequences of `length` cached tokens, the last `queries` of each attending: q, the paged cache with
    the queries' positions, sequences and block tables (the paged_attention arguments, in order), and the
    dense K/V for SDPA (with kv="fp8" the cache is quantised, FP8_KV, and the dense K/V its dequantised values;
    kv="fp8_fp32": FP8_KV with FP32 scales and no amax ceiling)."""
    k_cache, v_cache, tables = _paged([length] * batch, gen)
    if kv != "bf16":
        from dataclasses import replace

        from onepath.numerics.quant import quantize_fp8
        from onepath.numerics.spec import FP8_KV
        rule = FP8_KV if kv == "fp8" else replace(FP8_KV, scale_dtype="fp32", amax_ceil=None)
        k_cache, v_cache = quantize_fp8(k_cache, rule), quantize_fp8(v_cache, rule)
        kd, vd = (_dense(c.dequantize(torch.bfloat16), tables, length) for c in (k_cache, v_cache))
    else:
        kd, vd = _dense(k_cache, tables, length), _dense(v_cache, tables, length)
    q = torch.randn(batch * queries, HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    positions = torch.arange(length - queries, length, device="cuda").repeat(batch)
    seqs = torch.arange(batch, device="cuda").repeat_interleave(queries)
    return q, k_cache, v_cache, positions, seqs, tables, kd, vd


def _flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


VARIANT_KEYS = {"q_rows": "block_m", "kv_tile": "kv_tile", "kv_split": "kv_split", "num_warps": "num_warps",
                "num_stages": "num_stages", "decode_program": "decode_program", "q_block": "q_block",
                "table_asm": "table_asm"}


def parse_variant(text: str) -> tuple[str, dict]:
    """"q_rows=16,kv_tile=64" -> ("q_rows=16,kv_tile=64", paged_attention keywords); "default" -> the defaults.
    Other kv_tile, kv_split, q_rows or num_warps give other bits: for choosing the contract, not interchangeable
    with the default; num_stages, decode_program (0: the 64-row program for decode rows too) and table_asm
    (0: the program reads its block table with tl.load) move no bit, nor is q_block (positions per program, e.g. q_rows=128,num_warps=8,q_block=64) meant to."""
    if text == "default":
        return text, {}
    kw = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in VARIANT_KEYS or not value.isdigit():
            raise SystemExit(f"kernels_attention: variant item {item!r} is not NAME=INT with NAME one of "
                             f"{', '.join(VARIANT_KEYS)} (e.g. q_rows=16,kv_tile=64)")
        kw[VARIANT_KEYS[name]] = bool(int(value)) if name in ("decode_program", "table_asm") else int(value)
    return text, kw


def _call(A, kw, *a, **call_kw):
    """paged_attention with a variant's settings."""
    return A.paged_attention(*a, **{"kv_tile": 32, **kw, **call_kw})


def _timer(args, fn):
    """fn's time; with --graph, a CUDA graph of fn with the query blocks computed before (as the engine
    computes them once per step for all layers), so no launch cost is counted."""
    return kernel_us(fn, args.rep_ms, graph=args.graph)


def decode(args, A, gen):
    rows = []
    print(f"{'decode B':>8s} {'L':>5s} {'variant':>18s} {'launch':>12s} {'us':>8s} {'flash us':>8s} "
          f"{'speed':>6s} {'GB/s':>6s}")
    for length in args.contexts:
        for batch in args.batches:
            q, k_cache, v_cache, positions, seqs, tables, kd, vd = _inputs(batch, length, 1, gen, args.kv)
            scale = HEAD_DIM ** -0.5
            qd = q[:, :, None]
            flash = kernel_us(lambda: _flash(qd, kd, vd, False), args.rep_ms)
            ref = _flash(qd, kd, vd, False)[:, :, 0].float()
            # bytes a step must read: K and V per token and head, codes and an FP32 scale for an FP8 cache
            moved = 2 * batch * length * KV_HEADS * (HEAD_DIM + 4 if args.kv != "bf16" else HEAD_DIM * 2)
            for name, kw in map(parse_variant, args.variants):
                for launch, split in (("split-KV", True), ("in-register", False)):
                    derived = {}
                    fn = lambda: _call(A, kw, q, k_cache, v_cache, positions, seqs, tables, scale,
                                       split_kv=split, max_context=max(length, args.max_context), derived=derived)
                    fn()
                    us = _timer(args, fn)
                    err = (fn().float() - ref).abs().max().item()
                    rows.append(dict(batch=batch, context=length, max_context=max(length, args.max_context), kv=args.kv,
                                     variant=name, launch=launch, us=us,
                                     flash_us=flash, speed_vs_flash=flash / us, gb_s=moved / us * 1e-3,
                                     max_abs_diff_vs_flash=err))
                    print(f"{batch:8d} {length:5d} {name:>18s} {launch:>12s} {us:8.1f} {flash:8.1f} "
                          f"{flash / us:6.2f} {moved / us * 1e-3:6.0f}", flush=True)
            del k_cache, v_cache, kd, vd
            torch.cuda.empty_cache()
    return rows


def prefill(args, A, gen):
    rows = []
    print(f"{'prefill':>13s} {'variant':>18s} {'us':>9s} {'flash us':>9s} {'speed':>6s} {'TF/s':>6s} "
          f"{'flash TF/s':>10s}")
    for batch, length in PREFILL:
        q, k_cache, v_cache, positions, seqs, tables, kd, vd = _inputs(batch, length, length, gen)
        scale = HEAD_DIM ** -0.5
        qd = q.view(batch, length, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        flash = kernel_us(lambda: _flash(qd, kd, vd, True), args.rep_ms)
        ref = _flash(qd, kd, vd, True).transpose(1, 2).reshape(-1, HEADS, HEAD_DIM).float()
        flops = 4.0 * batch * length * (length + 1) / 2 * HEADS * HEAD_DIM
        for name, kw in map(parse_variant, args.variants):
            derived = {}
            fn = lambda: _call(A, kw, q, k_cache, v_cache, positions, seqs, tables, scale, max_context=length,
                               derived=derived)
            fn()
            us = _timer(args, fn)
            err = (fn().float() - ref).abs().max().item()
            rows.append(dict(batch=batch, length=length, variant=name, us=us, flash_us=flash,
                             speed_vs_flash=flash / us, tflops=flops / us * 1e-6, flash_tflops=flops / flash * 1e-6,
                             max_abs_diff_vs_flash=err))
            print(f"{batch:4d} x {length:5d}  {name:>18s} {us:9.1f} {flash:9.1f} {flash / us:6.2f} "
                  f"{flops / us * 1e-6:6.1f} {flops / flash * 1e-6:10.1f}", flush=True)
        del k_cache, v_cache, kd, vd
        torch.cuda.empty_cache()
    return rows


def run(args) -> dict:
    from onepath.ops.cuda import attention as A

    gen = torch.Generator(device="cuda").manual_seed(0)
    decode_rows = [] if args.no_decode else decode(args, A, gen)
    prefill_rows = [] if args.no_prefill else prefill(args, A, gen)
    return dict(
        environment("cuda"), sms=torch.cuda.get_device_properties(0).multi_processor_count,
        command="python " + " ".join(sys.argv),
        timing=("CUDA graph replays (triton.testing.do_bench_cudagraph median, no L2 flush), query blocks "
                "computed once before capture" if args.graph else KERNEL_TIMING),
        shape=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK, dtype="bfloat16"),
        contract=dict(kv_tile=32, kv_split=inspect.signature(A.paged_attention).parameters["kv_split"].default,
                      num_warps=A.NUM_WARPS, block_m=A.BLOCK_M),
        kv=args.kv, ceilings=CEILINGS, decode=decode_rows, prefill=prefill_rows,
    )


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/attention/kernels-attention.json")
    p.add_argument("--variants", nargs="+", default=["default"],
                   help="settings to time, each 'default' or NAME=INT[,NAME=INT...] with NAME in "
                        "q_rows, kv_tile, kv_split, num_warps, num_stages, decode_program, q_block, table_asm "
                        "(e.g. q_rows=16,kv_tile=64; decode_program=0: decode rows on the 64-row program; "
                        "q_rows=128,num_warps=8,q_block=64)")
    p.add_argument("--graph", action="store_true", help="time CUDA graph replays (no launch cost)")
    p.add_argument("--kv", choices=("bf16", "fp8", "fp8_fp32"), default="bf16",
                   help="the decode cache (prefill stays BF16): fp8 FP8_KV's, fp8_fp32 the same with FP32 scales")
    p.add_argument("--no-prefill", action="store_true", help="decode only")
    p.add_argument("--no-decode", action="store_true", help="prefill only")
    p.add_argument("--max-context", type=int, default=0,
                   help="decode's max_context when above the context (the engine's graphs pass max_model_len): "
                        "the split-KV grid's size")
    p.add_argument("--batches", type=int, nargs="+", default=DECODE_BATCH)
    p.add_argument("--contexts", type=int, nargs="+", default=DECODE_CONTEXT)
    p.add_argument("--rep-ms", type=int, default=50, help="do_bench time budget per measurement")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_attention: no CUDA device here; nothing timed (run it on a CUDA GPU)")
        return
    save_json(run(args), Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
