"""tests/attention_sass.py on the CPU: the sm_90 builds of paged attention keep the shape the speed claims rest
on. The 64-row in-register program walks its tiles in three loops, the middle one (tiles inside every row's
key range) issuing fewer instructions per tile and no causal/window selects, without spilling; with
UNMASKED off (the GPU test's reference) and in the one-warp decode program, one loop (three software
pipelines spilled the decode program's registers: bench/results/tests/gpu-tests.log, session 9)."""
import os

import pytest

pytest.importorskip("triton.backends.nvidia")


def test_unmasked_interior_loop_issues_fewer_instructions():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernel is an interpreted function, not compilable")
    from tests import attention_sass as S
    from onepath.ops.cuda import attention as A

    def program(rows, warps, stages, unmasked):
        text, usage = S.sass(S.build(rows, warps, stages, unmasked).asm["cubin"])
        return S.loops(text), usage

    masked, _ = program(A.BLOCK_M, A.NUM_WARPS, A.NUM_STAGES, False)
    three, usage = program(A.BLOCK_M, A.NUM_WARPS, A.NUM_STAGES, True)
    decode, _ = program(A.DECODE_BLOCK_M, A.DECODE_NUM_WARPS, A.DECODE_NUM_STAGES, False)
    assert len(masked) == 1 and len(decode) == 1, (len(masked), len(decode))
    assert len(three) == 3, [lp["per_tile"] for lp in three]
    head, interior, tail = three
    assert interior["per_tile"] < 0.8 * min(head["per_tile"], tail["per_tile"], masked[0]["per_tile"]), \
        [lp["per_tile"] for lp in three + masked]
    # the masked loops select -inf for keys out of a row's range; the interior loop selects nothing per score
    assert interior["ops"].get("FSEL", 0) < masked[0]["ops"].get("FSEL", 0) // 4, (interior["ops"], masked[0]["ops"])
    assert "STACK:0 " in usage, usage


def test_decode_program_reads_the_table_in_fewer_instructions():
    """The decode program's block-table entries by inline asm (attention.TABLE_LOAD_ASM): its sm_90 build, as the
    engine launches it (DECODE_NUM_STAGES), issues fewer instructions per tile and spills less than the same
    program reading them with a masked tl.load, the control; with 3 stages it stages no entry through shared
    memory (only K and V), where the control does. The speed (6-7% at batch 256, in-register) is
    bench/results/attention/kernels-attention-table-asm.json's, the bits tests/ops/test_attention_gpu.py's."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernel is an interpreted function, not compilable")
    import re

    from tests import attention_sass as S
    from onepath.ops.cuda import attention as A

    assert A.TABLE_LOAD_ASM
    built = {}
    for table_asm in (True, False):
        b = S.build(A.DECODE_BLOCK_M, A.DECODE_NUM_WARPS, A.DECODE_NUM_STAGES, False, table_asm=table_asm)
        text, usage = S.sass(b.asm["cubin"])
        (loop,) = S.loops(text)
        three = S.build(A.DECODE_BLOCK_M, A.DECODE_NUM_WARPS, 3, False, table_asm=table_asm)
        built[table_asm] = dict(per_tile=loop["per_tile"], stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                                staged_at_3_stages=sorted(dt for _, _, dt in S.staged_buffers(three.asm["ttgir"])))
    assert built[True]["per_tile"] < 0.9 * built[False]["per_tile"], built
    assert built[True]["stack"] < built[False]["stack"], built
    assert built[True]["staged_at_3_stages"] == ["bf16", "bf16"], built
    assert "i32" in built[False]["staged_at_3_stages"], built


def test_64_row_program_with_the_table_by_asm_buffers_deeper():
    """The 64-row program (prefill) reads its block table by inline asm over a BF16 cache (attention.table_load_asm):
    its sm_90 build at NUM_STAGES keeps NUM_STAGES K and V buffers (the tl.load build, the control, one fewer: its
    pipeliner stages the entries first), issues fewer instructions per interior tile, and fits Hopper's shared
    memory. Its speed (0.86 instead of 0.72 of SDPA flash at 4 x 4096) is
    bench/results/attention/kernels-attention-prefill-table-asm.json's, the bits tests/ops/test_attention_gpu.py's."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernel is an interpreted function, not compilable")
    from tests import attention_sass as S
    from onepath.ops.cuda import attention as A
    from onepath.ops.cuda.sm90 import SHARED_BYTES

    assert A.table_load_asm(fp8_kv=False, decode_program=False, split=False)
    built = {}
    for table_asm in (True, False):
        b = S.build(A.BLOCK_M, A.NUM_WARPS, A.NUM_STAGES, True, table_asm=table_asm)
        text, _ = S.sass(b.asm["cubin"])
        depths = {depth for depth, shape, dtype in S.staged_buffers(b.asm["ttgir"])
                  if (shape, dtype) == ("32x128", "bf16")}
        built[table_asm] = dict(depths=depths, interior=S.loops(text)[1]["per_tile"], shared=b.metadata.shared)
    assert built[True]["depths"] == {A.NUM_STAGES} and built[False]["depths"] == {A.NUM_STAGES - 1}, built
    assert built[True]["interior"] < built[False]["interior"], built
    assert built[True]["shared"] <= SHARED_BYTES, built


def test_power_of_two_kv_scales_dequantise_in_fewer_instructions():
    """An FP8 cache written by FP8_KV's rule (ue8m0 scales, at most 2^7) dequantises by `_e4m3_pow2_to_bf16`: bit
    placement and one BF16 multiply per pair of codes. The decode program's sm_90 build issues at least 10% fewer
    instructions per tile than over FP32 scales (the control: FP32 product, then BF16 rounding), in both launches,
    and its conversion is the PRMT/HMUL2 sequence instead of the FP32 path's HADD2.F32 unpacking; the 64-row
    program's interior loop issues fewer too. The bits (the FP32 path's, exactly) are tests/ops/test_attention_gpu.py's."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernel is an interpreted function, not compilable")
    from tests import attention_sass as S
    from onepath.ops.cuda import attention as A

    def loop(rows, warps, stages, unmasked, split, pow2, index=0):
        b = S.build(rows, warps, stages, unmasked, split=split, table_asm=A.table_load_asm(True, rows != A.BLOCK_M,
                                                                                           split), fp8=True, pow2=pow2)
        return S.loops(S.sass(b.asm["cubin"])[0])[index]

    for split in (False, True):
        pow2, fp32 = (loop(A.DECODE_BLOCK_M, A.DECODE_NUM_WARPS, A.DECODE_NUM_STAGES, False, split, p)
                      for p in (True, False))
        assert pow2["per_tile"] < 0.9 * fp32["per_tile"], (split, pow2["per_tile"], fp32["per_tile"])
        assert pow2["ops"].get("HMUL2", 0) >= 128 and "HADD2" not in pow2["ops"], pow2["ops"]
        assert fp32["ops"].get("HADD2", 0) >= 256, fp32["ops"]
    interior = [loop(A.BLOCK_M, A.NUM_WARPS, A.NUM_STAGES, True, False, p, index=1)["per_tile"] for p in (True, False)]
    assert interior[0] < interior[1], interior
