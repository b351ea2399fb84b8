"""ssd: Mamba-2's selective scan (state space duality) with one arithmetic for every phase.

Per head h, token t: dt_t = clamp(softplus(dt_raw_t + dt_bias), *dt_limit), a_t = dt_t * A (A = -exp(A_log)),
state_t = exp(a_t) * state_{t-1} + dt_t * x_t B_t^T, y_t = C_t . state_t + D * x_t (B, C shared by the heads of a
group). The consistent path computes it in chunks of Q tokens at absolute positions [c*Q, (c+1)*Q) (the spec's
ssd.chunk) and nothing else: a token at offset l of chunk c, with S_c the state at the chunk's start, gets

    R_l(s)  = a_l + a_{l-1} + ... + a_{s+1}          accumulated from a_l down, R_l(l) = 0, s = -1 .. l
    w_l(s)  = ((C_l . B_s) * exp(R_l(s))) * dt_s      s = 0 .. l
    y_l     = (sum_s w_l(s) x_s  +  exp(R_l(-1)) * (C_l . S_c))  +  D x_l
    S_{c+1} = round_state(exp(R_{Q-1}(-1)) * S_c  +  sum_s ((exp(R_{Q-1}(s)) * dt_s) x_s) B_s^T)

where every dot over the state size N is a fixed tree, every sum over s runs over all Q offsets of the chunk as one
fixed tree with exact zeros for s > l, and exp / softplus run on fixed-shape pieces. Each value is then a function of
the chunk's own inputs and S_c: the same bits whether the chunk's tokens came in one prefill, in chunks that do not
line up with Q, one at a time (decode), or in the trainer's forward. Decode keeps S_c and the open chunk's x, dt and
B so far (SSDState) and computes its token by the formula above: it replays the chunk, never a one-step recurrence.
The state is rounded to its dtype (mamba_ssm_cache_dtype) at every chunk boundary, in every phase. Design and
tests: docs/ops/ssd.md.

Backends, from KERNELS by (mode, device): consistent: the formula above (CPU: elementwise torch ops, no GEMM, so no
kernel chosen by M; CUDA: the Triton kernels of ops/cuda/ssd.py, the same formula with tensor-core dots and the
segment sums as differences of one prefix scan: their own bits, one arithmetic in every phase); baseline: the stock
paths, a chunked scan of torch's cumsum and einsum GEMMs over each call's tokens (its chunks start where the call
starts) and a one-step recurrence for decode, keeping the running state.
Backward: `reference`, the stock chunked scan on whole sequences.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from onepath.numerics.spec import SSD_CHUNK, ExecutionSpec
from onepath.ops.autograd import apply_kernel
from onepath.ops.pinned import pinned_unary, tree_sum
from onepath.ops.spans import SeqSpans

NO_LIMIT = (0.0, math.inf)
ROWS = 32  # rows (or chunks) per piece: bounds the memory of the [rows, Q, H, P] terms; a value never depends on it


@dataclass(slots=True)
class SSDState:
    """One Mamba layer's scan state, per slot. Consistent: `ssm` is the state at the start of the open chunk (the
    last chunk boundary) and x, dt, B hold the open chunk's tokens so far; baseline: `ssm` is the running state."""
    ssm: torch.Tensor  # [slots, H, P, N] in the state dtype
    x: torch.Tensor    # [slots, Q, H, P] x's dtype
    dt: torch.Tensor   # [slots, Q, H] FP32: dt after dt_bias, softplus and the limits
    B: torch.Tensor    # [slots, Q, G, N]

    @classmethod
    def empty(cls, slots: int, heads: int, head_dim: int, groups: int, state_size: int, chunk: int,
              dtype: torch.dtype, state_dtype: torch.dtype, device="cpu") -> "SSDState":
        zeros = lambda *shape, dtype=dtype: torch.zeros(shape, dtype=dtype, device=device)
        return cls(zeros(slots, heads, head_dim, state_size, dtype=state_dtype), zeros(slots, chunk, heads, head_dim),
                   zeros(slots, chunk, heads, dtype=torch.float32), zeros(slots, chunk, groups, state_size))

    @property
    def chunk(self) -> int:
        return self.x.shape[1]


def discretised(dt, dt_bias, dt_limit, pinned: bool = True):
    """clamp(softplus(dt + dt_bias), *dt_limit) in FP32 [T, H]."""
    v = dt.float() + dt_bias.float()
    v = pinned_unary(F.softplus, v) if pinned else F.softplus(v)
    return v.clamp(dt_limit[0], dt_limit[1])


def segment_sums(a: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """R [r, Q + 1, H], column s + 1 holding R_l(s) = a_{s+1} + ... + a_l (accumulated from a_l down) for the row's
    offset l = offset[r] in its chunk a [r, Q, H], zero for s >= l. Elementwise adds in a fixed order per row."""
    rows, q, heads = a.shape
    out = a.new_zeros(rows, q + 1, heads)
    top = min(q - 2, int(offset.max()) - 1) if rows else -2  # columns past every row's offset stay zero
    for s in range(top, -2, -1):
        out[:, s + 1] = torch.where((s < offset)[:, None], out[:, s + 2] + a[:, s + 1], 0.0)
    return out


@dataclass(slots=True)
class Chunks:
    """The chunks a pass touches, laid out [chunks, Q, ...]: each sequence's open chunk from its state first, then its
    new tokens; where each new token sits (chunk, offset); each sequence's first chunk, count and complete chunks."""
    x: torch.Tensor    # [NC, Q, H, P]
    dt: torch.Tensor   # [NC, Q, H] FP32
    B: torch.Tensor    # [NC, Q, G, N]
    row_chunk: torch.Tensor
    row_offset: torch.Tensor
    first: list[int]
    count: list[int]
    full: list[int]
    init: list[torch.Tensor | None]

    @classmethod
    def gather(cls, x, dt, B, spans: SeqSpans, state: SSDState | None, chunk: int) -> "Chunks":
        xs, dts, bs, row_chunk, row_offset, first, count, full, init = [], [], [], [], [], [], [], [], []
        q, total = chunk, 0
        for b in range(spans.num_seqs):
            rows, p = spans.rows(b), spans.starts[b]
            n, o = rows.stop - rows.start, p % q
            nc = -(-(o + n) // q) if n else 0
            bx, bdt, bb = x.new_zeros(nc * q, *x.shape[1:]), dt.new_zeros(nc * q, dt.shape[1]), \
                B.new_zeros(nc * q, *B.shape[1:])
            if o and n:
                slot = spans.slots[b]
                bx[:o], bdt[:o], bb[:o] = state.x[slot, :o], state.dt[slot, :o], state.B[slot, :o]
            bx[o:o + n], bdt[o:o + n], bb[o:o + n] = x[rows], dt[rows], B[rows]
            xs.append(bx), dts.append(bdt), bs.append(bb)
            row_chunk += [total + (o + i) // q for i in range(n)]
            row_offset += [(o + i) % q for i in range(n)]
            first.append(total), count.append(nc), full.append((o + n) // q)
            init.append(state.ssm[spans.slots[b]].float() if p and n else None)
            total += nc
        long = lambda v: torch.tensor(v, dtype=torch.long, device=x.device)
        return cls(torch.cat(xs).view(total, q, *x.shape[1:]), torch.cat(dts).view(total, q, dt.shape[1]),
                   torch.cat(bs).view(total, q, *B.shape[1:]), long(row_chunk), long(row_offset), first, count, full,
                   init)


def chunk_weights(a, offset):
    """For rows at `offset` in their chunks (a [r, Q, H]): exp(R_l(s)) [r, Q, H], exact zero for s > l; the decay
    of the chunk's start state exp(R_l(-1)) [r, H]; the mask s <= l [r, Q]."""
    r = segment_sums(a, offset)
    valid = torch.arange(a.shape[1], device=a.device)[None, :] <= offset[:, None]
    weights = torch.where(valid[..., None], pinned_unary(torch.exp, r[:, 1:]), 0.0)
    return weights, pinned_unary(torch.exp, r[:, 0]), valid


def state_terms(a, dt, x, B, offset, heads):
    """(decay [r, H], U [r, H, P, N]): the state after the token at `offset` is decay * S_c + U, U summed over the
    chunk's offsets as one tree (zeros past the offset)."""
    weights, decay, valid = chunk_weights(a, offset)
    terms = ((weights * dt)[..., None] * x.float())[..., None] * B[:, :, heads].float()[:, :, :, None, :]
    terms = torch.where(valid[:, :, None, None, None], terms, 0.0)
    return decay, tree_sum(terms.permute(0, 2, 3, 4, 1))


def consistent(x, dt, B, C, A_log, D, dt_bias, *, spans: SeqSpans, state: SSDState | None, chunk: int, dt_limit,
               state_dtype):
    t, h, p = x.shape
    heads = torch.arange(h, device=x.device) // (h // B.shape[1])
    A = -pinned_unary(torch.exp, A_log.detach().float())
    ch = Chunks.gather(x.detach(), discretised(dt.detach(), dt_bias.detach(), dt_limit), B.detach(), spans, state,
                       chunk)
    a = ch.dt * A
    # chunks completed in this pass: the state after their last token, then the boundary states in order
    done = torch.tensor([f + k for f, n in zip(ch.first, ch.full) for k in range(n)], dtype=torch.long,
                        device=x.device)
    ends = {}
    for piece in done.split(ROWS):
        decay, u = state_terms(a[piece], ch.dt[piece], ch.x[piece], ch.B[piece],
                               torch.full_like(piece, chunk - 1), heads)
        ends.update({int(c): (decay[i], u[i]) for i, c in enumerate(piece.tolist())})
    starts = x.new_zeros(sum(ch.count), h, p, B.shape[2], dtype=torch.float32)
    final = []
    for b, (f, n, full) in enumerate(zip(ch.first, ch.count, ch.full)):
        s = ch.init[b] if ch.init[b] is not None else starts.new_zeros(starts.shape[1:])
        for k in range(n):
            starts[f + k] = s
            if k < full:
                decay, u = ends[f + k]
                s = (decay[:, None, None] * s + u).to(state_dtype).float()
        final.append(s)
    out = []
    cs, offs = ch.row_chunk, ch.row_offset
    for rows in torch.arange(t, device=x.device).split(ROWS):
        c, off = cs[rows], offs[rows]
        weights, decay, valid = chunk_weights(a[c], off)
        cr = C[rows].detach().float()
        cb = tree_sum(cr[:, None] * ch.B[c].float())[:, :, heads]                        # [r, Q, H]: C_l . B_s
        w = torch.where(valid[..., None], (cb * weights) * ch.dt[c], 0.0)
        terms = torch.where(valid[..., None, None], w[..., None] * ch.x[c].float(), 0.0)  # [r, Q, H, P]
        inner = tree_sum(terms.permute(0, 2, 3, 1))
        carried = decay[..., None] * tree_sum(cr[:, heads][:, :, None, :] * starts[c])
        out.append((inner + carried) + D.detach().float()[:, None] * x[rows].detach().float())
    keep(ch, spans, state, final, chunk, state_dtype)
    return torch.cat(out) if out else x.new_zeros(0, h, p, dtype=torch.float32)


def keep(ch: Chunks, spans: SeqSpans, state: SSDState | None, final, chunk: int, state_dtype) -> None:
    """Each sequence's state at its last chunk boundary and its open chunk's tokens into its slot."""
    if state is None:
        return
    for b in range(spans.num_seqs):
        if not ch.count[b]:
            continue
        slot, open_chunk = spans.slots[b], ch.first[b] + ch.full[b]
        state.ssm[slot] = final[b].to(state_dtype)
        m = (spans.starts[b] + spans.rows(b).stop - spans.rows(b).start) % chunk
        if m:
            state.x[slot, :m], state.dt[slot, :m], state.B[slot, :m] = \
                ch.x[open_chunk, :m], ch.dt[open_chunk, :m], ch.B[open_chunk, :m]


def state_after(state: SSDState, slot: int, length: int, A_log: torch.Tensor) -> torch.Tensor:
    """The state after the first `length` tokens of the sequence in `slot` (consistent layout), by the chunk
    formula: the boundary state decayed to the last token plus the open chunk's terms. FP32 [H, P, N]."""
    m = length % state.chunk
    s = state.ssm[slot].float()
    if not m:
        return s
    heads = torch.arange(state.x.shape[2], device=s.device) // (state.x.shape[2] // state.B.shape[2])
    dt = state.dt[slot][None]
    decay, u = state_terms(dt * -pinned_unary(torch.exp, A_log.detach().float()), dt, state.x[slot][None],
                           state.B[slot][None], torch.tensor([m - 1], device=s.device), heads)
    return decay[0][:, None, None] * s + u[0]


def segsum(a: torch.Tensor) -> torch.Tensor:
    """[..., Q] -> [..., Q, Q]: sum of a over (s, l], -inf above the diagonal (torch's cumsum of masked copies)."""
    q = a.shape[-1]
    x = a[..., None].expand(*a.shape, q)
    x = x.masked_fill(~torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), -1), 0)
    x = torch.cumsum(x, dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), 0), -math.inf)


def chunked_scan(x, dt, A, B, C, D, chunk: int, initial=None):
    """The stock chunked scan of one sequence, chunks from its first token: x [n, H, P], dt [n, H] (discretised),
    B, C [n, H, N] (per head), all FP32 -> (y [n, H, P], state after the last token [H, P, N]). Differentiable."""
    n, h, p = x.shape
    pad = (-n) % chunk
    padded = lambda t: F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).view(-1, chunk, *t.shape[1:])
    xc, dtc, bc, cc = padded(x), padded(dt), padded(B), padded(C)
    a = (dtc * A).permute(0, 2, 1)                                          # [c, H, Q]
    acum = torch.cumsum(a, dim=-1)
    m = torch.einsum("clhn,cshn->chls", cc, bc) * torch.exp(segsum(a))
    y_diag = torch.einsum("chls,csh,cshp->clhp", m, dtc, xc)
    decay_states = torch.exp(acum[..., -1:] - acum)
    states = torch.einsum("clhn,chl,clh,clhp->chpn", bc, decay_states, dtc, xc)
    s = x.new_zeros(h, p, B.shape[-1]) if initial is None else initial
    starts = []
    for c in range(xc.shape[0]):
        starts.append(s)
        s = torch.exp(acum[c, :, -1])[:, None, None] * s + states[c]
    y_off = torch.einsum("clhn,chpn,chl->clhp", cc, torch.stack(starts), torch.exp(acum))
    y = (y_diag + y_off).reshape(-1, h, p)[:n] + D[:, None] * x
    return y, s


def recurrent_step(x, dt, A, B, C, D, state):
    """The stock one-step recurrence (decode) of several sequences: x [b, H, P], dt [b, H], B, C [b, H, N],
    state [b, H, P, N] -> (y [b, H, P], the new state)."""
    state = torch.exp(dt * A)[..., None, None] * state + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = torch.matmul(state, C[..., None])[..., 0] + D[:, None] * x
    return y, state


def per_head(t, h):
    return t.float().repeat_interleave(h // t.shape[1], dim=1)


def cuda(x, dt, B, C, A_log, D, dt_bias, *, spans: SeqSpans, state: SSDState | None, chunk: int, dt_limit,
         state_dtype):
    from onepath.ops.cuda.ssd import ssd as triton_ssd
    return triton_ssd(*(t.detach() for t in (x, dt, B, C, A_log, D, dt_bias)), spans, state, chunk, dt_limit,
                      state_dtype)


def stock(x, dt, B, C, A_log, D, dt_bias, *, spans: SeqSpans, state: SSDState | None, chunk: int, dt_limit,
          state_dtype):
    h = x.shape[1]
    A, step = -torch.exp(A_log.float()), discretised(dt, dt_bias, dt_limit, pinned=False)
    if spans.decode_only:  # a static decode batch: every row one step of its slot's state (zeros at position 0)
        on = spans.on(x.device)
        held = state.ssm[on.slots].float() * (on.starts > 0)[:, None, None, None]
        y, s = recurrent_step(x.float(), step, A, per_head(B, h), per_head(C, h), D.float(), held)
        state.ssm[on.slots] = s.to(state_dtype)
        return y
    out = x.new_empty(x.shape, dtype=torch.float32)
    decode = [b for b in range(spans.num_seqs) if spans.starts[b] and spans.rows(b).stop - spans.rows(b).start == 1]
    for b in set(range(spans.num_seqs)) - set(decode):
        rows = spans.rows(b)
        if rows.stop == rows.start:
            continue
        initial = state.ssm[spans.slots[b]].float() if spans.starts[b] else None
        y, s = chunked_scan(x[rows].float(), step[rows], A, per_head(B[rows], h), per_head(C[rows], h), D.float(),
                            chunk, initial)
        out[rows] = y
        if state is not None:
            state.ssm[spans.slots[b]] = s.to(state_dtype)
    if decode:
        rows, slots = [spans.cu_seqlens[b] for b in decode], [spans.slots[b] for b in decode]
        y, s = recurrent_step(x[rows].float(), step[rows], A, per_head(B[rows], h), per_head(C[rows], h), D.float(),
                              state.ssm[slots].float())
        out[rows] = y
        state.ssm[slots] = s.to(state_dtype)
    return out


def reference(x, dt, B, C, A_log, D, dt_bias, *, spans: SeqSpans, chunk: int, dt_limit):
    """Differentiable: the stock chunked scan of each whole sequence from position 0."""
    if any(spans.starts):
        raise RuntimeError("ssd backward needs whole sequences from position 0 in the batch (no carried state)")
    h = x.shape[1]
    A, step = -torch.exp(A_log.float()), discretised(dt, dt_bias, dt_limit, pinned=False)
    outs = [chunked_scan(x[r].float(), step[r], A, per_head(B[r], h), per_head(C[r], h), D.float(), chunk)[0]
            for r in map(spans.rows, range(spans.num_seqs))]
    return torch.cat(outs) if outs else x.new_zeros(x.shape, dtype=torch.float32)


# (mode, device) -> kernel(x, dt, B, C, A_log, D, dt_bias, *, spans, state, chunk, dt_limit, state_dtype)
KERNELS = {
    ("consistent", "cpu"): consistent,
    ("consistent", "cuda"): cuda,
    ("baseline", "cpu"): stock,
    ("baseline", "cuda"): stock,
}


def ssd(spec: ExecutionSpec, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
        A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, spans: SeqSpans, state: SSDState | None = None,
        dt_limit: tuple[float, float] = NO_LIMIT, state_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [T, H, P], dt [T, H] (before dt_bias), B, C [T, G, N] of the sequences of `spans`, flattened; A_log, D,
    dt_bias [H]; state: the layer's SSDState, or None (whole sequences from position 0, nothing kept).
    Returns y [T, H, P] in FP32 (D's skip included)."""
    chunk = spec.op("ssd").chunk or SSD_CHUNK
    t, h, _ = x.shape
    if dt.shape != (t, h) or B.shape != C.shape or B.shape[0] != t or h % B.shape[1]:
        raise ValueError(f"ssd: x {tuple(x.shape)}, dt {tuple(dt.shape)}, B {tuple(B.shape)}, C {tuple(C.shape)}: "
                         "dt is [T, heads], B and C [T, groups, state] with heads a multiple of groups")
    if state is not None and spec.mode == "consistent" and state.chunk != chunk:
        raise ValueError(f"the scan state holds chunks of {state.chunk} tokens, the spec's ssd.chunk is {chunk}: "
                         "build the state cache from the model's spec")
    kernel = KERNELS[spec.mode, spec.device]
    options = dict(spans=spans, chunk=chunk, dt_limit=dt_limit)
    return apply_kernel(lambda *t: kernel(*t, state=state, state_dtype=state_dtype, **options),
                        lambda *t: reference(*t, **options), x, dt, B, C, A_log, D, dt_bias)
