"""causal_conv1d on Hopper: one program per (token row, block of channels), the K taps summed in tap order.

    acc = w[c, 0] * x[t - K + 1, c];  acc = acc + w[c, k] * x[t - K + 1 + k, c]  (k = 1 .. K - 1);  acc = acc + bias
    out = round(div_rn(acc, 1 + exp(-acc)), x.dtype)

Elementwise over rows and channels, so a row's bits cannot depend on its batch; launched with enable_fp_fusion=False
so no product and add is contracted at the compiler's choice. An input before the pass's first token comes from the
sequence's state, a ring of its last K - 1 inputs (position q in row q % (K - 1)); before position 0 it is zero. The
ring's new rows are written by a second launch (`_keep_kernel`), after every row of the pass has read the old ones.
Every value comes from device tensors (ops/spans.SpanTensors): a decode step can be captured in a CUDA graph.
The SiLU is silu_mul.py's (tl.exp, IEEE division), so it is close to, not bitwise equal to, torch's on the CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onepath.ops.cuda import SPAN_POINTERS
from onepath.ops.spans import SeqSpans

BLOCK_C = 256
NUM_WARPS = 4


@triton.jit
def _row_position(row, row_seq_ptr, cu_ptr, start_ptr, slot_ptr, HAS_STATE: tl.constexpr):
    """(first row, start, end, slot, position) of the sequence that owns `row`."""
    b = tl.load(row_seq_ptr + row)
    row0 = tl.load(cu_ptr + b)
    start = tl.load(start_ptr + b)
    end = start + tl.load(cu_ptr + b + 1) - row0
    slot = tl.load(slot_ptr + b) if HAS_STATE else 0
    return row0, start, end, slot, start + (row - row0)


@triton.jit(do_not_specialize=["x_stride", "out_stride", "state_slot_stride", "state_row_stride"],
            do_not_specialize_on_alignment=SPAN_POINTERS)
def _conv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, state_ptr, row_seq_ptr, cu_ptr, start_ptr, slot_ptr, x_stride,
                 out_stride, state_slot_stride, state_row_stride, C, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_STATE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    row0, start, end, slot, pos = _row_position(row, row_seq_ptr, cu_ptr, start_ptr, slot_ptr, HAS_STATE)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K):
        q = pos - (K - 1) + k  # the tap's input position
        v = tl.load(x_ptr + (row0 + q - start) * x_stride + offs, mask=mask & (q >= start), other=0.0)
        if HAS_STATE:
            held = (q < start) & (q >= 0)
            s = tl.load(state_ptr + slot * state_slot_stride + (q % (K - 1)) * state_row_stride + offs,
                        mask=mask & held, other=0.0)
            v = tl.where(held, s.to(v.dtype), v)
        term = tl.load(w_ptr + offs * K + k, mask=mask, other=0.0).to(tl.float32) * v.to(tl.float32)
        acc = term if k == 0 else acc + term
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = tl.math.div_rn(acc, 1.0 + tl.exp(-acc))
    tl.store(out_ptr + row * out_stride + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["x_stride", "state_slot_stride", "state_row_stride"],
            do_not_specialize_on_alignment=SPAN_POINTERS)
def _keep_kernel(x_ptr, state_ptr, row_seq_ptr, cu_ptr, start_ptr, slot_ptr, x_stride, state_slot_stride,
                 state_row_stride, C, K: tl.constexpr, BLOCK: tl.constexpr):
    """A row among its sequence's last K - 1 inputs goes to its ring row."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row0, start, end, slot, pos = _row_position(row, row_seq_ptr, cu_ptr, start_ptr, slot_ptr, True)
    mask = (offs < C) & (pos >= end - (K - 1))
    v = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    tl.store(state_ptr + slot * state_slot_stride + (pos % (K - 1)) * state_row_stride + offs,
             v.to(state_ptr.dtype.element_ty), mask=mask)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spans: SeqSpans,
                  state: torch.Tensor | None) -> torch.Tensor:
    """x [T, C] (rows of unit stride), weight [C, K], bias [C] or None, state [slots, K - 1, C] or None ->
    silu(conv) [T, C] in x's dtype; the state's rings advanced past this pass."""
    t, c = x.shape
    taps = weight.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    if not t:
        return out
    spans_t = spans.on(x.device)
    has_state = state is not None and taps > 1
    st = state if has_state else x
    slot_stride, row_stride = (st.stride(0), st.stride(1)) if has_state else (0, 0)
    grid = (t, triton.cdiv(c, BLOCK_C))
    _conv_kernel[grid](x, weight.contiguous(), x if bias is None else bias, out, st, spans_t.row_seq,
                       spans_t.cu_seqlens, spans_t.starts, spans_t.slots, x.stride(0), out.stride(0), slot_stride,
                       row_stride, c, K=taps, HAS_BIAS=bias is not None, HAS_STATE=has_state, BLOCK=BLOCK_C,
                       num_warps=NUM_WARPS, enable_fp_fusion=False)
    if has_state:
        _keep_kernel[grid](x, state, spans_t.row_seq, spans_t.cu_seqlens, spans_t.starts, spans_t.slots, x.stride(0),
                           state.stride(0), state.stride(1), c, K=taps, BLOCK=BLOCK_C, num_warps=NUM_WARPS)
    return out
