"""onepath.ops.cuda.compressor (compress) under Triton's CPU interpreter: close to the FP32 reference; with the CPU's
exp installed in the interpreter, compressor.consistent's bits exactly (FP32 and BF16, CSA's 2m slots with the first
window half invalid, odd slot counts, HCA's 128 slots, strided views as the model passes them), so every other step
is the CPU's arithmetic; an entry alone equals it in a launch, at any position. Controls: numpy's exp moves the
bits (the check sees one ulp), and the stock pooling (torch.softmax, a sum) gives other bits than the consistent
path on the same windows."""
from __future__ import annotations

from tests.interpret import (check_recorder, interpreted_checks, kernel_case_tools, patch_bf16_rounding,
                             patch_cpu_exp, print_checks)

CHECKS = ["close_to_reference", "equals_cpu_consistent_given_its_exp", "entries_alone_equal_launch",
          "other_exp_moves_bits", "stock_pooling_differs"]


def _run_checks() -> dict:
    patch_bf16_rounding()  # the interpreter truncates to bf16; the GPU rounds to nearest even
    import torch

    from onepath.ops import compressor as C
    from onepath.ops.cuda import compressor

    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()
    rand, close, embedded = kernel_case_tools(gen)

    def windows(e, s, c, dtype):
        # kv and gate as the model reads them: the two halves of one row of the compressor's state (strided views)
        state = rand(e, s, 2 * c, dtype=dtype, scale=2.0)
        valid = torch.ones(e, s, dtype=torch.bool)
        valid[0, :s // 2] = False  # CSA's first window: no previous one
        return state[..., :c], state[..., c:], torch.randn(s, c, generator=gen), valid

    cases = [(e, s, c, dtype) for dtype in (torch.float32, torch.bfloat16)
             for e, s, c in ((7, 8, 44), (5, 5, 70), (3, 128, 24), (4, 1, 33))]
    made = [windows(*case) for case in cases]
    numpy_exp = [compressor.compress(*w) for w in made]
    for (e, s, c, dtype), w, got in zip(cases, made, numpy_exp):
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        ok, why = close(got.float(), C.reference(*w).float(), **tol)
        record("close_to_reference", ok, f"{(e, s, c, dtype)}: {why}")
    patch_cpu_exp()
    moved = False
    for (e, s, c, dtype), w, before in zip(cases, made, numpy_exp):
        got, want = compressor.compress(*w), C.consistent(*w)
        record("equals_cpu_consistent_given_its_exp", torch.equal(got, want), f"{(e, s, c, dtype)}")
        moved |= not torch.equal(before, want)
        alone = torch.cat([compressor.compress(*(t[i:i + 1] for t in w[:2]), w[2], w[3][i:i + 1]) for i in range(e)])
        record("entries_alone_equal_launch", torch.equal(alone, got), f"{(e, s, c, dtype)} alone")
        kv, gate, bias, valid = w
        pos_kv, pos = embedded(kv[1:3].contiguous(), 9, lambda m: rand(m, s, c, dtype=dtype))
        pos_gate = rand(pos_kv.shape[0], s, c, dtype=dtype)
        pos_gate[pos:pos + 2] = gate[1:3]
        pos_valid = torch.ones(pos_kv.shape[0], s, dtype=torch.bool)
        inside = compressor.compress(pos_kv, pos_gate, bias, pos_valid)[pos:pos + 2]
        record("entries_alone_equal_launch", torch.equal(inside, got[1:3]), f"{(e, s, c, dtype)} at {pos}")
    record("other_exp_moves_bits", moved, "numpy's exp gave the CPU's bits on every case")
    w = made[0]
    record("stock_pooling_differs", not torch.equal(C.reference(*w), C.consistent(*w)),
           "torch.softmax and .sum gave the consistent bits")
    return results


interpreted, test_compress_interpreted = interpreted_checks(__file__, "compress", CHECKS)

if __name__ == "__main__":
    print_checks(_run_checks)


def test_kernel_builds_for_sm90_with_its_roundings():
    """The kernel as the H200 compiles it (CSA's 8 slots and HCA's 128, BF16): within shared memory, IEEE division,
    no product contracted into an FMA (every product rounds before its add, as torch's). Control: the same build
    with FP contraction on has FMAs, so the check can fail."""
    from onepath.ops.cuda import compressor
    from tests.interpret import SM90_SHARED_BYTES, build_sm90

    sig = dict(kv_ptr="*bf16", gate_ptr="*bf16", bias_ptr="*fp32", valid_ptr="*i8", out_ptr="*bf16", S="i32",
               C="i32", kv_se="i32", kv_ss="i32", g_se="i32", g_ss="i32", b_ss="i32", v_se="i32", o_se="i32")
    aligned = ("kv_ptr", "gate_ptr", "bias_ptr", "valid_ptr", "out_ptr")
    for s_pad in (8, 128):
        consts = dict(S_PAD=s_pad, BLOCK_C=compressor.TILE // s_pad)
        for fusion in (False, True):
            config = type("Launch", (), dict(num_warps=compressor.NUM_WARPS, num_stages=1, enable_fp_fusion=fusion))
            built = build_sm90(compressor._compress_kernel, sig, consts, aligned, config)
            ptx = built.asm["ptx"]
            if not fusion:
                assert built.metadata.shared <= SM90_SHARED_BYTES and "div.rn.f32" in ptx
                assert "div.full" not in ptx and "div.approx" not in ptx and "fma.rn" not in ptx, s_pad
            else:
                assert "fma.rn" in ptx, "contraction on, yet no FMA: the check above proves nothing"
