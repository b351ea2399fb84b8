"""paged attention on Hopper: one Triton kernel for prefill, chunked prefill, decode and the training forward.

The contract: a query's output bits are a function of its own q, its sequence's cached K/V, its
absolute position p, the window, `kv_tile` and `kv_split`; never of the other queries in the launch,
their number, the phase, or where its K/V sit in the paged cache. What keeps it:
- keys are reduced in tiles of absolute positions [j*kv_tile, (j+1)*kv_tile), ascending, with an
  online softmax in FP32 (running max, rescale per tile, exp2 of pre-scaled scores). Tiles are
  grouped into splits of absolute positions [s*kv_split, (s+1)*kv_split): each split starts a fresh
  (max, sum, acc) and the splits are merged in ascending order by `_merge`. The tree is fixed by p;
- masked keys score -inf and contribute exact zeros. A program's rows end in the same tile (their
  positions share one kv_tile-aligned block); with a window they may start in different tiles, and
  a leading tile or split without a key for a row keeps that row's state at exactly (-inf, 0, 0)
  (`_rescale` is 1 when the max does not move), the state a fresh start has. A tile whose keys all
  lie in every row's range gives each row the same values without the mask: the in-register 64-row
  program runs such tiles in a loop of their own, unmasked (`_interior_tiles`);
- every dot has one shape in every launch: [BLOCK_M, D] x [D, kv_tile] for the scores and
  [BLOCK_M, kv_tile] x [kv_tile, D] for P V (P rounded once to the cache dtype, accumulated in FP32),
  and a query sits at rows fixed by its position (below), so its dot rows see the same instruction
  stream whatever fills the other rows; `input_precision="ieee"` keeps FP32 inputs out of TF32;
- `enable_fp_fusion=False`: no mul+add is contracted into an FMA at the compiler's choice, so the
  merge in registers and the merge kernel run the same IEEE operations; NUM_WARPS is one constant
  (it fixes the MMA layout, hence the order of each row's max and sum inside a tile).

Program mapping: a program owns one KV head and BLOCK_M = 64 rows: the positions [i*Q, (i+1)*Q) of ONE
sequence (Q = min(64 / group, kv_tile), group padded to a power of two) times the group's query heads
(GQA: the H / Hkv heads that read one K/V head). Position p takes rows (p % Q) * group + (0..group):
the same rows in prefill, in a chunk and in decode. A prefill program shares each K/V tile among Q
queries; a decode program holds one (the MMA rows it wastes are free: decode is bound by the K/V read).
Two launches, same bits: in-register (grid [query blocks, Hkv]; a program walks all its tiles in one
loop, one software pipeline, and folds each finished split into its running state where the next
begins) and split-KV (grid [query blocks, Hkv, splits]; one split per program writes FP32 partials, then
`_merge_splits_kernel` merges a row's splits in the same order with the same `_merge`). Split-KV fills
the SMs when few queries cover long contexts (decode); the choice is speed only, and
tests/ops/test_attention_gpu.py proves both launches give the same bits.

Two program shapes, same bits: the 64-row program (4 warps, Hopper's wgmma) and the decode program
(DECODE_BLOCK_M = 16 rows, one warp, mma.sync). wgmma gives each of its 4 warps 16 whole rows with the
accumulator layout mma.sync gives one warp holding 16 rows: a row meets the same MMA chain and the same
in-thread and in-quad order of its max and sum in both, so its bits do not depend on which program
holds it (tests/ops/test_attention_gpu.py; a 16-row program of TWO warps splits the key columns between
them and gives other bits: the test's negative control). A decode program wastes 14 of its 16 rows
instead of 62 of 64; a launch of one query per sequence takes it, any other the 64-row one. Over an FP8 cache
too, because each dequantised tile passes `_opaque` (Triton sizes mma.sync operands by the 8-bit loads behind
them otherwise). Timings and the diagnosis: docs/ops/attention.md.

FP8 KV cache (FP8_KV constexpr): the caches are FP8Tensors (float8_e4m3fn codes, FP32 scales per token
and head). Each K/V tile is loaded as codes and scales and dequantised in registers as ops/attention.py's
`load_slots` does, (code.to(fp32) * scale).to(q's dtype), before the dots: the same bits as this kernel
reading a cache of q's dtype that holds the dequantised values. The kernel only reads; write_kv quantises.
Caches written by FP8_KV's rule (power-of-two scales, at most 2^7: `pow2_kv`) and read by BF16 queries take
FP8_KV = KV_FP8_POW2: `_e4m3_pow2_to_bf16` forms the same BF16 values in fewer instructions (4 per pair of
codes instead of 6).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.numerics.quant import FP8Tensor
from onepath.numerics.spec import KV_AMAX_CEIL
from onepath.ops.cuda import interpreting, sm_count

# Rows (query tokens x group heads) per program: one shape for every launch, so every dot is the same.
# The spec may set another (OpSpec.q_rows): fewer rows waste less of a decode program (one token, its
# group's heads), at the price of more programs re-reading K/V in prefill; 64 is Hopper's wgmma M.
BLOCK_M = 64
# Fixes the MMA layout, hence the order of a row's max and sum inside a tile: one value for both launches.
NUM_WARPS = 4
NUM_STAGES = 3
# The decode program: rows, warps, pipeline stages (its bits are the 64-row program's, see above).
DECODE_BLOCK_M, DECODE_NUM_WARPS, DECODE_NUM_STAGES = 16, 1, 2
# Over an FP8 cache the same stages and launch rule (less the deep decode, below); speed only (docs/ops/attention.md).
# split-KV launch when the in-register grid would give fewer than this many programs per SM.
SPLIT_BELOW_PROGRAMS_PER_SM = 4
# FP8 cache tiles pass `_opaque` after their dequantisation, so the one-warp program keeps the 64-row
# program's bits (off: the bits it had without, the GPU test's negative control).
OPAQUE_FP8_TILES = True
# In-register launches of the 64-row program run tiles whose every key is in every row's range without masks
# (fewer instructions per tile, the same values; off: every tile masked, the GPU test's reference). The decode
# program and split-KV launches keep one loop: three software pipelines spilled their registers.
UNMASKED_INTERIOR = True
# Programs read each tile's block-table entries with one unmasked inline-asm ld.global.nc (`_load_entries`;
# entries clamped into the program's own blocks) instead of a masked tl.load; `table_load_asm` says which. The
# same bits (tests/ops/test_attention_gpu.py); off under the CPU interpreter, which runs no inline asm.
# Where it runs (the decode program, the 64-row one over BF16, FP8 split-KV only) follows the builds and timings of
# docs/ops/attention.md.
TABLE_LOAD_ASM = True
# The BF16 decode program's grid at DEEP_DECODE_PROGRAMS_PER_SM programs per SM (both ends included) launches
# in-register at DEEP_DECODE_NUM_STAGES stages (a second K/V buffer, so fewer programs fit an SM and one wave still
# holds the grid) instead of split-KV or in-register at 2 (docs/ops/attention.md). Speed only: stages and launch
# move no bit (tests/ops/test_attention_gpu.py::test_deep_decode_launch_equals_other_launches).
DEEP_DECODE_PROGRAMS_PER_SM, DEEP_DECODE_NUM_STAGES = (3, 5), 3
# FP8_KV constexpr values: a cache of q's dtype; FP8 codes with FP32 scales; FP8 codes whose scales are powers
# of two no larger than 2^7 (pow2_kv), read by BF16 queries, dequantised by _e4m3_pow2_to_bf16 with the factor
# 2^120 * scale (POW2_FACTOR = 2^120).
KV_PLAIN, KV_FP8, KV_FP8_POW2 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
POW2_FACTOR = tl.constexpr(2.0 ** 120)
# "No window": a lower key bound below every position.
NO_WINDOW = 1 << 30
LOG2E = 1.4426950408889634


@triton.jit
def _rescale(m, m_new):
    # exp2(m - m_new), and exactly 1 when the max did not move: a tile or split without any key for
    # the row then leaves (max, sum, acc) unchanged bit for bit, and no -inf - -inf NaN appears.
    return tl.where(m_new == m, 1.0, tl.exp2(m - m_new))


@triton.jit
def _merge(m, l, acc, m_split, l_split, acc_split):
    """Fold one split's (max, sum, acc) into the running state; shared by both launches."""
    m_new = tl.maximum(m, m_split)
    a = _rescale(m, m_new)
    b = _rescale(m_split, m_new)
    return m_new, l * a + l_split * b, acc * a[:, None] + acc_split * b[:, None]


@triton.jit
def _opaque(x, OPAQUE: tl.constexpr):
    """x unchanged, through an identity the compiler may not look through (an impure inline asm move).
    Triton sizes an mma.sync operand (kWidth) by the narrowest tensor loaded behind it: behind FP8 codes
    the one-warp program's dots get kWidth 4, which places each lane's products in other MMA slots than
    the 64-row program's wgmma order and gave other bits; behind the barrier the dequantised tile counts
    as 32-bit and the dots get kWidth 2, the BF16 cache's layout, and the two programs' bits agree
    (docs/ops/attention.md).
    OPAQUE is off under the CPU interpreter, which runs no inline asm (the identity changes no value)."""
    if OPAQUE:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)
    return x


@triton.jit
def _e4m3_pow2_to_bf16(codes, factor):
    """codes (float8e4nv) -> code * scale in BF16, where factor = 2^120 * scale (BF16; scale a power of two in
    2^-126..2^7, so the factor is exact and finite): each code's bits placed in a BF16, sign to bit 15, exponent
    and mantissa to bits 7..10 and 4..6, which reads as code * 2^-120 exactly (E4M3's exponent bias is 7, BF16's
    127; an E4M3 subnormal becomes the BF16 subnormal of the same ratio), then one BF16 multiply by the factor:
    the exact product rounded once to BF16, which is what the FP32 rule computes ((code * scale) is exact in
    FP32, then .to(bf16)), bit for bit (tests/ops/test_attention_gpu.py, every code and every such scale). The
    E4M3 NaN codes, which the quantiser never writes, read as +-480 * scale. Per pair of codes: a byte permute
    that copies each code's sign over the byte above it, a shift, a mask, a multiply. Impure: as a pure op
    Triton's layout passes moved it and the decode program issued 1,897 instructions per tile, spilling more,
    instead of 1,326. Its BF16 result also keeps Triton from sizing the mma.sync operands by the 8-bit loads
    (see `_opaque`)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 lo, hi; prmt.b32 lo, $2, 0, 0x9180; prmt.b32 hi, $2, 0, 0xB3A2; shl.b32 lo, lo, 4; "
        "shl.b32 hi, hi, 4; and.b32 lo, lo, 0x87F087F0; and.b32 hi, hi, 0x87F087F0; mul.rn.bf16x2 $0, lo, $3; "
        "mul.rn.bf16x2 $1, hi, $4; }",
        "=r,=r,r,r,r", [codes, factor], dtype=tl.bfloat16, is_pure=False, pack=4)


@triton.jit
def _dequantize(codes, scale, OPAQUE: tl.constexpr, FP8_KV: tl.constexpr, dtype: tl.constexpr):
    """A K or V tile of codes [KV_TILE, D] times its keys' scales [KV_TILE], in dtype (see FP8 KV cache)."""
    if FP8_KV == KV_FP8_POW2:
        factor = (scale * POW2_FACTOR).to(tl.bfloat16)[:, None]
        return _e4m3_pow2_to_bf16(codes, tl.broadcast_to(factor, codes.shape))
    # one FP32 product, then one rounding to dtype: write_kv's quantisation undone as the CPU path undoes it
    return _opaque(codes.to(tl.float32) * scale[:, None], OPAQUE).to(dtype)


@triton.jit
def _load_entries(ptrs):
    """int32 block-table entries by one unmasked global load in inline asm (see TABLE_LOAD_ASM): fewer
    instructions than a masked tl.load, and Triton's pipeliner does not stage it through shared memory."""
    return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _attend_tile(q, j, m_i, l_i, acc, lo_key, last_key, pos, first_key, row_ok, table, k_base, v_base, ks_base,
                 vs_base, d_ok, qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, stride_ksb, stride_kss,
                 stride_vsb, stride_vss, BLOCK_SIZE: tl.constexpr, KV_TILE: tl.constexpr, FP8_KV: tl.constexpr,
                 OPAQUE: tl.constexpr, MASKED: tl.constexpr, FIXED_SLOTS: tl.constexpr, TABLE_ASM: tl.constexpr):
    """Fold KV tile j into the running (max, sum, acc); shared by both launches. MASKED=False for a tile
    whose every key is in every valid row's range (`_interior_tiles`): no load, window or causal mask, so
    a row's values are those the masked tile gives it (its mask is all true there), in fewer instructions.
    TABLE_ASM: the block-table entries come through `_load_entries` (see TABLE_LOAD_ASM)."""
    r = tl.arange(0, KV_TILE)
    key = j * KV_TILE + r
    if FIXED_SLOTS and KV_TILE % BLOCK_SIZE == 0:
        # slots written so that their offsets do not depend on j: the compiler keeps them out of the loop (fewer
        # instructions per tile, more registers: the 64-row program has them, the decode program would spill)
        entry = j * (KV_TILE // BLOCK_SIZE) + r // BLOCK_SIZE
        slot = r % BLOCK_SIZE
    else:
        entry = key // BLOCK_SIZE
        slot = key % BLOCK_SIZE
    if MASKED:
        # Only the program's keys are read: later slots may be unwritten, earlier ones (out of
        # every row's window) may be freed.
        load_ok = (key >= lo_key) & (key <= last_key)
        kv_mask = load_ok[:, None] & d_ok[None, :]
        if TABLE_ASM:
            # entries clamped to the program's own blocks: every read is in the table; a masked key's
            # block is another key's and its K/V load stays masked
            entry = tl.minimum(tl.maximum(entry, lo_key // BLOCK_SIZE), last_key // BLOCK_SIZE)
    else:
        load_ok = r >= 0
        kv_mask = d_ok[None, :]
    if TABLE_ASM:
        block = _load_entries(table + entry).to(tl.int64)
    elif MASKED:
        block = tl.load(table + entry, mask=load_ok, other=0).to(tl.int64)
    else:
        block = tl.load(table + entry).to(tl.int64)
    k = tl.load(k_base + block[:, None] * stride_kb + slot[:, None] * stride_ks, mask=kv_mask, other=0.0)
    v = tl.load(v_base + block[:, None] * stride_vb + slot[:, None] * stride_vs, mask=kv_mask, other=0.0)
    if FP8_KV:
        # masked keys load code 0 and scale 0, the zeros a plain cache gives
        k_scale = tl.load(ks_base + block * stride_ksb + slot * stride_kss, mask=load_ok, other=0.0)
        v_scale = tl.load(vs_base + block * stride_vsb + slot * stride_vss, mask=load_ok, other=0.0)
        k = _dequantize(k, k_scale, OPAQUE, FP8_KV, q.dtype)
    # ieee: fp32 inputs stay fp32 (the default would be TF32); 16-bit inputs ignore it.
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    if MASKED:
        valid = row_ok[:, None] & (key[None, :] <= pos[:, None]) & (key[None, :] >= first_key[:, None])
        scores = tl.where(valid, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = _rescale(m_i, m_new)
    if MASKED:
        p = tl.exp2(scores - tl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
    else:
        p = tl.exp2(scores - m_new[:, None])  # m_new is finite: the tile scored a key in every row
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8_KV:
        # V is dequantised only now, after the QK^T dot: the dequantised K tile's shared-memory buffer is
        # dead by then and V's takes its place, and the one-warp program fits 8 per SM (its registers' limit;
        # tests/ops/test_attention_interpret.py); the same bits (tests/ops/test_attention_gpu.py).
        v = _dequantize(v, v_scale, OPAQUE, FP8_KV, q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _interior_tiles(pos, first_key, row_ok, last_key, tile_lo, tile_end, KV_TILE: tl.constexpr):
    """[a, b): the program's tiles whose every key lies in every valid row's range [first_key, pos], so
    they need no mask (tiles [tile_lo, a) and [b, tile_end) keep theirs)."""
    min_pos = tl.min(tl.where(row_ok, pos, last_key), 0)
    max_first = tl.max(tl.where(row_ok, first_key, 0), 0)
    a = tl.minimum(tl.maximum(tl.cdiv(max_first, KV_TILE), tile_lo), tile_end)
    b = tl.maximum(tl.minimum((min_pos + 1) // KV_TILE, tile_end), a)
    return a, b


@triton.jit
def _walk(q, j_lo, j_hi, tile_lo, m_run, l_run, acc_run, m_i, l_i, acc, lo_key, last_key, pos, first_key, row_ok,
          table, k_base, v_base, ks_base, vs_base, d_ok, qk_scale, stride_kb, stride_ks, stride_vb, stride_vs,
          stride_ksb, stride_kss, stride_vsb, stride_vss, BLOCK_SIZE: tl.constexpr, KV_TILE: tl.constexpr,
          SPLIT_TILES: tl.constexpr, FP8_KV: tl.constexpr, OPAQUE: tl.constexpr, MASKED: tl.constexpr,
          FIXED_SLOTS: tl.constexpr, TABLE_ASM: tl.constexpr):
    """The in-register launch's loop over tiles [j_lo, j_hi): folds each finished split (max, sum, acc)
    into the running state where the next split begins, and returns both states."""
    for j in range(j_lo, j_hi):
        if (j % SPLIT_TILES == 0) & (j > tile_lo):
            m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m_i, l_i, acc)
            m_i = tl.full(m_i.shape, float("-inf"), tl.float32)
            l_i = tl.zeros(l_i.shape, tl.float32)
            acc = tl.zeros(acc.shape, tl.float32)
        m_i, l_i, acc = _attend_tile(q, j, m_i, l_i, acc, lo_key, last_key, pos, first_key, row_ok, table, k_base,
                                     v_base, ks_base, vs_base, d_ok, qk_scale, stride_kb, stride_ks, stride_vb,
                                     stride_vs, stride_ksb, stride_kss, stride_vsb, stride_vss, BLOCK_SIZE,
                                     KV_TILE, FP8_KV, OPAQUE, MASKED, FIXED_SLOTS, TABLE_ASM)
    return m_run, l_run, acc_run, m_i, l_i, acc


@triton.jit
def _program_rows(q_ptr, pos_ptr, seq_ptr, starts_ptr, num_tokens, window, pid, kv_head, stride_qt, stride_qh,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  KV_TILE: tl.constexpr, SPLIT_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr):
    """A program's rows (see the module docstring's program mapping) and what they read: each row's
    sequence, position, validity, window start, query head and token; the program's key range, tiles and
    splits; the head dims and the rows' q."""
    # Rows: the program holds positions [base, base + BLOCK_Q) of one sequence; position base + i takes
    # rows i * GROUP_PAD + (0..GROUP), so a query sits at the same rows of the same dot in every phase
    # and batch. BLOCK_Q divides KV_TILE (all of a program's rows end in the same tile) or is a multiple of
    # it (q_block: a row whose last tile comes before the program's last meets only masked keys there,
    # exact zeros: alpha 1, p 0); either way it divides KV_SPLIT, so the rows end in the same split.
    t0 = tl.load(starts_ptr + pid)
    live = t0 < num_tokens
    t0 = tl.where(live, t0, 0)
    seq = tl.load(seq_ptr + t0)
    first_pos = tl.load(pos_ptr + t0).to(tl.int32)
    rows = tl.arange(0, BLOCK_M)
    offset = rows // GROUP_PAD
    g = rows % GROUP_PAD
    tok = t0 + offset - first_pos % BLOCK_Q
    tok_ok = (tok >= t0) & (tok < num_tokens) & (offset < BLOCK_Q)
    tok_c = tl.where(tok_ok, tok, 0)
    pos = tl.load(pos_ptr + tok_c).to(tl.int32)
    row_ok = live & tok_ok & (g < GROUP) & (tl.load(seq_ptr + tok_c) == seq)
    row_ok = row_ok & (pos == first_pos - first_pos % BLOCK_Q + offset)
    first_key = tl.maximum(pos - window + 1, 0)
    head = kv_head * GROUP + tl.where(g < GROUP, g, 0)
    tok_c = tok_c.to(tl.int64)

    # This program's keys and tiles: the union of its rows' ranges.
    last_key = tl.max(tl.where(row_ok, pos, -1), 0)
    tile_end = tl.where(last_key >= 0, last_key // KV_TILE + 1, 0)
    lo_key = tl.min(tl.where(row_ok, first_key, tile_end * KV_TILE), 0)
    tile_lo = lo_key // KV_TILE
    split_lo = tile_lo // SPLIT_TILES
    split_end = tl.cdiv(tile_end, SPLIT_TILES)

    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + tok_c[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return (seq, pos, row_ok, first_key, head, tok_c, lo_key, last_key, tile_lo, tile_end, split_lo, split_end, d,
            d_ok, q)


@triton.jit(do_not_specialize=["num_tokens", "window", "num_splits"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, pos_ptr, seq_ptr, table_ptr, starts_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    num_tokens, window, qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_table,
    stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vss, stride_vsh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_TILE: tl.constexpr, SPLIT_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, SPLIT: tl.constexpr, FP8_KV: tl.constexpr, OPAQUE: tl.constexpr,
    UNMASKED: tl.constexpr, TABLE_ASM: tl.constexpr,
):
    # Last query block first: in a causal prefill a sequence's later blocks read more tiles, and the short ones
    # then fill the last wave. Which SM runs a program moves no bit.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    num_heads = tl.num_programs(1) * GROUP
    (seq, pos, row_ok, first_key, head, tok_c, lo_key, last_key, tile_lo, tile_end, split_lo, split_end, d, d_ok,
     q) = _program_rows(q_ptr, pos_ptr, seq_ptr, starts_ptr, num_tokens, window, pid, kv_head, stride_qt, stride_qh,
                        GROUP, GROUP_PAD, HEAD_DIM, D_PAD, KV_TILE, SPLIT_TILES, BLOCK_M, BLOCK_Q)
    table = table_ptr + seq.to(tl.int64) * stride_table
    k_base = k_ptr + kv_head * stride_kh + d[None, :]
    v_base = v_ptr + kv_head * stride_vh + d[None, :]
    ks_base = ks_ptr + kv_head * stride_ksh
    vs_base = vs_ptr + kv_head * stride_vsh

    # (max, sum, acc) of the split being reduced: a fresh state at each split's first tile
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    if SPLIT:
        s = tl.program_id(2)
        for j in range(tl.maximum(s * SPLIT_TILES, tile_lo), tl.minimum((s + 1) * SPLIT_TILES, tile_end)):
            m_i, l_i, acc = _attend_tile(q, j, m_i, l_i, acc, lo_key, last_key, pos, first_key, row_ok, table, k_base,
                                         v_base, ks_base, vs_base, d_ok, qk_scale, stride_kb, stride_ks, stride_vb,
                                         stride_vs, stride_ksb, stride_kss, stride_vsb, stride_vss, BLOCK_SIZE,
                                         KV_TILE, FP8_KV, OPAQUE, True, False, TABLE_ASM)
        part = (tok_c * num_heads + head) * num_splits + s
        keep = row_ok & (s >= split_lo) & (s < split_end) & (s < num_splits)
        tl.store(part_m_ptr + part, m_i, mask=keep)
        tl.store(part_l_ptr + part, l_i, mask=keep)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=keep[:, None])
    else:
        # One walk over the program's tiles, folding each finished split into the running state where
        # the next begins: the same operations, in the same order, as reducing every split from a fresh
        # state and merging them in ascending order. UNMASKED: three walks, tiles [tile_lo, a) and
        # [b, tile_end) masked, [a, b) not; else one (the decode program's single software pipeline).
        m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_run = tl.zeros([BLOCK_M], tl.float32)
        acc_run = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        a, b = tile_end, tile_end
        if UNMASKED:
            a, b = _interior_tiles(pos, first_key, row_ok, last_key, tile_lo, tile_end, KV_TILE)
        for walk in tl.static_range(3 if UNMASKED else 1):
            j_lo = tile_lo if walk == 0 else (a if walk == 1 else b)
            j_hi = a if walk == 0 else (b if walk == 1 else tile_end)
            m_run, l_run, acc_run, m_i, l_i, acc = _walk(
                q, j_lo, j_hi, tile_lo, m_run, l_run, acc_run, m_i, l_i, acc, lo_key, last_key, pos, first_key,
                row_ok, table, k_base, v_base, ks_base, vs_base, d_ok, qk_scale, stride_kb, stride_ks, stride_vb,
                stride_vs, stride_ksb, stride_kss, stride_vsb, stride_vss, BLOCK_SIZE, KV_TILE, SPLIT_TILES, FP8_KV,
                OPAQUE, walk != 1, UNMASKED, TABLE_ASM)
        m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m_i, l_i, acc)
        out = acc_run / tl.where(row_ok, l_run, 1.0)[:, None]
        tl.store(out_ptr + tok_c[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["window", "num_splits"])
def _merge_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, pos_ptr,
    window, num_splits, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    KV_SPLIT: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    num_heads = tl.num_programs(1) * GROUP
    g = tl.arange(0, GROUP_PAD)
    row_ok = g < GROUP
    head = kv_head * GROUP + tl.where(row_ok, g, 0)
    d = tl.arange(0, D_PAD)
    pos = tl.load(pos_ptr + tok).to(tl.int32)
    # The splits that hold this row's keys, in the order the in-register launch merges them.
    split_lo = tl.maximum(pos - window + 1, 0) // KV_SPLIT
    split_end = tl.minimum(pos // KV_SPLIT + 1, num_splits)
    m_run = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_run = tl.zeros([GROUP_PAD], tl.float32)
    acc_run = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for s in range(split_lo, split_end):
        part = (tok * num_heads + head) * num_splits + s
        m_i = tl.load(part_m_ptr + part, mask=row_ok, other=float("-inf"))
        l_i = tl.load(part_l_ptr + part, mask=row_ok, other=0.0)
        acc = tl.load(part_acc_ptr + part[:, None] * D_PAD + d[None, :], mask=row_ok[:, None], other=0.0)
        m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m_i, l_i, acc)
    out = acc_run / tl.where(row_ok, l_run, 1.0)[:, None]
    tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d[None, :] < HEAD_DIM))


def _query_blocks(positions: torch.Tensor, query_seq: torch.Tensor, tokens_per_block: int,
                  num_seqs: int) -> torch.Tensor:
    """First token of each program's query block: a run of one sequence's tokens cut where
    position // tokens_per_block changes. Padded with T (empty programs) to a length known from the
    shapes alone, so no host sync and a fixed grid (CUDA graphs)."""
    num_tokens = query_seq.shape[0]
    t = torch.arange(num_tokens, device=query_seq.device)
    aligned = positions // tokens_per_block
    new_block = torch.ones(num_tokens, dtype=torch.bool, device=query_seq.device)
    new_block[1:] = (query_seq[1:] != query_seq[:-1]) | (aligned[1:] != aligned[:-1])
    block = new_block.cumsum(0) - 1
    # A block holds >= 1 token, and a run of n consecutive positions spans <= cdiv(n, tokens_per_block) + 1.
    num_blocks = min(num_tokens, triton.cdiv(num_tokens, tokens_per_block) + 2 * min(num_tokens, num_seqs))
    starts = torch.full((num_blocks,), num_tokens, dtype=torch.int64, device=query_seq.device)
    return starts.scatter_reduce_(0, block, t, "amin")


def launch_plan(programs: int, sms: int, num_splits: int, decode_program: bool, fp8_kv: bool,
                split_kv: bool | None = None, num_stages: int | None = None) -> tuple[bool, int]:
    """(split-KV launch, pipeline stages) of a launch whose in-register grid holds `programs` programs on `sms`
    SMs; split_kv and num_stages, when given, are kept. Split-KV when the in-register grid gives fewer than
    SPLIT_BELOW_PROGRAMS_PER_SM per SM and the keys span several splits, unless the BF16 decode program runs
    deep (DEEP_DECODE_PROGRAMS_PER_SM: in-register at DEEP_DECODE_NUM_STAGES). Speed only: no bit moves."""
    low, high = DEEP_DECODE_PROGRAMS_PER_SM
    deep = decode_program and not fp8_kv and low * sms <= programs <= high * sms
    split = split_kv if split_kv is not None else (
        num_splits > 1 and not deep and programs < SPLIT_BELOW_PROGRAMS_PER_SM * sms)
    if num_stages is None:
        num_stages = NUM_STAGES if not decode_program else (
            DEEP_DECODE_NUM_STAGES if deep and not split else DECODE_NUM_STAGES)
    return split, num_stages


def table_load_asm(fp8_kv: bool, decode_program: bool, split: bool) -> bool:
    """Whether a launch reads its block table by inline asm by default (TABLE_LOAD_ASM's rule): every program over
    a BF16 cache, the decode program's split-KV launch over an FP8 one."""
    return TABLE_LOAD_ASM and (not fp8_kv or (decode_program and split))


def pow2_kv(rule) -> bool:
    """Whether codes written by `rule` (a QuantSpec, or None when unknown) have power-of-two scales of at most
    2^7, which `_e4m3_pow2_to_bf16` dequantises exactly: ue8m0 scales under an amax ceiling of KV_AMAX_CEIL
    (448 * 2^7) or less, as FP8_KV's. (They are 2^-126 and up: the quantiser clamps the exponent field.)"""
    return (rule is not None and rule.format == "fp8_e4m3" and rule.scale_dtype == "ue8m0"
            and rule.amax_ceil is not None and rule.amax_ceil <= KV_AMAX_CEIL)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor | FP8Tensor, v_cache: torch.Tensor | FP8Tensor,
                    positions: torch.Tensor,
                    query_seq: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    sliding_window: int | None = None, kv_tile: int = 32, kv_split: int = 256,
                    split_kv: bool | None = None, max_context: int | None = None,
                    num_stages: int | None = None, derived: dict | None = None,
                    block_m: int | None = None, num_warps: int = NUM_WARPS,
                    decode_program: bool | None = None, q_block: int | None = None,
                    table_asm: bool | None = None) -> torch.Tensor:
    """Causal attention of each query over its own sequence's keys in a paged KV cache.

    q [T, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (this step's K/V already written), of
    q's dtype or FP8Tensors (codes float8_e4m3fn, scales FP32 [num_blocks, block_size, Hkv, 1]);
    positions [T] absolute position p of each query, which attends to keys 0..p (and > p - window);
    query_seq [T] the query's row in block_tables [B, max_blocks]; a sequence's queries are contiguous
    in T at consecutive positions (an engine chunk, a training sequence); queries that are not are
    left unwritten. Key at position j lives at slot block_tables[seq, j // block_size] * block_size + j % block_size.
    kv_tile and kv_split (keys per tile, keys per split) fix the reduction tree, block_m (rows per program,
    default BLOCK_M; the spec's attention.q_rows) every dot's shape: both sides must agree on all three.
    split_kv picks the launch (None: split-KV when the in-register grid leaves the SMs short of programs, unless
    the decode program runs deep, see DEEP_DECODE_PROGRAMS_PER_SM);
    max_context (keys, default the block tables' capacity) bounds the split-KV partial buffer;
    num_stages is the loads' software pipelining depth (None: NUM_STAGES, DECODE_NUM_STAGES or
    DEEP_DECODE_NUM_STAGES). Launch and pipelining move no bit; num_warps
    (default NUM_WARPS) fixes the MMA layout, so both sides must agree on it too. decode_program picks the
    16-row one-warp program, which gives the 64-row program's bits (None: when the launch holds one query
    per sequence, T <= block_tables' rows, and block_m and num_warps are the defaults). derived: a dict
    kept with the batch (AttentionMetadata.derived): the query blocks, a function of positions and
    query_seq alone, are computed by the first layer and reused by the others (a dozen small kernels less
    per layer). q_block: positions per program of a block_m-row program (default min(block_m / group,
    kv_tile)); more than kv_tile lets a prefill program span several tiles and share each K/V tile among
    more queries. A row's dot, masks and reduction are the same at any row of the program, so it moves no
    bit (the decode program keeps its own; tests/ops/test_attention_gpu.py on the H200). It is opt-in: 128
    rows spanning two tiles prefilled slower than 64 (docs/ops/attention.md).
    table_asm: the program reads its block-table entries by inline asm (None: `table_load_asm`'s rule); no bit
    moves. FP8 caches dequantise by `_e4m3_pow2_to_bf16` where their rule allows it (`pow2_kv`); no bit moves.
    Returns [T, H, D] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    fp8_kv = isinstance(k_cache, FP8Tensor)
    if fp8_kv != isinstance(v_cache, FP8Tensor):
        raise TypeError("paged_attention: k_cache and v_cache must both be FP8Tensors or both plain tensors")
    kv_mode = KV_PLAIN.value
    if fp8_kv:
        pow2 = q.dtype == torch.bfloat16 and pow2_kv(k_cache.rule) and pow2_kv(v_cache.rule) and not interpreting()
        kv_mode = (KV_FP8_POW2 if pow2 else KV_FP8).value
        (k_cache, k_scales), (v_cache, v_scales) = (k_cache.codes, k_cache.scales), (v_cache.codes, v_cache.scales)
        if k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != torch.float8_e4m3fn \
                or k_scales.dtype != torch.float32 or v_scales.dtype != torch.float32:
            raise TypeError(f"paged_attention: FP8 caches hold float8_e4m3fn codes and float32 scales, got "
                            f"{k_cache.dtype}/{k_scales.dtype} and {v_cache.dtype}/{v_scales.dtype}")
        if k_scales.shape != (*k_cache.shape[:3], 1) or v_scales.shape != k_scales.shape:
            raise ValueError(f"paged_attention: scales {tuple(k_scales.shape)}, {tuple(v_scales.shape)} must be "
                             f"[blocks, block_size, Hkv, 1] = {(*k_cache.shape[:3], 1)}: one per token and head")
    else:
        k_scales, v_scales = k_cache, v_cache  # unread: FP8_KV is off
    num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or kv_dim != head_dim:
        raise ValueError(f"paged_attention: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} do not match (expected caches [blocks, block_size, Hkv, D])")
    if num_heads % num_kv_heads:
        raise ValueError(f"paged_attention: {num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if kv_tile < 16 or kv_tile & (kv_tile - 1):
        raise ValueError(f"paged_attention: kv_tile {kv_tile} must be a power of two >= 16 (a tl.dot dimension)")
    if kv_split % kv_tile:
        raise ValueError(f"paged_attention: kv_split {kv_split} must be a multiple of kv_tile {kv_tile}")
    if block_size & (block_size - 1):
        raise ValueError(f"paged_attention: block_size {block_size} must be a power of two")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention: the caches' head_dim must be contiguous (stride 1)")
    if not fp8_kv and (q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype):
        raise TypeError(f"paged_attention: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype} must match")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
        raise ValueError(f"paged_attention: block_m {block_m} must be a power of two >= 16 (a tl.dot dimension)")
    default_program = ((block_m or BLOCK_M) == BLOCK_M and num_warps == NUM_WARPS
                       and group_pad <= 2 * DECODE_BLOCK_M)
    if decode_program is None:
        decode_program = default_program and num_tokens <= block_tables.shape[0]
    elif decode_program and not default_program:
        raise ValueError(f"paged_attention: the decode program gives the bits of the default {BLOCK_M}-row "
                         f"{NUM_WARPS}-warp program only; got block_m {block_m}, num_warps {num_warps}, "
                         f"{group} query heads per KV head (at most {2 * DECODE_BLOCK_M})")
    if decode_program:
        block_m, num_warps = max(DECODE_BLOCK_M, group_pad), DECODE_NUM_WARPS
    block_m = max(block_m or BLOCK_M, group_pad)
    block_q = min(block_m // group_pad, kv_tile)
    if q_block is not None and not decode_program:
        if q_block & (q_block - 1) or not 1 <= q_block <= block_m // group_pad or kv_split % q_block:
            raise ValueError(f"paged_attention: q_block {q_block} must be a power of two dividing kv_split {kv_split}, "
                             f"at most the {block_m // group_pad} positions {block_m} rows hold at {group} heads each")
        block_q = q_block
    d_pad = max(16, triton.next_power_of_2(head_dim))
    window = sliding_window or NO_WINDOW
    positions = positions.contiguous()
    query_seq = query_seq.contiguous()
    key = ("query_blocks", block_q)
    starts = derived.get(key) if derived is not None else None
    if starts is None:
        starts = _query_blocks(positions, query_seq, block_q, block_tables.shape[0])
        if derived is not None:
            derived[key] = starts
    max_context = max_context or block_tables.shape[1] * block_size
    num_splits = triton.cdiv(max_context, kv_split)
    sms = sm_count(q.device) if q.is_cuda else 1
    split, num_stages = launch_plan(starts.shape[0] * num_kv_heads, sms, num_splits, decode_program, fp8_kv,
                                    split_kv, num_stages)
    if split:
        part_m = torch.empty((num_tokens, num_heads, num_splits), device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_tokens, num_heads, num_splits, d_pad), device=q.device, dtype=torch.float32)
    else:
        part_m = part_l = part_acc = None
    common = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=d_pad, num_warps=num_warps,
                  enable_fp_fusion=False)
    _paged_attention_kernel[(starts.shape[0], num_kv_heads, num_splits if split else 1)](
        q, k_cache, v_cache, k_scales, v_scales, out, positions, query_seq, block_tables, starts,
        part_acc, part_m, part_l,
        num_tokens, window, scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        k_scales.stride(0), k_scales.stride(1), k_scales.stride(2),
        v_scales.stride(0), v_scales.stride(1), v_scales.stride(2),
        BLOCK_SIZE=block_size, KV_TILE=kv_tile, SPLIT_TILES=kv_split // kv_tile, BLOCK_M=block_m,
        BLOCK_Q=block_q, SPLIT=split, FP8_KV=kv_mode,
        OPAQUE=fp8_kv and OPAQUE_FP8_TILES and not interpreting(),
        UNMASKED=UNMASKED_INTERIOR and not (decode_program or split),
        TABLE_ASM=(table_load_asm(fp8_kv, decode_program, split) if table_asm is None else table_asm)
        and not interpreting(),
        num_stages=num_stages, **common,
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_kv_heads)](
            part_acc, part_m, part_l, out, positions, window, num_splits, out.stride(0), out.stride(1),
            KV_SPLIT=kv_split, **common,
        )
    return out
