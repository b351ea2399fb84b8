"""ssd on Hopper: the chunked scan in one program per (sequence, head, block of head_dim), one arithmetic for every
phase (docs/ops/ssd.md).

A program walks its sequence's chunks in order, absolute positions [c*Q, (c+1)*Q) whatever the pass, with the state
S_c at the chunk's start in registers (from the slot when the pass starts past position 0). For each chunk it loads
the chunk's dt (the open chunk's earlier tokens from the slot, the pass's from its input, zeros past them),
a = dt * A, cum = cumsum(a) over the chunk (element l of a prefix scan combines a_0..a_l alone, so the values past a
row never reach it), and then, for each block of BLOCK_L rows that holds a new token, over the chunk's columns in
blocks of BLOCK_S from the first up to the block's last row (x, dt, B loaded per column block, as dt above):

    CB_s   = C_rows @ B_s^T                                          [BLOCK_L, BLOCK_S], K = N
    W_s    = where(s <= l, (CB_s * exp(cum_l - cum_s)) * dt_s, 0)
    inner  = sum over the column blocks, in order, of W_s @ x_s      [BLOCK_L, P], K = BLOCK_S
    y      = (inner  +  exp(cum_l) * (C_rows @ S_c^T))  +  D * x_l  K = N

and, where the pass closes the chunk, S_{c+1} = round_state(exp(cum_{Q-1}) * S_c + sum over the column blocks of
(x_s * (exp(cum_{Q-1} - cum_s) * dt_s))^T @ B_s). Only the state and the chunk's cum and dt stay live across a
chunk: kept whole, x and B (each in the dots' layouts too) spilled registers at Nemotron-3-Nano's shape
(docs/ops/ssd.md). A row's value depends on its chunk's inputs, S_c and its row of C alone: the tile shapes
(BLOCK_L rows, BLOCK_S columns, BLOCK_P, N), the column blocks a row block sums and their order, and every dot's
K order are constants, a row sits at row l % BLOCK_L of its block in every phase, and rows of the block that are
not this pass's (C loaded as zeros) only fill MMA rows whose results are not stored. Decode is the same program on
the one row block that holds its token: it replays the chunk, never a one-step recurrence. Dots take their operands
in x's dtype (tensor cores for BF16), FP32 accumulate.
x, B and C are inputs in that dtype; W, S_c and x * weights are FP32 values, and rounding them to BF16 once (as
mamba-ssm's kernels do) keeps 8 of their 24 significant bits. So with 16-bit inputs each such operand goes in as
hi + lo (hi its BF16 rounding, lo the remainder's): two dots, hi's then lo's, summed in FP32, about 16 bits kept
(docs/ops/ssd.md: why, and what it buys against a float64 loop).

The discretised dt (softplus with threshold 20, then the limits) comes from `_discretise_kernel`, stored FP32; the
open chunk's x, dt and B go to the slot after the scan (`_keep_open_chunk_kernel`: a later launch, since the scan
reads the slot's earlier tokens and a pass may wrap the open chunk). Every per-sequence value is read from device
tensors (ops/spans.SpanTensors): a decode step can be captured in a CUDA graph. Launched with enable_fp_fusion=False:
no product and add is contracted at the compiler's choice. CPU and GPU do not bit-match; each is consistent with
itself (tests/ops/test_ssd_interpret.py under TRITON_INTERPRET=1, tests/ops/test_ssd_gpu.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.ops.cuda import SPAN_POINTERS
from onepath.ops.spans import SeqSpans

BLOCK_L = 16   # a chunk's rows per step: fixed, so a row's tiles never change with the phase (tl.dot needs >= 16)
BLOCK_P = 32   # head_dim columns per program at most: at 64 the state and its update spilled (lab/ssd_split.py)
BLOCK_S = 32   # a chunk's columns per step: x and B are loaded a block of columns at a time, not kept for the chunk
BLOCK_ROW = 1024
NUM_WARPS = 4


def blocks(p: int, n: int, chunk: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_N, BLOCK_Q): functions of the model's shape and the spec's chunk alone (>= 16 for tl.dot)."""
    return min(BLOCK_P, max(16, triton.next_power_of_2(p))), max(16, triton.next_power_of_2(n)), \
        max(16, triton.next_power_of_2(chunk))


@triton.jit
def _softplus(v):
    """log(1 + exp(v)) by Kahan's log1p (u * log(w) / (w - 1), w = 1 + u), v itself above 20."""
    u = tl.exp(v)
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * tl.math.div_rn(u, tl.where(w == 1.0, 1.0, w - 1.0)))
    return tl.where(v > 20.0, v, log1p)


@triton.jit(do_not_specialize=["dt_stride"])
def _discretise_kernel(dt_ptr, bias_ptr, out_ptr, dt_stride, H, lo, hi, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    v = tl.load(dt_ptr + row * dt_stride + offs, mask=mask, other=0.0).to(tl.float32) + \
        tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + offs, tl.minimum(tl.maximum(_softplus(v), lo), hi), mask=mask)


@triton.jit
def _hi_lo(v, dtype: tl.constexpr):
    """FP32 v as two values of the 16-bit dtype: hi = v rounded, lo = (v - hi) rounded; hi + lo keeps about 16 of
    v's 24 significant bits (BF16's 8 twice), hi alone 8."""
    hi = v.to(dtype)
    return hi, (v - hi.to(tl.float32)).to(dtype)


@triton.jit
def _dot_split_left(f, e, SPLIT: tl.constexpr):
    """f @ e, f an FP32 value and e 16-bit inputs (exact in their dtype), FP32 accumulate. SPLIT: f as hi + lo
    (_hi_lo), two tensor-core dots added, hi's first; else one dot of f rounded to e's dtype."""
    if SPLIT:
        hi, lo = _hi_lo(f, e.dtype)
        return tl.dot(hi, e, input_precision="ieee") + tl.dot(lo, e, input_precision="ieee")
    else:
        return tl.dot(f.to(e.dtype), e, input_precision="ieee")


@triton.jit
def _dot_split_right(e, f, SPLIT: tl.constexpr):
    """e @ f, as _dot_split_left with the FP32 operand on the right."""
    if SPLIT:
        hi, lo = _hi_lo(f, e.dtype)
        return tl.dot(e, hi, input_precision="ieee") + tl.dot(e, lo, input_precision="ieee")
    else:
        return tl.dot(e, f.to(e.dtype), input_precision="ieee")


@triton.jit
def _chunk_dt(s, base, start, end, row0, slot, h, Q, dt_ptr, sdt_ptr, sdt_slot, sdt_q, H, HAS_STATE: tl.constexpr):
    """dt of the chunk's columns s (offsets in the chunk at `base`): this pass's tokens from its input, the open
    chunk's earlier ones from the slot, zeros past the pass (and past Q)."""
    pos = base + s
    dts = tl.load(dt_ptr + (row0 + pos - start) * H + h, mask=(pos >= start) & (pos < end) & (s < Q), other=0.0)
    if HAS_STATE:
        old = (pos < start) & (s < Q)  # the open chunk's earlier tokens, kept in the slot
        dts = tl.where(old, tl.load(sdt_ptr + slot * sdt_slot + s * sdt_q + h, mask=old, other=0.0), dts)
    return dts


@triton.jit
def _chunk_columns(s, base, start, end, row0, slot, h, g, p, nn, pm, nm, Q, x_ptr, dt_ptr, B_ptr, sx_ptr, sdt_ptr,
                   sB_ptr, x_t, x_h, b_t, b_g, sx_slot, sx_q, sx_h, sdt_slot, sdt_q, sb_slot, sb_q, sb_g, H,
                   HAS_STATE: tl.constexpr):
    """x [S, P], dt [S] and B [S, N] of the chunk's columns s, as _chunk_dt takes dt."""
    dtype = x_ptr.dtype.element_ty
    pos = base + s
    new = (pos >= start) & (pos < end) & (s < Q)
    rows = row0 + pos - start
    xs = tl.load(x_ptr + rows[:, None] * x_t + h * x_h + p[None, :], mask=new[:, None] & pm[None, :], other=0.0)
    bs = tl.load(B_ptr + rows[:, None] * b_t + g * b_g + nn[None, :], mask=new[:, None] & nm[None, :], other=0.0)
    if HAS_STATE:
        old = (pos < start) & (s < Q)
        xo = tl.load(sx_ptr + slot * sx_slot + s[:, None] * sx_q + h * sx_h + p[None, :],
                     mask=old[:, None] & pm[None, :], other=0.0)
        bo = tl.load(sB_ptr + slot * sb_slot + s[:, None] * sb_q + g * sb_g + nn[None, :],
                     mask=old[:, None] & nm[None, :], other=0.0)
        xs = tl.where(old[:, None], xo.to(dtype), xs)
        bs = tl.where(old[:, None], bo.to(dtype), bs)
    return xs, _chunk_dt(s, base, start, end, row0, slot, h, Q, dt_ptr, sdt_ptr, sdt_slot, sdt_q, H, HAS_STATE), bs


@triton.jit
def _pick(values, at, idx):
    """values[at] for each at, values indexed by idx: exact (one term of each sum is not zero)."""
    return tl.sum(tl.where(idx[None, :] == at[:, None], values[None, :], 0.0), axis=1)


@triton.jit(do_not_specialize=["x_t", "x_h", "b_t", "b_g", "c_t", "c_g", "y_t", "y_h", "ssm_slot", "ssm_h", "ssm_p",
                               "sx_slot", "sx_q", "sx_h", "sdt_slot", "sdt_q", "sb_slot", "sb_q", "sb_g"],
            do_not_specialize_on_alignment=SPAN_POINTERS)
def _ssd_scan_kernel(x_ptr, dt_ptr, B_ptr, C_ptr, A_log_ptr, D_ptr, y_ptr, cu_ptr, start_ptr, slot_ptr,
                     ssm_ptr, sx_ptr, sdt_ptr, sB_ptr,
                     x_t, x_h, b_t, b_g, c_t, c_g, y_t, y_h,
                     ssm_slot, ssm_h, ssm_p, sx_slot, sx_q, sx_h, sdt_slot, sdt_q, sb_slot, sb_q, sb_g,
                     H, P, N, Q, HEADS_PER_GROUP,
                     HAS_STATE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = h // HEADS_PER_GROUP
    row0 = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - row0
    start = tl.load(start_ptr + b)
    end = start + n
    slot = tl.load(slot_ptr + b) if HAS_STATE else 0
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    Dh = tl.load(D_ptr + h).to(tl.float32)
    q = tl.arange(0, BLOCK_Q)
    cols = tl.arange(0, BLOCK_S)
    rows_in = tl.arange(0, BLOCK_L)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    nn = tl.arange(0, BLOCK_N)
    pm, nm, qm = p < P, nn < N, q < Q

    S = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    if HAS_STATE:
        if start > 0:
            S = tl.load(ssm_ptr + slot * ssm_slot + h * ssm_h + p[:, None] * ssm_p + nn[None, :],
                        mask=pm[:, None] & nm[None, :], other=0.0).to(tl.float32)
    c_first = start // Q
    c_stop = tl.where(n > 0, (end + Q - 1) // Q, c_first)
    for c in range(c_first, c_stop):
        base = c * Q
        # the chunk's dt (this pass's and the slot's), for its prefix sums: a [Q] vector, the one thing of the
        # chunk kept across its row blocks; x and B are loaded per block of BLOCK_S columns where used
        dtc = _chunk_dt(q, base, start, end, row0, slot, h, Q, dt_ptr, sdt_ptr, sdt_slot, sdt_q, H, HAS_STATE)
        cum = tl.cumsum(dtc * A, axis=0)
        lo = tl.maximum(start, base) - base
        hi = tl.minimum(end, base + Q) - base
        for rb in range(lo // BLOCK_L, (hi + BLOCK_L - 1) // BLOCK_L):
            l = rb * BLOCK_L + rows_in
            lpos = base + l
            lnew = (lpos >= start) & (lpos < end) & (l < Q)
            lrows = row0 + lpos - start
            cr = tl.load(C_ptr + lrows[:, None] * c_t + g * c_g + nn[None, :], mask=lnew[:, None] & nm[None, :],
                         other=0.0)
            cum_l = _pick(cum, l, q)
            inner = tl.zeros([BLOCK_L, BLOCK_P], dtype=tl.float32)
            # the column blocks up to the block's last row (the rest are causal zeros), ascending: a fixed order
            for sb in range(0, (tl.minimum(rb * BLOCK_L + BLOCK_L, Q) + BLOCK_S - 1) // BLOCK_S):
                s = sb * BLOCK_S + cols
                xs, dts, bs = _chunk_columns(s, base, start, end, row0, slot, h, g, p, nn, pm, nm, Q, x_ptr, dt_ptr,
                                             B_ptr, sx_ptr, sdt_ptr, sB_ptr, x_t, x_h, b_t, b_g, sx_slot, sx_q, sx_h,
                                             sdt_slot, sdt_q, sb_slot, sb_q, sb_g, H, HAS_STATE)
                cb = tl.dot(cr, tl.trans(bs), input_precision="ieee")
                causal = (s[None, :] <= l[:, None]) & (s < Q)[None, :]
                decay = tl.exp(tl.where(causal, cum_l[:, None] - _pick(cum, s, q)[None, :], 0.0))
                w = tl.where(causal, (cb * decay) * dts[None, :], 0.0)
                inner += _dot_split_left(w, xs, SPLIT)
            carried = tl.exp(cum_l)[:, None] * _dot_split_right(cr, tl.trans(S), SPLIT)
            xr = tl.load(x_ptr + lrows[:, None] * x_t + h * x_h + p[None, :], mask=lnew[:, None] & pm[None, :],
                         other=0.0).to(tl.float32)
            tl.store(y_ptr + lrows[:, None] * y_t + h * y_h + p[None, :], (inner + carried) + Dh * xr,
                     mask=lnew[:, None] & pm[None, :])
        if base + Q <= end:
            cum_end = tl.sum(tl.where(q == Q - 1, cum, 0.0), axis=0)
            u = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
            for sb in range(0, (Q + BLOCK_S - 1) // BLOCK_S):
                s = sb * BLOCK_S + cols
                xs, dts, bs = _chunk_columns(s, base, start, end, row0, slot, h, g, p, nn, pm, nm, Q, x_ptr, dt_ptr,
                                             B_ptr, sx_ptr, sdt_ptr, sB_ptr, x_t, x_h, b_t, b_g, sx_slot, sx_q, sx_h,
                                             sdt_slot, sdt_q, sb_slot, sb_q, sb_g, H, HAS_STATE)
                weights = tl.where(s < Q, tl.exp(tl.where(s < Q, cum_end - _pick(cum, s, q), 0.0)) * dts, 0.0)
                u += _dot_split_left(tl.trans(xs.to(tl.float32) * weights[:, None]), bs, SPLIT)
            S = (tl.exp(cum_end) * S + u).to(ssm_ptr.dtype.element_ty).to(tl.float32)
    if HAS_STATE:
        # the boundary state moved (a chunk closed), or a fresh sequence replaces the slot's old one
        if (n > 0) & ((end // Q > c_first) | (start == 0)):
            tl.store(ssm_ptr + slot * ssm_slot + h * ssm_h + p[:, None] * ssm_p + nn[None, :],
                     S.to(ssm_ptr.dtype.element_ty), mask=pm[:, None] & nm[None, :])


@triton.jit(do_not_specialize=["x_t", "x_h", "b_t", "b_g", "sx_slot", "sx_q", "sx_h", "sdt_slot", "sdt_q", "sb_slot",
                               "sb_q", "sb_g"], do_not_specialize_on_alignment=SPAN_POINTERS)
def _keep_open_chunk_kernel(x_ptr, dt_ptr, B_ptr, row_seq_ptr, cu_ptr, start_ptr, slot_ptr, sx_ptr, sdt_ptr, sB_ptr,
                            x_t, x_h, b_t, b_g, sx_slot, sx_q, sx_h, sdt_slot, sdt_q, sb_slot, sb_q, sb_g, H, P, G, N,
                            Q, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
    """A row in its sequence's open chunk once the pass is done: its x, dt and B into the slot at its offset."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.load(row_seq_ptr + row)
    row0 = tl.load(cu_ptr + b)
    start = tl.load(start_ptr + b)
    end = start + tl.load(cu_ptr + b + 1) - row0
    pos = start + row - row0
    keep = pos >= (end // Q) * Q
    slot = tl.load(slot_ptr + b)
    j = pos % Q
    cols = tl.arange(0, BLOCK)
    for s0 in range(0, H * P, BLOCK):
        o = s0 + cols
        m = (o < H * P) & keep
        v = tl.load(x_ptr + row * x_t + (o // P) * x_h + o % P, mask=m, other=0.0)
        tl.store(sx_ptr + slot * sx_slot + j * sx_q + (o // P) * sx_h + o % P, v, mask=m)
    for s0 in range(0, G * N, BLOCK):
        o = s0 + cols
        m = (o < G * N) & keep
        v = tl.load(B_ptr + row * b_t + (o // N) * b_g + o % N, mask=m, other=0.0)
        tl.store(sB_ptr + slot * sb_slot + j * sb_q + (o // N) * sb_g + o % N, v, mask=m)
    hh = tl.arange(0, BLOCK_H)
    m = (hh < H) & keep
    tl.store(sdt_ptr + slot * sdt_slot + j * sdt_q + hh, tl.load(dt_ptr + row * H + hh, mask=m, other=0.0), mask=m)


def discretised(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit) -> torch.Tensor:
    """clamp(softplus(dt + dt_bias), *dt_limit) in FP32 [T, H], by _softplus."""
    t, h = dt.shape
    out = torch.empty((t, h), dtype=torch.float32, device=dt.device)
    if t:
        dt = dt if dt.stride(-1) == 1 else dt.contiguous()
        _discretise_kernel[(t,)](dt, dt_bias.contiguous(), out, dt.stride(0), h, float(dt_limit[0]),
                                 float(dt_limit[1]), BLOCK=triton.next_power_of_2(h), num_warps=1,
                                 enable_fp_fusion=False)
    return out


def inner_unit(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def ssd(x, dt, B, C, A_log, D, dt_bias, spans: SeqSpans, state, chunk: int, dt_limit, state_dtype,
        split: bool = True, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """ops/ssd.py's interface (x [T, H, P], dt [T, H] before dt_bias, B, C [T, G, N]; state an SSDState or None)
    -> y [T, H, P] FP32; the state's boundary states and open chunks advanced past this pass. split (16-bit
    inputs): the FP32 dot operands as hi + lo (the shipped arithmetic); False rounds them to the inputs' dtype
    once, as mamba-ssm's kernels do (the tests' control of the precision it buys). num_warps: the scan's launch
    (a fixed choice: its cumsum's tree follows the layout, so every phase must launch it alike; the bench's
    sweep, bench/kernels_ssd.py --warps)."""
    t, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    y = torch.empty((t, h, p), dtype=torch.float32, device=x.device)
    if not t:
        return y
    x, B, C = inner_unit(x), inner_unit(B), inner_unit(C)
    dtd = discretised(dt, dt_bias, dt_limit)
    spans_t = spans.on(x.device)
    has_state = state is not None
    if has_state:
        ssm, sx, sdt, sB = state.ssm, state.x, state.dt, state.B
        if ssm.dtype != state_dtype or sx.dtype != x.dtype or sB.dtype != B.dtype:
            raise ValueError(f"ssd: the state holds {ssm.dtype} states and {sx.dtype} / {sB.dtype} inputs, the pass "
                             f"{state_dtype} and {x.dtype} / {B.dtype}: build the state cache from the model's spec")
        strides = (ssm.stride(0), ssm.stride(1), ssm.stride(2), sx.stride(0), sx.stride(1), sx.stride(2),
                   sdt.stride(0), sdt.stride(1), sB.stride(0), sB.stride(1), sB.stride(2))
    else:
        ssm = torch.empty(1, dtype=state_dtype, device=x.device)  # its dtype rounds the boundary states
        sx, sdt, sB, strides = x, dtd, B, (0,) * 11
    block_p, block_n, block_q = blocks(p, n, chunk)
    grid = (spans.num_seqs, h, triton.cdiv(p, block_p))
    _ssd_scan_kernel[grid](x, dtd, B, C, A_log.contiguous(), D.contiguous(), y, spans_t.cu_seqlens, spans_t.starts,
                           spans_t.slots, ssm, sx, sdt, sB, x.stride(0), x.stride(1), B.stride(0), B.stride(1),
                           C.stride(0), C.stride(1), y.stride(0), y.stride(1), *strides, h, p, n, chunk, h // g,
                           HAS_STATE=has_state, BLOCK_L=BLOCK_L, BLOCK_Q=block_q, BLOCK_P=block_p, BLOCK_N=block_n,
                           BLOCK_S=min(BLOCK_S, block_q), SPLIT=split and x.element_size() == 2, num_warps=num_warps,
                           enable_fp_fusion=False)
    if has_state:
        _keep_open_chunk_kernel[(t,)](x, dtd, B, spans_t.row_seq, spans_t.cu_seqlens, spans_t.starts, spans_t.slots,
                                      sx, sdt, sB, x.stride(0), x.stride(1), B.stride(0), B.stride(1), *strides[3:],
                                      h, p, g, n, chunk, BLOCK=BLOCK_ROW, BLOCK_H=triton.next_power_of_2(h),
                                      num_warps=NUM_WARPS)
    return y
