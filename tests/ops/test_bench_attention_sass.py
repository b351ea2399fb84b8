"""bench/attention_sass.py on the CPU: the sm_90 builds of paged attention keep the shape the speed claims rest
on. The 64-row in-register program walks its tiles in three loops, the middle one (tiles inside every row's
key range) issuing fewer instructions per tile and no causal/window selects, without spilling; with
UNMASKED off (the GPU test's reference) and in the one-warp decode program, one loop (three software
pipelines spilled the decode program's registers: bench/results/gpu-tests.log, session 9)."""
import os

import pytest

pytest.importorskip("triton.backends.nvidia")


def test_unmasked_interior_loop_issues_fewer_instructions():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernel is an interpreted function, not compilable")
    from bench import attention_sass as S
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


def test_decode_program_reads_the_table_without_staging_it():
    """The decode program's block-table entries by inline asm (attention.TABLE_LOAD_ASM): its sm_90 build stages
    no entry through shared memory (only K and V are copied there) and spills less than the same program reading
    them with tl.load, the control, whose pipeliner copies the entries to shared memory ahead of K and V. The
    speed (6-7% at batch 256, in-register) is bench/results/kernels-attention-table-asm.json's, the bits tests/gpu's."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernel is an interpreted function, not compilable")
    import re

    from bench import attention_sass as S
    from onepath.ops.cuda import attention as A

    assert A.TABLE_LOAD_ASM
    built = {}
    for table_asm in (True, False):
        b = S.build(A.DECODE_BLOCK_M, A.DECODE_NUM_WARPS, 3, False, table_asm=table_asm)  # 3 stages: one staged load
        _, usage = S.sass(b.asm["cubin"])
        staged = re.findall(r"ttg.local_alloc : \(\) -> !ttg.memdesc<[\dx]+x([a-z]\w*)", b.asm["ttgir"])
        built[table_asm] = dict(stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                                staged=sorted(staged))
    assert built[True]["staged"] == ["bf16", "bf16"], built
    assert "i32" in built[False]["staged"], built
    assert built[True]["stack"] < built[False]["stack"], built
