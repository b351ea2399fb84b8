"""Which attention programs give a query the bits of the 64-row four-warp (wgmma) program? On the GPU.

    python lab/attention_program_bits.py [--fp8-kv] [--stages 2 3] [> lab/results/attention-decode-program-bits.log]

A 700-token sequence (BF16, paged cache, random block tables) runs as one whole prefill on the 64-row
program (the reference) and then, for each (rows, warps) program, as a prefill and as 700 decode steps,
both launches (in-register, split-KV); each line counts the tokens whose output differs from the
reference. Qwen3-0.6B heads (16/8, D 128), GQA 8 (32/4) and D 64 (8/4); kv_tile 32 and 64. Programs whose
warps hold 16 whole rows each (one warp: 16 or 32 rows) keep the bits; two warps split the key columns
and do not. 128 rows on 8 warps is a prefill candidate (fewer K/V re-reads), not measured yet. tests/ops/test_attention_gpu.py asserts the decode program's case. --fp8-kv runs the same over
an FP8 cache (FP8_KV: codes and per-token scales, dequantised in the kernel); --stages adds the one-warp
programs at other pipeline depths (the reference keeps the 64-row program's).
"""
from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from tests.ops.test_attention_interpret import PagedCache, phases  # noqa: E402

DEVICE, DTYPE, N = "cuda", torch.bfloat16, 700
# (rows, warps); 128 rows on 8 warps (two wgmma warpgroups, 16 whole rows per warp): a prefill candidate
PROGRAMS = ((16, 1), (16, 2), (32, 1), (32, 2), (64, 4), (128, 8))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fp8-kv", action="store_true", help="an FP8 KV cache (the fp8_kv preset's rule)")
    p.add_argument("--stages", type=int, nargs="*", default=[], help="also the one-warp programs at these depths")
    p.add_argument("--quick", action="store_true", help="Qwen3-0.6B heads and kv_tile 32 only")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("attention_program_bits: no CUDA device here; nothing run (run it on the GPU machine)")
        return
    from onepath.numerics.spec import FP8_KV
    from onepath.ops.cuda.attention import NUM_STAGES, paged_attention

    programs = [(rows, warps, None) for rows, warps in PROGRAMS]
    programs += [(rows, 1, stages) for stages in args.stages for rows in (16, 32)]
    kv = FP8_KV if args.fp8_kv else None

    gen, cuda_gen = torch.Generator().manual_seed(0), torch.Generator(DEVICE).manual_seed(0)
    for kv_tile in (32,) if args.quick else (32, 64):
        shapes = ((16, 8, 128), (32, 4, 128), (8, 4, 64)) if kv_tile == 32 and not args.quick else ((16, 8, 128),)
        for heads, kv_heads, dim in shapes:
            q, k, v = (torch.randn(N, h, dim, generator=cuda_gen, device=DEVICE).to(DTYPE)
                       for h in (heads, kv_heads, kv_heads))

            def run(sizes, rows, warps, stages, **kw):
                cache = PagedCache(-(-N // 16) + 9, kv_heads, dim, DTYPE, DEVICE, gen, kv=kv)
                attn = partial(paged_attention, kv_tile=kv_tile, block_m=rows, num_warps=warps, decode_program=False,
                               num_stages=stages or NUM_STAGES)
                return phases(attn, q, k, v, sizes, cache, dim ** -0.5, **kw)

            ref = run([N], 64, 4, None)
            for rows, warps, stages in programs:
                for name, sizes in (("decode", [1] * N), ("prefill", [N])):
                    for split in (False, True):
                        differ = int((run(sizes, rows, warps, stages, split_kv=split) != ref).any(dim=(1, 2)).sum())
                        depth = f" stages {stages}" if stages else ""
                        print(f"{'fp8 kv ' if kv else ''}kv_tile {kv_tile} shape {(heads, kv_heads, dim)} rows {rows} "
                              f"warps {warps}{depth} {name:8s} split {split!s:5s}: {differ} of {N} tokens differ "
                              f"from (64,4) prefill", flush=True)


if __name__ == "__main__":
    main()
