"""onepath.ops.cuda.attention_kv (the K/V write, plain and FP8) run by Triton's CPU interpreter (TRITON_INTERPRET=1).

k and v as strided views of a stacked projection, scattered slots. The plain write equals index_put; the FP8 write
(FP8_KV, per token and head) equals torch's quantise-then-index-put, with the interpreter's FP32 -> e4m3 cast made
torch's round-to-nearest-even (tests/interpret.py patch_fp8_rounding; Hopper's cvt.rn.satfinite rounds so).
The checks run in a subprocess (tests/interpret.py); the bits of Hopper's arithmetic are
tests/ops/test_attention_gpu.py's job.
"""
from __future__ import annotations

from tests.interpret import (check_recorder, fp8_spread, interpreted_checks, kernel_case_tools, patch_bf16_rounding,
                              patch_fp8_rounding, print_checks, same_fp8)

CHECKS = ["write_kv_equals_index_put", "write_kv_fp8_equals_torch", "write_kv_fp8_other_rule_differs"]


def _run_checks() -> dict:
    patch_bf16_rounding()
    patch_fp8_rounding()
    import math
    from dataclasses import replace

    import torch

    from onepath.numerics import quant as torch_quant
    from onepath.numerics.spec import FP8_KV
    from onepath.ops.cuda import attention_kv

    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()
    rand, close, embedded = kernel_case_tools(gen)

    dim = 24
    # write_kv: k and v as strided views of a stacked projection, 3 KV heads of D = 24, 6 tokens to scattered slots.
    kv = rand(6, 7, dim)
    k, v = kv[:, 1:4], kv[:, 4:7]
    slots = torch.tensor([5, 0, 17, 9, 30, 2])
    caches = [torch.zeros(4, 8, 3, dim, dtype=torch.bfloat16) for _ in range(4)]
    attention_kv.write_kv(caches[0], caches[1], k, v, slots)
    for cache, x in ((caches[2], k), (caches[3], v)):
        cache.view(-1, 3, dim)[slots] = x
    record("write_kv_equals_index_put", torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]),
           "caches differ from index_put's")

    # write_kv_fp8: per token and head (FP8_KV), k and v strided views of a stacked projection, scattered
    # slots, one head poisoned by inf / NaN, one all zero; the caches equal torch's quantise-then-index-put
    for heads, dim in ((3, 24), (2, 128)):
        # FP8_KV (ue8m0 scales, amax ceiling 448 * 2^7) and FP32 scales without a ceiling, by division
        for rule in (FP8_KV, replace(FP8_KV, scale_dtype="fp32", amax_ceil=None, scale_apply="divide")):
            tokens, blocks, block_size = 6, 4, 4
            stacked = fp8_spread(gen, tokens, 3 * heads * dim, dtype=torch.bfloat16)
            k = stacked[:, heads * dim:2 * heads * dim].view(tokens, heads, dim)
            v = stacked[:, 2 * heads * dim:].view(tokens, heads, dim)
            stacked[1, heads * dim + 5], stacked[2, 2 * heads * dim] = math.inf, math.nan
            stacked[3, heads * dim:heads * dim + dim] = 0.0
            slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]

            def cache():
                return torch_quant.FP8Tensor(torch.zeros(blocks, block_size, heads, dim).to(torch.float8_e4m3fn),
                                             torch.full((blocks, block_size, heads, 1), -1.0), (1, dim))

            got_k, got_v, want_k, want_v = cache(), cache(), cache(), cache()
            attention_kv.write_kv_fp8(got_k, got_v, k, v, slots, rule)
            for c, x in ((want_k, k), (want_v, v)):
                fp8 = torch_quant.quantize_fp8(x, rule)
                c.codes.view(-1, heads, dim)[slots] = fp8.codes
                c.scales.view(-1, heads, 1)[slots] = fp8.scales
            record("write_kv_fp8_equals_torch", same_fp8(got_k, want_k) and same_fp8(got_v, want_v)
                   and int(got_k.scales.isnan().sum() + got_v.scales.isnan().sum()) == 2, f"Hkv {heads} D {dim}")
            if rule is FP8_KV:  # control: the kernel under the other rule does not match this one's cache
                other_k, other_v = cache(), cache()
                attention_kv.write_kv_fp8(other_k, other_v, k, v, slots, replace(FP8_KV, scale_dtype="fp32", amax_ceil=None))
                record("write_kv_fp8_other_rule_differs", not same_fp8(other_k, want_k), f"Hkv {heads} D {dim}")
    return results


interpreted, test_attention_kv_interpreted = interpreted_checks(__file__, "attention_kv", CHECKS)


if __name__ == "__main__":
    print_checks(_run_checks)
