"""causal_conv1d: Mamba-2's depthwise causal convolution over time, then SiLU, in FP32, rounded once to x's dtype.

For channel c of the token at position t, with K taps and the K - 1 inputs before it (zeros before position 0):
    acc = w[c, 0] * x[t - K + 1, c]
    acc = acc + w[c, k] * x[t - K + 1 + k, c]     k = 1 .. K - 1, in that order
    out = silu(acc + bias[c])                     one rounding to x's dtype
Each output is its own K-term sum, elementwise over the batch: no reduction kernel can pick another order, so a
token's bits do not depend on the phase or its batch. The state of a sequence is its last K - 1 inputs (x's dtype),
read when it continues past position 0 and written after every pass (ops/spans.py names the slots).

Backends, from KERNELS by (mode, device): consistent: the formula above (SiLU on fixed-shape pieces); baseline: the
stock path, torch's conv1d over the state and the new inputs of each sequence, SiLU over the whole tensor. The same
torch code on both devices for now (a Triton kernel keeps the tap order). Backward: `reference`, plain conv1d on whole
sequences.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import pinned_unary
from onepath.ops.spans import SeqSpans


def extended(x: torch.Tensor, spans: SeqSpans, state: torch.Tensor | None, taps: int) -> list[torch.Tensor]:
    """Per sequence, the K - 1 inputs before its first new token (its state, or zeros at position 0), then its new
    inputs: [K - 1 + n, C] each."""
    out = []
    for b in range(spans.num_seqs):
        if spans.starts[b]:
            before = state[spans.slots[b]].to(x.dtype)
        else:
            before = x.new_zeros(taps - 1, x.shape[-1])
        out.append(torch.cat([before, x[spans.rows(b)]]))
    return out


def keep_state(ext: list[torch.Tensor], spans: SeqSpans, state: torch.Tensor | None, taps: int) -> None:
    if state is None:
        return
    for b, e in enumerate(ext):
        state[spans.slots[b]] = e[e.shape[0] - (taps - 1):].detach().to(state.dtype)


def consistent(x, weight, bias, spans: SeqSpans, state):
    taps = weight.shape[-1]
    ext = extended(x.detach(), spans, state, taps)
    keep_state(ext, spans, state, taps)
    windows = torch.cat([e.unfold(0, taps, 1) for e in ext]).float()  # [T, C, K]: taps in time order
    w = weight.float()
    acc = windows[..., 0] * w[:, 0]
    for k in range(1, taps):
        acc = acc + windows[..., k] * w[:, k]
    if bias is not None:
        acc = acc + bias.float()
    return pinned_unary(F.silu, acc).to(x.dtype)


def stock(x, weight, bias, spans: SeqSpans, state):
    taps = weight.shape[-1]
    ext = extended(x.detach(), spans, state, taps)
    keep_state(ext, spans, state, taps)
    outs = [F.conv1d(e.T[None].float(), weight.float()[:, None], None if bias is None else bias.float(),
                     groups=weight.shape[0])[0].T for e in ext]
    return F.silu(torch.cat(outs)).to(x.dtype)


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
    ("consistent", "cuda"): consistent,
    ("baseline", "cpu"): stock,
    ("baseline", "cuda"): stock,
}


def causal_conv1d(spec: ExecutionSpec, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  spans: SeqSpans, state: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, C] (the sequences of `spans`, flattened), weight [C, K], bias [C] or None; state [slots, K - 1, C]
    or None (whole sequences from position 0, nothing kept) -> silu(conv) [T, C] in x's dtype."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"causal_conv1d: x has {x.shape[-1]} channels, the weight {weight.shape[0]}")
    kernel = KERNELS[spec.mode, spec.device]
    if bias is None:
        return apply_kernel(lambda x, w: kernel(x, w, None, spans, state), lambda x, w: reference(x, w, None, spans),
                            x, weight)
    return apply_kernel(lambda x, w, b: kernel(x, w, b, spans, state), lambda x, w, b: reference(x, w, b, spans),
                        x, weight, bias)
