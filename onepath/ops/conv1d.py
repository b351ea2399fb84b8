"""causal_conv1d: Mamba-2's depthwise causal convolution over time, then SiLU, in FP32, rounded once to x's dtype.

For channel c of the token at position t, with K taps and the K - 1 inputs before it (zeros before position 0):
    acc = w[c, 0] * x[t - K + 1, c]
    acc = acc + w[c, k] * x[t - K + 1 + k, c]     k = 1 .. K - 1, in that order
    out = silu(acc + bias[c])                     one rounding to x's dtype
Each output is its own K-term sum, elementwise over the batch: no reduction kernel can pick another order, so a
token's bits do not depend on the phase or its batch. The state of a sequence is its last K - 1 inputs (x's dtype),
a ring: the input at position q sits in row q % (K - 1), so a decode step writes one row and moves none. It is read
when a sequence continues past position 0 and written after every pass (ops/spans.py names the slots).

Backends, from KERNELS by (mode, device): consistent: the formula above (SiLU on fixed-shape pieces on the CPU; the
Triton kernel of ops/cuda/conv1d.py on CUDA: the same tap order, its own SiLU); baseline: the stock path, torch's
conv1d over the state and the new inputs of each sequence, SiLU over the whole tensor (a static decode batch: the
K-term window of each row by one product and sum). Backward: `reference`, plain conv1d on whole sequences.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import pinned_unary
from onepath.ops.spans import SeqSpans


def ring_rows(positions, taps: int) -> list[int]:
    """The state rows (a ring of K - 1) holding the inputs at `positions`."""
    return [q % (taps - 1) for q in positions]


def extended(x: torch.Tensor, spans: SeqSpans, state: torch.Tensor | None, taps: int) -> list[torch.Tensor]:
    """Per sequence, the K - 1 inputs before its first new token (from its state's ring; zeros before position 0),
    then its new inputs: [K - 1 + n, C] each."""
    out = []
    for b in range(spans.num_seqs):
        p = spans.starts[b]
        before = x.new_zeros(taps - 1, x.shape[-1])
        if p:
            held = range(max(0, p - (taps - 1)), p)
            before[taps - 1 - len(held):] = state[spans.slots[b], ring_rows(held, taps)].to(x.dtype)
        out.append(torch.cat([before, x[spans.rows(b)]]))
    return out


def keep_state(x: torch.Tensor, spans: SeqSpans, state: torch.Tensor | None, taps: int) -> None:
    """Each sequence's last K - 1 new inputs into its ring (older entries stay where they are)."""
    if state is None or taps == 1:
        return
    for b in range(spans.num_seqs):
        rows, p = spans.rows(b), spans.starts[b]
        end = p + rows.stop - rows.start
        kept = range(max(p, end - (taps - 1)), end)
        state[spans.slots[b], ring_rows(kept, taps)] = x[rows.stop - len(kept):rows.stop].detach().to(state.dtype)


def consistent(x, weight, bias, spans: SeqSpans, state):
    taps = weight.shape[-1]
    ext = extended(x.detach(), spans, state, taps)
    keep_state(x, spans, state, taps)
    windows = torch.cat([e.unfold(0, taps, 1) for e in ext]).float()  # [T, C, K]: taps in time order
    w = weight.float()
    acc = windows[..., 0] * w[:, 0]
    for k in range(1, taps):
        acc = acc + windows[..., k] * w[:, k]
    if bias is not None:
        acc = acc + bias.float()
    return pinned_unary(F.silu, acc).to(x.dtype)


def cuda(x, weight, bias, spans: SeqSpans, state):
    from onepath.ops.cuda.conv1d import causal_conv1d as triton_conv1d
    return triton_conv1d(x.detach(), weight.detach(), None if bias is None else bias.detach(), spans, state)


def stock(x, weight, bias, spans: SeqSpans, state):
    taps = weight.shape[-1]
    if spans.decode_only:
        return stock_decode(x, weight, bias, spans, state)
    ext = extended(x.detach(), spans, state, taps)
    keep_state(x, spans, state, taps)
    outs = [F.conv1d(e.T[None].float(), weight.float()[:, None], None if bias is None else bias.float(),
                     groups=weight.shape[0])[0].T for e in ext]
    return F.silu(torch.cat(outs)).to(x.dtype)


def stock_decode(x, weight, bias, spans: SeqSpans, state):
    """A static decode batch (every row continues its slot; nothing read on the host): the ring's K - 1 inputs and
    the new one, one product and sum per row."""
    taps = weight.shape[-1]
    t = spans.on(x.device)
    x = x.detach()
    if taps == 1:
        window = x[:, :, None].float()
    else:
        q = t.starts[:, None] - (taps - 1) + torch.arange(taps - 1, device=x.device)
        held = state[t.slots[:, None], q.remainder(taps - 1)].float() * (q >= 0)[..., None]
        window = torch.cat([held, x[:, None].float()], dim=1).transpose(1, 2)       # [B, C, K]
        state[t.slots, t.starts.remainder(taps - 1)] = x.to(state.dtype)
    acc = (window * weight.float()).sum(-1)
    return F.silu(acc if bias is None else acc + bias.float()).to(x.dtype)


def reference(x, weight, bias, spans: SeqSpans):
    """Differentiable: each whole sequence from position 0 (zeros before it)."""
    taps = weight.shape[-1]
    outs = []
    for b in range(spans.num_seqs):
        xb = x[spans.rows(b)].float().T[None]
        outs.append(F.conv1d(xb, weight.float()[:, None], None if bias is None else bias.float(),
                             padding=taps - 1, groups=weight.shape[0])[0, :, :xb.shape[-1]].T)
    return F.silu(torch.cat(outs)).to(x.dtype)


# (mode, device) -> kernel(x, weight, bias, spans, state)
KERNELS = {
    ("consistent", "cpu"): consistent,
    ("consistent", "cuda"): cuda,
    ("baseline", "cpu"): stock,
    ("baseline", "cuda"): stock,
}


def causal_conv1d(spec: ExecutionSpec, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  spans: SeqSpans, state: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, C] (the sequences of `spans`, flattened), weight [C, K], bias [C] or None; state [slots, K - 1, C]
    (the ring of each slot's last inputs) or None (whole sequences from position 0, nothing kept) -> silu(conv)
    [T, C] in x's dtype."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"causal_conv1d: x has {x.shape[-1]} channels, the weight {weight.shape[0]}")
    kernel = KERNELS[spec.mode, spec.device]
    if bias is None:
        return apply_kernel(lambda x, w: kernel(x, w, None, spans, state), lambda x, w: reference(x, w, None, spans),
                            x, weight)
    return apply_kernel(lambda x, w, b: kernel(x, w, b, spans, state), lambda x, w, b: reference(x, w, b, spans),
                        x, weight, bias)
