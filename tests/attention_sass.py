"""Instructions per KV tile of the paged attention kernel's sm_90 build, counted in its SASS (no GPU needed):
the builds tests/ops/test_attention_sass.py checks, and the table lab/attention_sass.py writes.

    python lab/attention_sass.py [--out lab/results/attention-sass-tile.json]

Builds `_paged_attention_kernel` for the H200 with the Triton wheel's compiler (Qwen3's GQA group of 2,
head_dim 128, block 16, kv_tile 32; the engine's launch options: no FP contraction, the caches' 16-byte
aligned strides) as the 64-row in-register program and the one-warp decode program over a BF16 cache, and
over FP8 caches with FP32 scales and with FP8_KV's power-of-two ones; disassembles each with the wheel's
cuobjdump, and counts each loop's instructions by opcode. A loop over tiles holds a
block that merges a finished split (skipped by a forward branch in all other tiles): it is counted
apart, so `per_tile` is what a tile without a split boundary issues per thread. Registers and stack
bytes (spills) from the build's resource usage.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from onepath.bench.results import environment, save_json

ALIGNED = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb",
           "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh")
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
BRANCH = re.compile(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))")


def _tools():
    import triton
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return bin_dir / "cuobjdump"


def signature(fp8: bool) -> dict:
    """_paged_attention_kernel's argument types for an sm_90 build: BF16 queries, a BF16 or FP8 cache."""
    ints = ("num_tokens", "window", "num_splits", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb",
            "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh", "stride_table", "stride_ksb",
            "stride_kss", "stride_ksh", "stride_vsb", "stride_vss", "stride_vsh")
    cache, scales = ("*fp8e4nv", "*fp32") if fp8 else ("*bf16", "*bf16")
    return {"q_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache, "out_ptr": "*bf16", "ks_ptr": scales, "vs_ptr": scales,
            "pos_ptr": "*i64", "seq_ptr": "*i64", "table_ptr": "*i32", "starts_ptr": "*i64", "part_acc_ptr": "*fp32",
            "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "qk_scale": "fp32", **{n: "i32" for n in ints}}


def build(rows: int, warps: int, stages: int, unmasked: bool, split: bool = False, table_asm: bool = False,
          fp8: bool = False, pow2: bool = False):
    """The sm_90 CompiledKernel of one program shape over a BF16 cache (fp8: an FP8 one, its tiles through the
    `_opaque` barrier; pow2: scales by FP8_KV's rule, dequantised by `_e4m3_pow2_to_bf16`), as paged_attention
    launches it (table_asm: the block-table entries by inline asm, see attention.table_load_asm)."""
    from onepath.ops.cuda import attention as A
    from onepath.ops.cuda import sm90
    kv_mode = (A.KV_FP8_POW2 if pow2 else A.KV_FP8) if fp8 else A.KV_PLAIN
    consts = dict(GROUP=2, GROUP_PAD=2, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, KV_TILE=32, SPLIT_TILES=8,
                  BLOCK_M=rows, BLOCK_Q=min(rows // 2, 32), SPLIT=split, FP8_KV=kv_mode.value, OPAQUE=fp8,
                  UNMASKED=unmasked, TABLE_ASM=table_asm)
    # an FP8 cache's scales [blocks, 16, Hkv, 1]: their block stride is a multiple of 16, the token one (Hkv) not
    aligned = ALIGNED + (("ks_ptr", "vs_ptr", "stride_ksb", "stride_vsb") if fp8 else ())
    return sm90.build(A._paged_attention_kernel, signature(fp8), consts, aligned, warps, stages,
                      enable_fp_fusion=False)


def sass(cubin: bytes) -> tuple[str, str]:
    """(disassembly, resource usage) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = lambda *a: subprocess.run([str(_tools()), *a, f.name], capture_output=True, text=True, check=True).stdout
        return run("-sass"), run("-res-usage")


def staged_buffers(ttgir: str) -> list[tuple[int, str, str]]:
    """(depth, shape, dtype) of each buffer the pipeliner allocates in shared memory (those without an initial
    value, e.g. (2, "32x128", "bf16") for a double-buffered K tile), in a build's TTGIR."""
    return [(int(d), shape, dtype) for d, shape, dtype in
            re.findall(r"ttg.local_alloc : \(\) -> !ttg.memdesc<(\d+)x([\dx]+)x([a-z]\w*)", ttgir)]


def loops(text: str) -> list[dict]:
    """Each backward branch's loop: its instructions by opcode, with the block a forward branch inside it
    skips (the split merge) counted apart."""
    code = [(int(m.group(1), 16), m.group(2), line) for line in text.splitlines()
            if (m := INSTRUCTION.match(line))]
    found = []
    for i, (addr, op, line) in enumerate(code):
        target = BRANCH.search(line) if op == "BRA" else None
        if not target or not target.group(1) or int(target.group(1), 16) >= addr:
            continue
        start = int(target.group(1), 16)
        body = [(a, o, ln) for a, o, ln in code if start <= a <= addr]
        skipped = set()
        for a, o, ln in body:
            fwd = BRANCH.search(ln) if o == "BRA" else None
            if fwd and fwd.group(1) and a < int(fwd.group(1), 16) <= addr:
                skipped = {b for b, _, _ in body if a < b < int(fwd.group(1), 16)}
        ops = collections.Counter(o for a, o, _ in body if a not in skipped)
        found.append(dict(start=hex(start), end=hex(addr), per_tile=sum(ops.values()), merge_block=len(skipped),
                          ops=dict(ops.most_common())))
    return found


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="lab/results/attention-sass-tile.json")
    args = p.parse_args(argv)
    from onepath.ops.cuda import attention as A
    decode = (A.DECODE_BLOCK_M, A.DECODE_NUM_WARPS, A.DECODE_NUM_STAGES, False)
    deep = (A.DECODE_BLOCK_M, A.DECODE_NUM_WARPS, A.DEEP_DECODE_NUM_STAGES, False)
    prefill = (A.BLOCK_M, A.NUM_WARPS, A.NUM_STAGES)
    bf16_asm, fp8_asm = A.table_load_asm(False, True, False), A.table_load_asm(True, True, False)
    prefill_asm = A.table_load_asm(False, False, False)
    fp8_split_asm = A.table_load_asm(True, True, True)
    # name: (rows, warps, stages, unmasked, table_asm, fp8, pow2, split)
    programs = {"64 rows, every tile masked": (*prefill, False, False, False, False, False),
                "64 rows, interior tiles unmasked, table by tl.load": (*prefill, True, False, False, False, False),
                "64 rows, interior tiles unmasked": (*prefill, True, prefill_asm, False, False, False),
                "decode program": (*decode, bf16_asm, False, False, False),
                "decode program, table by tl.load": (*decode, False, False, False, False),
                "decode program, deep (DEEP_DECODE_NUM_STAGES)": (*deep, bf16_asm, False, False, False),
                "decode program, FP8 cache, FP32 scales": (*decode, fp8_asm, True, False, False),
                "decode program, FP8 cache, FP32 scales, split-KV": (*decode, fp8_split_asm, True, False, True),
                "decode program, FP8 cache (FP8_KV)": (*decode, fp8_asm, True, True, False),
                "decode program, FP8 cache (FP8_KV), split-KV": (*decode, fp8_split_asm, True, True, True),
                "64 rows, interior tiles unmasked, FP8 cache, FP32 scales": (*prefill, True, False, True, False, False),
                "64 rows, interior tiles unmasked, FP8 cache (FP8_KV)": (*prefill, True, False, True, True, False)}
    out = {}
    for name, (rows, warps, stages, unmasked, table_asm, fp8, pow2, split) in programs.items():
        built = build(rows, warps, stages, unmasked, split=split, table_asm=table_asm, fp8=fp8, pow2=pow2)
        text, usage = sass(built.asm["cubin"])
        res = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        out[name] = dict(rows=rows, warps=warps, stages=stages, unmasked=unmasked, table_asm=table_asm, fp8=fp8,
                         pow2_scales=pow2, split=split, registers=int(res.group(1)),
                         shared_bytes=built.metadata.shared, stack_bytes=int(res.group(2)), loops=loops(text))
        print(f"{name}: {res.group(1)} registers, {res.group(2)} stack bytes; instructions per tile by loop: "
              + ", ".join(str(lp["per_tile"]) for lp in out[name]["loops"]))
    save_json(dict(environment("cpu"), command="python " + " ".join(sys.argv), target="sm_90",
                   shape=dict(group=2, head_dim=128, block_size=16, kv_tile=32), programs=out), Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
