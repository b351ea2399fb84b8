"""Which dequantisation of an FP8 KV cache lets the one-warp decode program keep the 64-row program's
bits, and how fast each runs at batch 256 (issue 7). On the GPU, one call:

    python lab/attention_fp8_variants.py --out lab/results/attention-fp8-variants.json

The suspect, from the sm_90 builds (no GPU needed: `--builds`, tests/ops/test_attention_fp8_variants_
interpret.py): Triton picks an MMAv2 (mma.sync) operand's kWidth from the narrowest tensor *loaded* in the
operand's backward slice (AccelerateMatmul's computeOrigBitWidth walks pure elementwise ops, views and
loads). Over an FP8 cache the K and V tiles come from 8-bit loads, so the one-warp program's dots get
kWidth 4 (BF16 cache: 2). Their linear layouts (gluon to_linear_layout, A operand 16x32): kWidth 2 gives
lane t (of 4 in a row quad) K 2t, 2t+1 (+8, +16), kWidth 4 gives it K 4t..4t+3 (+16): each m16n8k16 still
sums K 0..15 then 16..31, but with the products in other slots (slots 2t, 2t+1 hold K 4t, 4t+1; slots
2t+8, 2t+9 hold K 4t+2, 4t+3), both operands alike. If the tensor core's 16-product sum depends on the
slots, that gives other bits on some elements. wgmma (the 64-row program) reads B from shared memory,
in natural order. Every variant below keeps the contract's numbers
(k = (code.to(fp32) * scale).to(bf16), v likewise) and changes only how they are computed; "kWidth" is the
prediction, read from the build, and the bits say whether it is the cause:
  shipped        the shipped FP8_KV lines (hardware cvt e4m3x2 -> f16x2 -> f32)               kWidth 4
  via_f16        code.to(fp16).to(fp32)                                                    kWidth 4
  trans_first    K codes transposed before they are converted                              kWidth 4
  u8_bits        codes loaded as uint8, e4m3 decoded into fp32 bits by integer ops (no cvt) kWidth 4
  fp_fusion      the shipped lines built with enable_fp_fusion=True (both programs)          kWidth 4
  asm_pure       the fp32 product through an identity inline asm declared pure            kWidth 4
  asm_barrier    the same asm declared impure: the slice stops there                        kWidth 2
  max_barrier    the fp32 product through tl.max over a size-1 axis (a reduction)           build says
  word32_cvt     codes loaded as int32 words (4 codes), bytes by shifts, bitcast e4m3, cvt  kWidth 2
  word32_bits    int32 words, bytes decoded by integer ops                                  kWidth 2
and the alternative formulation "scale after the dot" (another contract: speed and its own one-warp ==
64-row only): scores = dot(q, code.to(bf16)^T) * k_scale, P V = dot((p * v_scale).to(bf16), code.to(bf16)):
  alt_scale_after         fp8 loads                                                         kWidth 4
  alt_scale_after_word32  int32 word loads                                                  kWidth 2

(A) bits: one 700-token sequence (Qwen3-0.6B heads 16/8, D 128, block 16, kv_tile 32, kv_split 256,
shuffled blocks) run by each variant's 64-row program as a prefill (its reference) and, per token, as a
decode on its one-warp program (one launch: 700 one-token "sequences" sharing the block table), plus
the one-warp prefill and the 64-row decode; each compared with its own 64-row prefill and with the
shipped kernel (paged_attention, decode_program=False). A debug build stores each row's first-tile
scores (after masking) and its P V accumulator: where the programs disagree, these say whether QK^T or
P V moved first. The batch-256 timing inputs are compared too (one-warp vs 64-row, one query each).
(B) speed: median us per layer launch (CUDA graph replays), batch 256, contexts 1024 and 4096, one query
per sequence at position context-1, random block tables, in-register launch (the one paged_attention picks
at batch 256), for the shipped BF16 decode program, the shipped FP8 64-row program and both programs of
each variant; GB/s of the codes and scales read vs the H200's 4.8 TB/s.
Each variant runs inside try/except: a build error is recorded and the run goes on. Without CUDA it says so
and exits 0 (`--builds` then prints the sm_90 build table, about 2 s per build on CPU).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.numerics.quant import FP8Tensor  # noqa: E402
from onepath.ops.cuda import attention as A  # noqa: E402
from onepath.ops.cuda.attention import (_merge, _merge_splits_kernel, _program_rows, _query_blocks,  # noqa: E402
                                         _rescale)

HEADS, KV_HEADS, HEAD_DIM, BLOCK, KV_TILE, KV_SPLIT = 16, 8, 128, 16, 32, 256
PHASE_LEN, BATCH, CONTEXTS = 700, 256, (1024, 4096)
DEVICE = "cuda"  # tests/ops/test_attention_fp8_variants_interpret.py runs the whole bench on CPU, tiny
HBM_TB_S = 4.8  # H200 HBM3e peak

# How a tile's codes become fp32 code values (FORM): see the module docstring.
SHIPPED, VIA_F16, TRANS_FIRST, U8_BITS, ASM_PURE, ASM_BARRIER, MAX_BARRIER, WORD32_CVT, WORD32_BITS = (
    tl.constexpr(i) for i in range(9))
LOADS = {"fp8": torch.float8_e4m3fn, "u8": torch.uint8, "word32": torch.int32}  # the codes' pointer type


@dataclass(frozen=True)
class Variant:
    name: str
    form: int
    kwidth: int                 # the one-warp program's dot operand kWidth on sm_90 (Triton 3.6): the prediction
    what: str
    scale_after: bool = False   # the alternative formulation (another contract)
    fp_fusion: bool = False

    @property
    def load(self) -> str:
        return {U8_BITS.value: "u8", WORD32_CVT.value: "word32", WORD32_BITS.value: "word32"}.get(self.form, "fp8")


VARIANTS = (
    Variant("shipped", SHIPPED.value, 4, "code.to(fp32) * scale -> bf16: the shipped FP8_KV lines"),
    Variant("via_f16", VIA_F16.value, 4, "code.to(fp16).to(fp32) * scale -> bf16"),
    Variant("trans_first", TRANS_FIRST.value, 4, "K codes transposed, then converted and scaled"),
    Variant("u8_bits", U8_BITS.value, 4, "uint8 loads, e4m3 -> fp32 bits by integer ops (no cvt)"),
    Variant("fp_fusion", SHIPPED.value, 4, "shipped lines, enable_fp_fusion=True", fp_fusion=True),
    Variant("asm_pure", ASM_PURE.value, 4, "fp32 product through a pure identity inline asm"),
    Variant("asm_barrier", ASM_BARRIER.value, 2, "fp32 product through an impure identity inline asm"),
    Variant("max_barrier", MAX_BARRIER.value, 2, "fp32 product through tl.max over a size-1 axis"),
    Variant("word32_cvt", WORD32_CVT.value, 2, "int32 word loads, bytes by shifts, bitcast e4m3 + cvt"),
    Variant("word32_bits", WORD32_BITS.value, 2, "int32 word loads, bytes decoded by integer ops"),
    Variant("alt_scale_after", SHIPPED.value, 4, "ALT: dot(q, code^T) * k_scale; dot((p * v_scale), code)",
            scale_after=True),
    Variant("alt_scale_after_word32", WORD32_CVT.value, 2, "ALT with int32 word loads", scale_after=True),
)
PROGRAMS = ("one-warp", "64-row")


# ---- the kernel: onepath/ops/cuda/attention.py's, FP8 cache only, the dequantisation picked by FORM ----

@triton.jit
def _e4m3_value(b):
    """e4m3fn code b (int32 0..255, not NaN) -> its exact value in fp32, by integer and exact fp32 ops (no
    conversion instruction): a normal code's fields placed into fp32's; a subnormal one (exponent field 0)
    is mantissa * 2^-9, its mantissa made a float by the 2^23 magic number."""
    sign = (b & 0x80) << 24
    exp = (b >> 3) & 0xF
    man = b & 0x7
    normal = sign | ((exp + 120) << 23) | (man << 20)
    sub = ((man | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) * 0.001953125
    sub = sub.to(tl.int32, bitcast=True) | sign
    return tl.where(exp == 0, sub, normal).to(tl.float32, bitcast=True)


@triton.jit
def _kv_tile(base, s_base, block, slot, stride_b, stride_s, stride_sb, stride_ss, load_ok, d_ok,
             KV_TILE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, FORM: tl.constexpr,
             SCALE_AFTER: tl.constexpr, TRANS: tl.constexpr):
    """A K or V tile in fp32, [KV_TILE, D_PAD] ([D_PAD, KV_TILE] with TRANS), and its scales [KV_TILE]:
    code * scale (one FP32 product), or with SCALE_AFTER the code values alone. Masked keys load code 0 and
    scale 0. The caller rounds the tile to q's dtype once."""
    scale = tl.load(s_base + block * stride_sb + slot * stride_ss, mask=load_ok, other=0.0)
    row = block[:, None] * stride_b + slot[:, None] * stride_s
    if FORM == WORD32_CVT or FORM == WORD32_BITS:
        # base points at int32 words (4 codes each, little-endian): strides are in words
        w = tl.arange(0, D_PAD // 4)
        words = tl.load(base + row + w[None, :], mask=load_ok[:, None] & (w[None, :] < HEAD_DIM // 4), other=0)
        shift = tl.arange(0, 4) * 8
        codes = tl.reshape((words[:, :, None] >> shift[None, None, :]) & 0xFF, (KV_TILE, D_PAD))
        if FORM == WORD32_CVT:
            x = codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            x = _e4m3_value(codes)
    else:
        d = tl.arange(0, D_PAD)
        mask = load_ok[:, None] & d_ok[None, :]
        if FORM == U8_BITS:
            x = _e4m3_value(tl.load(base + row + d[None, :], mask=mask, other=0).to(tl.int32))
        else:
            codes = tl.load(base + row + d[None, :], mask=mask, other=0.0)
        if FORM == VIA_F16:
            x = codes.to(tl.float16).to(tl.float32)
        elif TRANS:
            x = tl.trans(codes).to(tl.float32)
        elif FORM != U8_BITS:
            x = codes.to(tl.float32)
    if not SCALE_AFTER:
        if TRANS:
            x = x * scale[None, :]
        else:
            x = x * scale[:, None]
        if FORM == ASM_PURE:
            x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
        if FORM == ASM_BARRIER:
            x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)
        if FORM == MAX_BARRIER:
            x = tl.max(x[:, :, None], axis=2)
    return x, scale


@triton.jit
def _attend_split(q, s, tile_lo, tile_end, lo_key, last_key, pos, first_key, row_ok, table, k_base, v_base,
                  ks_base, vs_base, d_ok, qk_scale, stride_kb, stride_ks, stride_vb, stride_vs,
                  stride_ksb, stride_kss, stride_vsb, stride_vss, dbg_scores_ptr, dbg_acc_ptr, dbg_rows, dbg_on,
                  BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  KV_TILE: tl.constexpr, SPLIT_TILES: tl.constexpr, FORM: tl.constexpr, SCALE_AFTER: tl.constexpr,
                  DEBUG: tl.constexpr):
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    cols = tl.arange(0, KV_TILE)
    j0 = tl.maximum(s * SPLIT_TILES, tile_lo)
    for j in range(j0, tl.minimum((s + 1) * SPLIT_TILES, tile_end)):
        key = j * KV_TILE + cols
        load_ok = (key >= lo_key) & (key <= last_key)
        block = tl.load(table + key // BLOCK_SIZE, mask=load_ok, other=0).to(tl.int64)
        slot = key % BLOCK_SIZE
        k, k_scale = _kv_tile(k_base, ks_base, block, slot, stride_kb, stride_ks, stride_ksb, stride_kss, load_ok,
                              d_ok, KV_TILE, HEAD_DIM, D_PAD, FORM, SCALE_AFTER, FORM == TRANS_FIRST)
        v, v_scale = _kv_tile(v_base, vs_base, block, slot, stride_vb, stride_vs, stride_vsb, stride_vss, load_ok,
                              d_ok, KV_TILE, HEAD_DIM, D_PAD, FORM, SCALE_AFTER, False)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if FORM == TRANS_FIRST:
            kt = k
        else:
            kt = tl.trans(k)
        scores = tl.dot(q, kt, input_precision="ieee")
        if SCALE_AFTER:
            scores = scores * k_scale[None, :]
        scores = scores * qk_scale
        valid = row_ok[:, None] & (key[None, :] <= pos[:, None]) & (key[None, :] >= first_key[:, None])
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = _rescale(m_i, m_new)
        p = tl.exp2(scores - tl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if SCALE_AFTER:
            pv = (p * v_scale[None, :]).to(v.dtype)
        else:
            pv = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
        m_i = m_new
        if DEBUG:
            # each row's first tile: its scores after masking and its P V accumulator
            first = row_ok & dbg_on & (j == j0)
            tl.store(dbg_scores_ptr + dbg_rows[:, None] * KV_TILE + cols[None, :], scores, mask=first[:, None])
            tl.store(dbg_acc_ptr + dbg_rows[:, None] * D_PAD + tl.arange(0, D_PAD)[None, :], acc, mask=first[:, None])
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_tokens", "window", "num_splits"])
def _variant_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, pos_ptr, seq_ptr, table_ptr, starts_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr, dbg_scores_ptr, dbg_acc_ptr,
    num_tokens, window, qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_table,
    stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vss, stride_vsh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_TILE: tl.constexpr, SPLIT_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, SPLIT: tl.constexpr, FORM: tl.constexpr, SCALE_AFTER: tl.constexpr,
    DEBUG: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_heads = tl.num_programs(1) * GROUP
    (seq, pos, row_ok, first_key, head, tok_c, lo_key, last_key, tile_lo, tile_end, split_lo, split_end, d, d_ok,
     q) = _program_rows(q_ptr, pos_ptr, seq_ptr, starts_ptr, num_tokens, window, pid, kv_head, stride_qt,
                        stride_qh, GROUP, GROUP_PAD, HEAD_DIM, D_PAD, KV_TILE, SPLIT_TILES, BLOCK_M, BLOCK_Q)
    table = table_ptr + seq.to(tl.int64) * stride_table
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    ks_base = ks_ptr + kv_head * stride_ksh
    vs_base = vs_ptr + kv_head * stride_vsh
    dbg_rows = tok_c * num_heads + head

    if SPLIT:
        s = tl.program_id(2)
        m_i, l_i, acc = _attend_split(q, s, tile_lo, tile_end, lo_key, last_key, pos, first_key, row_ok,
                                      table, k_base, v_base, ks_base, vs_base, d_ok, qk_scale, stride_kb,
                                      stride_ks, stride_vb, stride_vs, stride_ksb, stride_kss, stride_vsb,
                                      stride_vss, dbg_scores_ptr, dbg_acc_ptr, dbg_rows, s == split_lo,
                                      BLOCK_M, HEAD_DIM, D_PAD, BLOCK_SIZE, KV_TILE, SPLIT_TILES, FORM,
                                      SCALE_AFTER, DEBUG)
        part = (tok_c * num_heads + head) * num_splits + s
        keep = row_ok & (s >= split_lo) & (s < split_end) & (s < num_splits)
        tl.store(part_m_ptr + part, m_i, mask=keep)
        tl.store(part_l_ptr + part, l_i, mask=keep)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=keep[:, None])
    else:
        m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_run = tl.zeros([BLOCK_M], tl.float32)
        acc_run = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for s in range(split_lo, split_end):
            m_i, l_i, acc = _attend_split(q, s, tile_lo, tile_end, lo_key, last_key, pos, first_key, row_ok,
                                          table, k_base, v_base, ks_base, vs_base, d_ok, qk_scale, stride_kb,
                                          stride_ks, stride_vb, stride_vs, stride_ksb, stride_kss, stride_vsb,
                                          stride_vss, dbg_scores_ptr, dbg_acc_ptr, dbg_rows, s == split_lo,
                                          BLOCK_M, HEAD_DIM, D_PAD, BLOCK_SIZE, KV_TILE, SPLIT_TILES, FORM,
                                          SCALE_AFTER, DEBUG)
            m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m_i, l_i, acc)
        out = acc_run / tl.where(row_ok, l_run, 1.0)[:, None]
        tl.store(out_ptr + tok_c[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# ---- launcher: paged_attention's, over an FP8 cache ----

def _program(decode_program: bool, group_pad: int) -> tuple[int, int, int]:
    """(rows, warps, stages) of the one-warp decode program or the 64-row program."""
    if decode_program:
        return max(A.DECODE_BLOCK_M, group_pad), A.DECODE_NUM_WARPS, A.DECODE_NUM_STAGES
    return A.BLOCK_M, A.NUM_WARPS, A.NUM_STAGES


def _constexprs(v: Variant, group: int, head_dim: int, block_size: int, decode_program: bool, split: bool,
                debug: bool, kv_tile: int = KV_TILE, kv_split: int = KV_SPLIT) -> tuple[dict, int, int]:
    group_pad = triton.next_power_of_2(group)
    block_m, warps, stages = _program(decode_program, group_pad)
    consts = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
                  BLOCK_SIZE=block_size, KV_TILE=kv_tile, SPLIT_TILES=kv_split // kv_tile, BLOCK_M=block_m,
                  BLOCK_Q=min(block_m // group_pad, kv_tile), SPLIT=split, FORM=v.form, SCALE_AFTER=v.scale_after,
                  DEBUG=debug)
    return consts, warps, stages


def attend(v: Variant, q, k_cache: FP8Tensor, v_cache: FP8Tensor, positions, query_seq, block_tables, scale,
           decode_program: bool, *, split: bool = False, derived: dict | None = None, debug: bool = False,
           max_context: int | None = None, kv_tile: int = KV_TILE, kv_split: int = KV_SPLIT):
    """paged_attention with variant v's dequantisation: (out, first-tile scores, first-tile P V acc, kernel).
    The debug tensors ([T, H, kv_tile], [T, H, D_PAD], NaN where unwritten) are None without debug; kernel is
    the compiled kernel (None under the interpreter)."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.codes.shape
    group = num_heads // num_kv_heads
    consts, warps, stages = _constexprs(v, group, head_dim, block_size, decode_program, split, debug, kv_tile, kv_split)
    codes = [c.codes.view(LOADS[v.load]) for c in (k_cache, v_cache)]
    k_scales, v_scales = k_cache.scales, v_cache.scales
    key = ("query_blocks", consts["BLOCK_Q"])
    starts = derived.get(key) if derived is not None else None
    if starts is None:
        starts = _query_blocks(positions, query_seq, consts["BLOCK_Q"], block_tables.shape[0])
        if derived is not None:
            derived[key] = starts
    num_splits = triton.cdiv(max_context or block_tables.shape[1] * block_size, kv_split)
    out = torch.empty_like(q)
    d_pad = consts["D_PAD"]
    if split:
        part_m = torch.empty((num_tokens, num_heads, num_splits), device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_tokens, num_heads, num_splits, d_pad), device=q.device, dtype=torch.float32)
    else:
        part_m = part_l = part_acc = None
    dbg_scores = dbg_acc = None
    if debug:
        dbg_scores = torch.full((num_tokens, num_heads, kv_tile), math.nan, device=q.device)
        dbg_acc = torch.full((num_tokens, num_heads, d_pad), math.nan, device=q.device)
    kernel = _variant_kernel[(starts.shape[0], num_kv_heads, num_splits if split else 1)](
        q, codes[0], codes[1], k_scales, v_scales, out, positions, query_seq, block_tables, starts,
        part_acc, part_m, part_l, dbg_scores, dbg_acc,
        num_tokens, A.NO_WINDOW, scale * A.LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *codes[0].stride()[:3], *codes[1].stride()[:3], block_tables.stride(0),
        *k_scales.stride()[:3], *v_scales.stride()[:3],
        num_warps=warps, num_stages=stages, enable_fp_fusion=v.fp_fusion, **consts,
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_kv_heads)](
            part_acc, part_m, part_l, out, positions, A.NO_WINDOW, num_splits, out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=consts["GROUP_PAD"], HEAD_DIM=head_dim, D_PAD=d_pad, KV_SPLIT=kv_split,
            num_warps=warps, enable_fp_fusion=v.fp_fusion,
        )
    return out, dbg_scores, dbg_acc, kernel


# ---- what a build did (from the GPU launch, or an sm_90 build on CPU) ----

def build_info(asm: dict, shared: int, regs=None, spills=None) -> dict:
    """The MMA instruction, the kWidth of the dots' register operands, shared memory, registers."""
    dots = [line for line in asm["ttgir"].splitlines() if " tt.dot " in line or "ttng.warp_group_dot " in line]
    ptx = asm["ptx"]
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    return dict(mma=mma, dot_kwidth=sorted({int(x) for line in dots for x in re.findall(r"kWidth = (\d+)", line)}),
                shared=shared, regs=regs, spills=spills)


def sm90_build(v: Variant, decode_program: bool, debug: bool = False) -> dict:
    """v's program built for sm_90 by the Triton wheel's ptxas (no GPU): build_info. Qwen3-0.6B shape."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts, warps, stages = _constexprs(v, HEADS // KV_HEADS, HEAD_DIM, BLOCK, decode_program, False, debug)
    kernel = _variant_kernel
    names = kernel.arg_names
    code_ty = {"fp8": "*fp8e4nv", "u8": "*u8", "word32": "*i32"}[v.load]
    ints = [n for n in names if n.startswith("stride_")] + ["num_tokens", "window", "num_splits"]
    sig = {"q_ptr": "*bf16", "out_ptr": "*bf16", "k_ptr": code_ty, "v_ptr": code_ty, "ks_ptr": "*fp32",
           "vs_ptr": "*fp32", "pos_ptr": "*i64", "seq_ptr": "*i64", "table_ptr": "*i32", "starts_ptr": "*i64",
           "qk_scale": "fp32", **{n: "i32" for n in ints}, **{n: "constexpr" for n in consts}}
    none_ptrs = ["part_acc_ptr", "part_m_ptr", "part_l_ptr"] + ([] if debug else ["dbg_scores_ptr", "dbg_acc_ptr"])
    sig.update({n: "constexpr" for n in none_ptrs})
    sig.update({n: "*fp32" for n in ("dbg_scores_ptr", "dbg_acc_ptr") if debug})
    constexprs = {(names.index(n),): val for n, val in {**consts, **{n: None for n in none_ptrs}}.items()}
    aligned = ("q_ptr", "out_ptr", "k_ptr", "v_ptr", "stride_qt", "stride_ot", "stride_kb", "stride_vb")
    src = ASTSource(kernel, {n: sig[n] for n in names}, constexprs=constexprs,
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=v.fp_fusion))
    return build_info(compiled.asm, compiled.metadata.shared)


def _launch_info(kernel) -> dict | None:
    if kernel is None or not hasattr(kernel, "asm"):
        return None
    return build_info(kernel.asm, kernel.metadata.shared, getattr(kernel, "n_regs", None),
                      getattr(kernel, "n_spills", None))


# ---- inputs ----

def fp8_cache(num_blocks: int, gen: torch.Generator, device: str, chunk_blocks: int = 4096) -> tuple[FP8Tensor, FP8Tensor]:
    """K and V caches [num_blocks, BLOCK, Hkv, D] of quantised randn (the fp8_kv preset's per-token, per-head
    rule), written chunk by chunk to bound the FP32 temporaries."""
    from onepath.numerics.quant import quantize_fp8
    from onepath.numerics.spec import FP8_KV

    caches = []
    for _ in range(2):
        codes = torch.empty((num_blocks, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.float8_e4m3fn, device=device)
        scales = torch.empty((num_blocks, BLOCK, KV_HEADS, 1), dtype=torch.float32, device=device)
        for lo in range(0, num_blocks, chunk_blocks):
            hi = min(num_blocks, lo + chunk_blocks)
            x = torch.randn((hi - lo, BLOCK, KV_HEADS, HEAD_DIM), generator=gen, device=device).to(torch.bfloat16)
            fp8 = quantize_fp8(x, FP8_KV)
            codes[lo:hi], scales[lo:hi] = fp8.codes, fp8.scales
        caches.append(FP8Tensor(codes, scales, (1, HEAD_DIM)))
    return caches[0], caches[1]


def _tables(num_seqs: int, blocks_per_seq: int, gen, device) -> torch.Tensor:
    """Shuffled, non-contiguous block tables; width padded to a multiple of 16 (one kernel specialisation)."""
    perm = torch.randperm(num_seqs * blocks_per_seq, generator=gen, device=device).to(torch.int32)
    width = -(-blocks_per_seq // 16) * 16
    tables = torch.zeros((num_seqs, width), dtype=torch.int32, device=device)
    tables[:, :blocks_per_seq] = perm.view(num_seqs, blocks_per_seq)
    return tables


def phase_inputs(gen, device):
    """One sequence of PHASE_LEN tokens in a shuffled FP8 cache: q, caches, and the launches' (positions,
    query_seq, block_tables) for its whole prefill and for its decodes in one launch (one-token sequences
    sharing the table)."""
    n = PHASE_LEN
    blocks = -(-n // BLOCK)
    k_cache, v_cache = fp8_cache(blocks, gen, device)
    q = torch.randn((n, HEADS, HEAD_DIM), generator=gen, device=device).to(torch.bfloat16)
    table = _tables(1, blocks, gen, device)
    positions = torch.arange(n, device=device)
    prefill = (positions, torch.zeros(n, dtype=torch.int64, device=device), table)
    decode = (positions, torch.arange(n, device=device), table.expand(n, -1).contiguous())
    return q, k_cache, v_cache, prefill, decode


def batch_inputs(batch: int, context: int, gen, device):
    """batch sequences of context tokens, one query each at position context - 1."""
    blocks = -(-context // BLOCK)
    k_cache, v_cache = fp8_cache(batch * blocks, gen, device)
    q = torch.randn((batch, HEADS, HEAD_DIM), generator=gen, device=device).to(torch.bfloat16)
    positions = torch.full((batch,), context - 1, device=device)
    return q, k_cache, v_cache, (positions, torch.arange(batch, device=device), _tables(batch, blocks, gen, device))


# ---- comparisons ----

def _differ(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    return ~((ref == got) | (ref.isnan() & got.isnan()))


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Tokens (dim 0) whose rows differ, and the first differing element (token, head, index, both values)."""
    bad = _differ(ref.float(), got.float())
    tokens = bad.flatten(1).any(1)
    result = dict(tokens_differ=int(tokens.sum()), of=int(ref.shape[0]), elements_differ=int(bad.sum()))
    if result["tokens_differ"]:
        t = int(tokens.nonzero()[0])
        h, i = (int(x) for x in bad[t].nonzero()[0])
        diff = (ref.float() - got.float()).abs()
        result["first"] = dict(token=t, head=h, index=i, ref=float(ref[t, h, i]), got=float(got[t, h, i]))
        result["max_abs_diff"] = float(torch.where(bad, diff, 0).nan_to_num(0).max())
    return result


def locate(ref_dbg, got_dbg) -> dict:
    """Where two programs part: the (token, head) rows whose first-tile scores differ (QK^T), and among the
    rows with equal scores those whose first-tile P V accumulator differs (P V)."""
    (rs, ra), (gs, ga) = ref_dbg, got_dbg
    score_bad = _differ(rs, gs).any(-1)                      # [T, H]
    acc_bad = _differ(ra, ga).any(-1) & ~score_bad
    result = dict(rows=int(score_bad.numel()), scores_rows_differ=int(score_bad.sum()),
                  acc_rows_differ_with_equal_scores=int(acc_bad.sum()))
    for name, bad, r, g in (("scores", score_bad, rs, gs), ("acc", acc_bad, ra, ga)):
        if bad.any():
            t, h = (int(x) for x in bad.nonzero()[0])
            i = int(_differ(r[t, h], g[t, h]).nonzero()[0])
            result[f"first_{name}"] = dict(token=t, head=h, index=i, ref=float(r[t, h, i]), got=float(g[t, h, i]))
    result["verdict"] = ("QK^T" if result["scores_rows_differ"] else
                         "P V" if result["acc_rows_differ_with_equal_scores"] else "after the first tile")
    return result


# ---- the GPU run ----

def _timer(rep_ms: int):
    from onepath.bench.results import kernel_us
    graph = hasattr(triton.testing, "do_bench_cudagraph")
    return (lambda fn: kernel_us(fn, rep_ms, graph=graph)), ("CUDA graph replays (do_bench_cudagraph median)"
                                                              if graph else "do_bench median, L2 flushed")


def bits(args, result, save):
    """(A): every variant's programs against its own 64-row prefill and the shipped kernel."""
    from onepath.ops.cuda.attention import paged_attention

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, kc, vc, prefill, decode = phase_inputs(gen, DEVICE)
    scale = HEAD_DIM ** -0.5
    shipped = paged_attention(q, kc, vc, *prefill, scale, split_kv=False, decode_program=False)
    plain = [c.dequantize(q.dtype) for c in (kc, vc)]
    plain_decode = paged_attention(q, *plain, *decode, scale, split_kv=False, decode_program=True)
    result["phase_shipped"] = dict(
        bf16_decode_program_over_dequantised_vs_fp8_64_row=compare(shipped, plain_decode),
        fp8_64_row_decode_vs_prefill=compare(shipped, paged_attention(q, kc, vc, *decode, scale, split_kv=False,
                                                                      decode_program=False)))
    rows = result.setdefault("bits", {})
    for v in args.variants:
        entry = rows[v.name] = dict(variant=asdict(v), load=v.load)
        try:
            run = lambda launch, program, **kw: attend(v, q, kc, vc, *launch, scale, program == "one-warp", **kw)
            ref, _, _, k64 = run(prefill, "64-row")
            one, _, _, k16 = run(decode, "one-warp")
            entry["builds"] = {"64-row": _launch_info(k64), "one-warp": _launch_info(k16)}
            entry["64-row prefill vs shipped 64-row"] = compare(shipped, ref)
            entry["one-warp decode vs own 64-row prefill"] = compare(ref, one)
            entry["one-warp decode vs shipped 64-row"] = compare(shipped, one)
            entry["one-warp decode vs shipped bf16 decode program over the dequantised cache"] = compare(plain_decode, one)
            entry["one-warp prefill vs own 64-row prefill"] = compare(ref, run(prefill, "one-warp")[0])
            entry["64-row decode vs own 64-row prefill"] = compare(ref, run(decode, "64-row")[0])
            if args.split:
                entry["one-warp decode split-KV vs in-register"] = compare(one, run(decode, "one-warp", split=True)[0])
        except Exception as e:  # a build or launch error: recorded, the run goes on
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        save()
        built = (entry.get("builds") or {}).get("one-warp") or {}
        differ = entry.get("one-warp decode vs own 64-row prefill", {}).get("tokens_differ")
        print(f"  bits {v.name:24s} kWidth {built.get('dot_kwidth', '?')}: " + (
            f"{differ} of {PHASE_LEN} tokens differ" if differ is not None else entry.get("error", "")[:120]), flush=True)
    return q, kc, vc, prefill, decode


def localise(args, result, save, phase, deadline):
    """Where the one-warp decode parts from the 64-row prefill (debug builds): for the first variant that
    differs, the first that agrees, and every variant whose bits contradict its kWidth (all: --locate-all)."""
    q, kc, vc, prefill, decode = phase
    scale = HEAD_DIM ** -0.5
    seen = set()
    for v in args.variants:
        entry = result["bits"].get(v.name, {})
        differ = entry.get("one-warp decode vs own 64-row prefill", {}).get("tokens_differ")
        if differ is None:
            continue
        same = differ == 0
        if not (args.locate_all or same not in seen or same != (v.kwidth == 2)):
            continue
        seen.add(same)
        if time.monotonic() > deadline:
            entry["locate"] = "skipped: past --budget-s"
            continue
        try:
            out64, *dbg64, _ = attend(v, q, kc, vc, *prefill, scale, False, debug=True)
            out16, *dbg16, _ = attend(v, q, kc, vc, *decode, scale, True, debug=True)
            entry["locate"] = locate(dbg64, dbg16)
            ref = attend(v, q, kc, vc, *prefill, scale, False)[0]
            entry["locate"]["debug_build_outputs_unchanged"] = bool(
                torch.equal(out64, ref) and torch.equal(out16, attend(v, q, kc, vc, *decode, scale, True)[0]))
        except Exception as e:
            entry["locate"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        save()


def speed(args, result, save):
    """(B): us per layer launch at batch 256, and the one-warp vs 64-row bits on these inputs."""
    timer, how = _timer(args.rep_ms)
    result["timing"] = how
    for context in args.contexts:
        _speed_at(context, args, timer, result, save)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def _speed_at(context, args, timer, result, save):
    from onepath.ops.cuda.attention import paged_attention

    rows = result.setdefault("speed", [])
    checks = result.setdefault("batch_bits", {})[str(context)] = {}
    scale = HEAD_DIM ** -0.5
    gen = torch.Generator(device=DEVICE).manual_seed(context)
    q, kc, vc, launch = batch_inputs(BATCH, context, gen, DEVICE)
    kb, vb = kc.dequantize(torch.bfloat16), vc.dequantize(torch.bfloat16)
    fp8_bytes = 2 * BATCH * context * KV_HEADS * (HEAD_DIM + 4)
    bf16_bytes = 2 * BATCH * context * KV_HEADS * HEAD_DIM * 2

    def row(name, program, fn, moved):
        us = timer(fn)
        rows.append(dict(context=context, batch=BATCH, name=name, program=program, us=us, layers28_ms=us * 28e-3,
                         bytes=moved, gb_s=moved / us * 1e-3, of_hbm=moved / us * 1e-6 / HBM_TB_S))
        print(f"  L {context:5d}  {name:24s} {program:9s} {us:8.1f} us  {moved / us * 1e-3:6.0f} GB/s", flush=True)
        save()

    derived = {}
    shipped64 = lambda: paged_attention(q, kc, vc, *launch, scale, max_context=context, derived=derived)
    bf16 = lambda: paged_attention(q, kb, vb, *launch, scale, max_context=context, derived=derived)
    row("shipped bf16", "one-warp", bf16, bf16_bytes)
    row("shipped fp8", "64-row", shipped64, fp8_bytes)
    ref = shipped64()
    checks["bf16 decode program over dequantised vs shipped fp8 64-row"] = compare(ref, bf16())
    for v in args.variants:
        try:
            outs = {}
            for program in PROGRAMS:
                dv = {}
                fn = lambda: attend(v, q, kc, vc, *launch, scale, program == "one-warp", derived=dv,
                                    max_context=context)[0]
                outs[program] = fn()
                row(v.name, program, fn, fp8_bytes)
            checks[v.name] = {"one-warp vs 64-row": compare(outs["64-row"], outs["one-warp"]),
                              "64-row vs shipped fp8 64-row": compare(ref, outs["64-row"])}
        except Exception as e:
            checks[v.name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            traceback.print_exc()
        save()


def print_report(result):
    from onepath.bench.results import print_table

    table = []
    for name, e in result.get("bits", {}).items():
        if "error" in e:
            table.append([name, "-", "-", "error: " + e["error"].splitlines()[0][:120]])
            continue
        kw = (e.get("builds") or {}).get("one-warp") or {}
        dec = e["one-warp decode vs own 64-row prefill"]
        first = dec.get("first")
        loc = e.get("locate")
        table.append([name, e["load"], str(kw.get("dot_kwidth", "?")), dec["tokens_differ"],
                      e["one-warp prefill vs own 64-row prefill"]["tokens_differ"],
                      e["64-row prefill vs shipped 64-row"]["tokens_differ"],
                      e["one-warp decode vs shipped 64-row"]["tokens_differ"],
                      loc.get("verdict") if isinstance(loc, dict) else (loc or "-"),
                      f"t{first['token']} h{first['head']} d{first['index']}: {first['ref']:.6g} vs {first['got']:.6g}"
                      if first else "-"])
    print_table(f"(A) bits over {PHASE_LEN} tokens (tokens differing)",
                ["variant", "load", "kWidth", "1w decode", "1w prefill", "64 vs shipped", "1w vs shipped",
                 "parts at", "first difference (ref vs one-warp)"], table)
    speed_rows = result.get("speed", [])
    if speed_rows:
        base = {r["context"]: r["us"] for r in speed_rows if r["name"] == "shipped bf16"}
        print_table(f"(B) batch {BATCH}, one layer launch ({result.get('timing')})",
                    ["context", "name", "program", "us", "x28 ms", "GB/s", "of 4.8 TB/s", "vs bf16 decode"],
                    [[r["context"], r["name"], r["program"], r["us"], r["layers28_ms"], r["gb_s"], r["of_hbm"],
                      base.get(r["context"], math.nan) / r["us"]] for r in speed_rows])
    for context, checks in result.get("batch_bits", {}).items():
        print(f"\nbatch {BATCH} context {context}: tokens differing, one-warp vs 64-row (and 64-row vs shipped)")
        for name, c in checks.items():
            if "error" in c:
                print(f"  {name:28s} error: {c['error'].splitlines()[0][:120]}")
            elif "tokens_differ" in c:
                print(f"  {name:28s} {c['tokens_differ']}")
            else:
                print(f"  {name:28s} {c['one-warp vs 64-row']['tokens_differ']} "
                      f"({c['64-row vs shipped fp8 64-row']['tokens_differ']})")


def run(args) -> None:
    from onepath.bench.results import environment, save_json

    start = time.monotonic()
    result = dict(environment(DEVICE), command="python " + " ".join(sys.argv),
                  shape=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK, kv_tile=KV_TILE,
                             kv_split=KV_SPLIT, phase_len=PHASE_LEN, batch=BATCH, contexts=list(args.contexts)),
                  variants=[dict(asdict(v), load=v.load) for v in args.variants])
    out = Path(args.out)
    save = lambda: save_json(result, out)
    phase = bits(args, result, save)
    print_report(result)
    print(f"bits done at {time.monotonic() - start:.0f} s", flush=True)
    speed(args, result, save)
    print(f"speed done at {time.monotonic() - start:.0f} s", flush=True)
    if not args.no_locate:
        localise(args, result, save, phase, start + args.budget_s)
    result["wall_s"] = time.monotonic() - start
    save()
    print_report(result)
    print(f"wrote {out} in {result['wall_s']:.0f} s")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="lab/results/attention-fp8-variants.json")
    p.add_argument("--variants", nargs="+", choices=[v.name for v in VARIANTS], help="default: all")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--rep-ms", type=int, default=20, help="timing budget per measurement")
    p.add_argument("--split", action="store_true", help="also the split-KV launch of each one-warp decode")
    p.add_argument("--no-locate", action="store_true", help="skip the debug builds (first-tile scores and P V)")
    p.add_argument("--locate-all", action="store_true", help="debug builds for every variant, not only a few")
    p.add_argument("--budget-s", type=float, default=150, help="no debug build starts after this many seconds")
    p.add_argument("--builds", action="store_true", help="print the sm_90 builds (kWidth, MMA) without a GPU")
    args = p.parse_args()
    args.variants = [v for v in VARIANTS if not args.variants or v.name in args.variants]
    if args.builds:
        for v in args.variants:
            for program in PROGRAMS:
                try:
                    print(f"{v.name:24s} {program:9s} {sm90_build(v, program == 'one-warp')}", flush=True)
                except Exception as e:
                    print(f"{v.name:24s} {program:9s} build error: {type(e).__name__}: {str(e)[:300]}", flush=True)
    if not torch.cuda.is_available():
        print("attention_fp8_variants: no CUDA device here; nothing run on a GPU (run it on the GPU machine)")
        return
    run(args)


if __name__ == "__main__":
    main()
