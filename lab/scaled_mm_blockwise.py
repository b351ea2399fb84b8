"""Probe: can torch._scaled_mm run our block-FP8 W8A8 layout (activations 1x128 per token, weights 128x128) on
this GPU, and how fast against our FP8 kernel and BF16? The candidate for a realistic baseline (issue 31: users'
fast path is DeepGEMM-style blockwise FP8, not a dequantised FP32 GEMM).

For each scale layout torch might accept (the activation scales [M, K/128] row- or column-major, the weight's
[N/128, K/128] or its transpose), it calls torch._scaled_mm(a, w.t(), scale_a, scale_b, out_dtype=bfloat16) and
reports the error or the max difference against the dequantised FP32 GEMM; the accepted layout is then timed at
decode and prefill shapes against ops.cuda.linear_fp8 and F.linear in BF16. JSON on stdout (and --out).

    python lab/scaled_mm_blockwise.py --out $OUT/scaled_mm.json
    python lab/scaled_mm_blockwise.py --k-blocks      # which K the blockwise kernel gets right (text on stdout)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onepath.numerics.quant import quantize_fp8  # noqa: E402
from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT  # noqa: E402


def layouts(qa, qw):
    """Candidate (name, scale_a, scale_b) for a [M, K] x w [N, K]^T."""
    sa, sw = qa.scales.float(), qw.scales.float()
    col_major = lambda t: t.t().contiguous().t()
    return [("a col-major, w [N/128,K/128].t() (linear_quant.fp8_library_cuda)", col_major(sa), sw.t()),
            ("a col-major, 1/scales", col_major(1 / sa), (1 / sw).t()),
            ("a rows, w [N/128,K/128].t()", sa.contiguous(), sw.t()),
            ("a col-major, w [K/128,N/128] contiguous", col_major(sa), sw.t().contiguous()),
            ("a rows, w [K/128,N/128] contiguous", sa.contiguous(), sw.t().contiguous()),
            ("a col-major, w [N/128,K/128]", col_major(sa), sw.contiguous())]


def time_us(fn, repeats=50):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats * 1e3


def k_blocks() -> None:
    """Per (N, K) and weight-scale layout, the blockwise product's max |difference| / max |value| against the
    dequantised FP32 GEMM at M = 64, or the library's refusal: cur (the weight's scales transposed, what
    linear_quant.fp8_library_cuda passed before it widened K), padded-ld (columns padded to a multiple of 4),
    rowmajor, and widened (K widened with zero codes to linear_quant.scaled_mm_k(K), as fp8_library_cuda now does)."""
    from onepath.ops import linear_quant as LQ
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((1024, 2816), (1024, 1152), (1024, 1536), (256, 2304)):
        qw = quantize_fp8(torch.randn(n, k, generator=g, device="cuda") * 0.05, FP8_WEIGHT)
        qa = quantize_fp8(torch.randn(64, k, generator=g, device="cuda").bfloat16(), FP8_ACT)
        want = LQ.dequantized_gemm(qa, qw, None).float()
        kb, sa = k // 128, qa.scales.t().contiguous().t()
        buf = torch.ones(n // 128, kb + (-kb % 4), device="cuda")
        buf[:, :kb] = qw.scales
        wide = LQ.scaled_mm_k(k)
        wa, ww = LQ.widened(qa, wide), LQ.widened(qw, wide)
        cases = (("cur", qa.codes, qw.codes, sa, qw.scales.t()), ("padded-ld", qa.codes, qw.codes, sa, buf[:, :kb].t()),
                 ("rowmajor", qa.codes, qw.codes, sa, qw.scales.t().contiguous()),
                 ("widened", wa.codes, ww.codes, wa.scales.t().contiguous().t(), ww.scales.t()))
        for name, a, w, scale_a, scale_b in cases:
            try:
                got = torch._scaled_mm(a, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16).float()
                print(n, k, name, float((got - want).abs().max() / want.abs().max()), flush=True)
            except RuntimeError as e:
                print(n, k, name, type(e).__name__, str(e).splitlines()[0][:100], flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--k-blocks", action="store_true", help="only the K sweep (k_blocks)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    if args.k_blocks:
        k_blocks()
        return 0
    from onepath.ops.cuda.linear_fp8 import linear_fp8
    from onepath.ops.cuda.quant import quantize_fp8 as quantize_fp8_cuda
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "probe": [], "timings": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, n, k = 96, 1024, 2048
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.05
    qa, qw = quantize_fp8(x, FP8_ACT), quantize_fp8(w, FP8_WEIGHT)
    want = F.linear(qa.dequantize(), qw.dequantize())
    chosen = None  # the index of the first layout that gives the dequantised GEMM's values
    for name, sa, sb in layouts(qa, qw):
        row = {"layout": name}
        try:
            got = torch._scaled_mm(qa.codes, qw.codes.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            row["max_abs_diff"] = (got.float() - want).abs().max().item()
            row["ok"] = row["max_abs_diff"] < 0.05 * want.abs().max().item()
            if row["ok"] and chosen is None:
                chosen = len(out["probe"])
        except Exception as e:  # noqa: BLE001: the probe records what torch refuses
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        out["probe"].append(row)
        print(json.dumps(row), flush=True)
    for m, n, k in ((1, 4096, 4096), (64, 4096, 4096), (256, 6144, 4096), (4096, 4096, 4096)):
        x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.05
        qw = quantize_fp8(w, FP8_WEIGHT)
        row = {"m": m, "n": n, "k": k,
               "bf16_us": time_us(lambda: F.linear(x, w)),
               "ours_fp8_us (quantise + gemm)": time_us(lambda: linear_fp8(quantize_fp8_cuda(x, FP8_ACT), qw, None,
                                                                           torch.bfloat16))}
        if chosen is not None:
            sb = layouts(quantize_fp8(x, FP8_ACT), qw)[chosen][2]

            def scaled():
                qa = quantize_fp8_cuda(x, FP8_ACT)
                sa = layouts(qa, qw)[chosen][1]
                return torch._scaled_mm(qa.codes, qw.codes.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            row["scaled_mm_us (quantise + gemm)"] = time_us(scaled)
            qa = quantize_fp8_cuda(x, FP8_ACT)
            sa = layouts(qa, qw)[chosen][1]
            row["scaled_mm_gemm_only_us"] = time_us(lambda: torch._scaled_mm(qa.codes, qw.codes.t(), scale_a=sa,
                                                                             scale_b=sb, out_dtype=torch.bfloat16))
            row["ours_gemm_only_us"] = time_us(lambda: linear_fp8(qa, qw, None, torch.bfloat16))
        out["timings"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
