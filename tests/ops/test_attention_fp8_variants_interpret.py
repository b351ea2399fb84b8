"""bench/attention_fp8_variants.py's kernel on CPU: every dequantisation variant computes the shipped FP8
cache's numbers, and builds for sm_90 with the MMA operand layout the bench expects of it.

Interpreted (TRITON_INTERPRET=1, tiny shapes, one sequence of 40 tokens over a cache holding every e4m3 code
but NaN, subnormals and -0 included): each same-definition variant's 64-row and one-warp programs, in
prefill and decode and both launches, give the shipped kernel's bits (paged_attention, 64-row) under
tests/interpret.py's exact dot model. The model's dot is row- and layout-independent, so this checks
the formulations (byte extraction, the integer e4m3 decoder, the transposes), not Hopper's MMA order:
that is the GPU bench's question. The alternative "scale after the dot" must differ from the shipped
bits (the negative control: the equality can fail) yet stay close. The debug build's first-tile scores
equal a float64 recomputation, and it moves no output bit. The inline-asm variants cannot be interpreted:
they are only built.
Built for sm_90 (the wheel's ptxas, no GPU): the one-warp program runs mma.sync with the dot operand kWidth
the variant declares (4 where the 8-bit load shows through the dequantisation, 2 where it does not), the
64-row program wgmma, both within the shared memory of an H200.
"""
from __future__ import annotations

import os

import pytest

from tests.interpret import SM90_SHARED_BYTES, check_recorder, interpreted_checks, print_checks

HEADS, KV_HEADS, HEAD_DIM, BLOCK, KV_TILE, KV_SPLIT, N = 4, 2, 16, 16, 16, 32, 40
DECODED = [0, 1, 15, 16, 31, 32, 33, 39]  # the decode launch's tokens: both sides of a tile and a split edge


def _inputs(gen):
    """q [N, H, D] bf16; K and V FP8 caches of exactly the sequence's blocks (shuffled), whose first block
    holds the 254 non-NaN codes in order, then random codes; random per-token scales; the prefill launch
    and, in one launch, the decodes of the DECODED tokens (one-token sequences sharing the table)."""
    import torch

    from onepath.numerics.quant import FP8Tensor

    blocks = -(-N // BLOCK)
    allowed = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)

    def cache():
        index = torch.randint(0, allowed.numel(), (blocks * BLOCK * KV_HEADS * HEAD_DIM,), generator=gen)
        index[:allowed.numel()] = torch.arange(allowed.numel())
        codes = allowed[index].view(torch.float8_e4m3fn).view(blocks, BLOCK, KV_HEADS, HEAD_DIM)
        scales = 0.005 * torch.exp(0.5 * torch.randn(blocks, BLOCK, KV_HEADS, 1, generator=gen))
        return FP8Tensor(codes, scales, (1, HEAD_DIM))

    k_cache, v_cache = cache(), cache()
    q = torch.randn(N, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    table = torch.randperm(blocks, generator=gen).to(torch.int32)[None]
    decoded = torch.tensor(DECODED)
    return (q, k_cache, v_cache, (torch.arange(N), torch.zeros(N, dtype=torch.int64), table),
            (decoded, torch.arange(len(DECODED)), table.expand(len(DECODED), -1).contiguous()), table[0])


def _first_tile_scores(q, k_cache, table, qk_scale):
    """Each (token, head)'s scores over keys 0..KV_TILE-1 as the kernel forms them under the exact dot
    model: the float64 dot of q and the dequantised bf16 key rounded once to fp32, times qk_scale in fp32,
    -inf past the token's position."""
    import torch

    j = torch.arange(KV_TILE)
    slots = table[j // BLOCK].long() * BLOCK + j % BLOCK
    k = k_cache.dequantize(torch.bfloat16).view(-1, KV_HEADS, HEAD_DIM)[slots]             # [J, Hkv, D]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)                                      # [J, H, D]
    s = torch.einsum("thd,jhd->thj", q.double(), k.double()).float() * torch.tensor(qk_scale, dtype=torch.float32)
    return torch.where(j[None, None, :] <= torch.arange(N)[:, None, None], s, float("-inf"))


def _interpretable():
    from bench.attention_fp8_variants import ASM_BARRIER, ASM_PURE, VARIANTS
    return [v for v in VARIANTS if v.form not in (ASM_PURE.value, ASM_BARRIER.value)]


def _run_checks() -> dict:
    import torch

    from tests.interpret import patch_gemm_interpreter

    patch_gemm_interpreter()

    from bench.attention_fp8_variants import PROGRAMS, VARIANTS, attend, compare, locate
    from onepath.ops.cuda.attention import LOG2E, paged_attention

    gen = torch.Generator().manual_seed(0)
    q, k_cache, v_cache, prefill, decode, table = _inputs(gen)
    scale = HEAD_DIM ** -0.5
    shipped = paged_attention(q, k_cache, v_cache, *prefill, scale, kv_tile=KV_TILE, kv_split=KV_SPLIT,
                              split_kv=False, decode_program=False)
    results, record = check_recorder()

    def run(v, launch, program, **kw):
        """[out, first-tile scores, first-tile P V] by token (NaN for tokens a decode launch leaves out)."""
        decoding = launch is decode
        got = attend(v, q[DECODED] if decoding else q, k_cache, v_cache, *launch, scale, program == "one-warp",
                     kv_tile=KV_TILE, kv_split=KV_SPLIT, **kw)[:3]
        if not decoding:
            return list(got)
        full = [None if t is None else torch.full((N, *t.shape[1:]), torch.nan, dtype=t.dtype) for t in got]
        for f, t in zip(full, got):
            if t is not None:
                f[DECODED] = t
        return full

    for v in _interpretable():
        outs = {f"{program} {phase}": run(v, launch, program)[0]
                for program in PROGRAMS for phase, launch in (("prefill", prefill), ("decode", decode))}
        outs["one-warp decode, split-KV"] = run(v, decode, "one-warp", split=True)[0]
        outs["64-row prefill, split-KV"] = run(v, prefill, "64-row", split=True)[0]
        ref = outs["64-row prefill"]
        for name, out in outs.items():
            rows = DECODED if "decode" in name else slice(None)
            record(v.name, torch.equal(out[rows], ref[rows]),
                   f"{name} != its 64-row prefill: {compare(ref[rows], out[rows])}")
        if v.scale_after:
            record("negative_control_scale_after_differs", not torch.equal(ref, shipped),
                   f"{v.name} gave the shipped bits: the equality checks could not fail")
            record(v.name, torch.allclose(ref.float(), shipped.float(), atol=3e-2, rtol=3e-2),
                   f"far from the shipped definition: {compare(shipped, ref)}")
        else:
            record(v.name, torch.equal(ref, shipped), f"64-row prefill != shipped: {compare(shipped, ref)}")
    results.setdefault("negative_control_scale_after_differs", {"ok": False, "detail": "no scale_after variant ran"})

    v = VARIANTS[0]
    out64, *dbg64 = run(v, prefill, "64-row", debug=True)
    out16, *dbg16 = run(v, decode, "one-warp", debug=True)
    record("debug_first_tile", torch.equal(out64, shipped) and torch.equal(out16[DECODED], shipped[DECODED]),
           "the debug build moved output bits")
    located = locate([t[DECODED] for t in dbg64], [t[DECODED] for t in dbg16])
    record("debug_first_tile", located["scores_rows_differ"] == 0 and located["acc_rows_differ_with_equal_scores"] == 0,
           f"programs part under the row-independent model: {located}")
    expected = _first_tile_scores(q, k_cache, table, scale * LOG2E)
    record("debug_first_tile", torch.equal(dbg64[0], expected), f"first-tile scores: {compare(expected, dbg64[0])}")
    record("debug_first_tile", bool(torch.isfinite(dbg64[1]).all()), "a row's first-tile P V was not written")
    _bench_run(record)
    return results


def _bench_run(record):
    """The GPU bench's whole run (bits, timing with a stand-in timer, debug builds, report, JSON) on CPU at
    tiny sizes, so the GPU call goes to measuring: the shipped lines agree with themselves under the model,
    an inline-asm variant's failure is recorded and the run goes on. Last: it rewrites the bench's sizes."""
    import argparse
    import json
    import tempfile
    from pathlib import Path

    import bench.attention_fp8_variants as bench

    sizes = dict(DEVICE="cpu", HEADS=HEADS, KV_HEADS=KV_HEADS, HEAD_DIM=HEAD_DIM, PHASE_LEN=N, BATCH=3, CONTEXTS=(N,))
    for name, value in sizes.items():
        setattr(bench, name, value)
    bench._timer = lambda rep_ms: ((lambda fn: (fn(), 1.0)[1]), "stand-in timer (CPU run)")
    names = ("shipped", "asm_barrier", "word32_cvt", "alt_scale_after")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        bench.run(argparse.Namespace(out=str(out), variants=[v for v in bench.VARIANTS if v.name in names],
                                     contexts=[N], rep_ms=1, split=True, no_locate=False, locate_all=False,
                                     budget_s=600))
        result = json.loads(out.read_text())
    shipped, asm = result["bits"]["shipped"], result["bits"]["asm_barrier"]
    record("bench_run", shipped["one-warp decode vs own 64-row prefill"]["tokens_differ"] == 0
           and shipped["64-row prefill vs shipped 64-row"]["tokens_differ"] == 0, f"shipped bits: {shipped}")
    record("bench_run", shipped["locate"]["scores_rows_differ"] == 0, f"locate: {shipped.get('locate')}")
    record("bench_run", "inline_asm" in asm.get("error", ""), f"asm_barrier under the interpreter: {asm}")
    record("bench_run", len(result["speed"]) == 2 + 2 * 3, f"timed rows: {[r['name'] for r in result['speed']]}")
    record("bench_run", "error" in result["batch_bits"][str(N)]["asm_barrier"], str(result["batch_bits"]))


CHECKS = [*(v.name for v in _interpretable()), "negative_control_scale_after_differs", "debug_first_tile", "bench_run"]
interpreted, test_variant_bits_equal_shipped_interpreted = interpreted_checks(__file__, "attention fp8 variants", CHECKS)


def _variant_names() -> list[str]:
    from bench.attention_fp8_variants import VARIANTS
    return [v.name for v in VARIANTS]


@pytest.mark.parametrize("name", _variant_names())
def test_variant_builds_for_sm90_with_its_mma_and_kwidth(name):
    """What the GPU bench launches builds for the H200: the one-warp program on mma.sync with the dot
    operand kWidth the variant declares, the 64-row one on wgmma, within 227 KiB of shared memory."""
    pytest.importorskip("triton.backends.nvidia")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernel is an interpreted function, not compilable")
    from bench.attention_fp8_variants import VARIANTS, sm90_build

    v = next(v for v in VARIANTS if v.name == name)
    one_warp, rows64 = sm90_build(v, decode_program=True), sm90_build(v, decode_program=False)
    assert one_warp["mma"] == "mma.sync" and one_warp["dot_kwidth"] == [v.kwidth], one_warp
    assert rows64["mma"] == "wgmma", rows64
    assert max(one_warp["shared"], rows64["shared"]) <= SM90_SHARED_BYTES, (one_warp, rows64)


if __name__ == "__main__":
    print_checks(_run_checks)
