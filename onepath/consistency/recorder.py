"""Record every operator call at the `ops` boundary, and run one side of a comparison.

Recording: every module that holds `self.ops` gets a `RecordingOps` proxy for the duration of a
`Recorder.installed(model)` block; the proxy forwards each call to the module's own backend and
records the op, the calling module (`model.layers.3.mlp.down_proj`), its layer and its outputs.
Models and backends are not edited: the recorder is a wrapper, so it records any `Ops` subclass.

A side is a model (its `ops` pick the backend and the ExecutionSpec) and a `Layout`: how its forward
passes compute a set of token sequences (whole prefill, chunked prefill, then decode one token per
pass, all sequences sharing each pass as continuous batching does). `trace` runs the passes over a
private paged KV cache the way the engine's ModelRunner and the trainer's Actor do
(`ForwardBatch.build`, `model(batch, cache)`, the LM head on the rows that need logits), then
teacher-forces: `token_logprobs` of each row's next token (its own token on a sequence's last row).

Alignment rule. Every pass makes the same sequence of ops calls (the model has no data-dependent
branch): the k-th body call of a pass, then the k-th head call (lm_head, token_logprobs), is *site*
k, named by op and module. Every site's output has one row per token of its launch (dim 0): the
pass's tokens for body sites, the rows that need logits for head sites. A mixture-of-experts layer's
experts (`models.moe.Experts`, Nemotron-H's `models.nemotron_h.Experts`) run their ops over (token,
expert) pairs, as many calls as the routing has experts in use: they are one site instead, op
"experts", whose output is the module's, one row [k, H] per token; the ops calls inside it are not
recorded. A DeepSeek-V4 compressor pools one row per window that closes in a pass: its `compress` method
is one site (METHOD_SITES), whose output has one row per token (its entry at the row that closes a
window, zeros elsewhere), the ops calls made inside it not recorded. A model with per-sequence state (a
hybrid's recurrent state, DeepSeek-V4's rings) keeps each sequence's in a slot of its own, as the engine
does. A token is (sequence, position); its value at site k is the row of the launch that computed it.
Two sides are compared at
site k over the positions of one sequence that both computed there, whatever the passes, batch
neighbours or row offsets that held them.
"""
from __future__ import annotations

import copy
import inspect
import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from onepath.models.batch import ForwardBatch, SeqChunk
from onepath.models.deepseek_v4 import Compressor
from onepath.models.dense import DenseDecoder
from onepath.models.kv_cache import BLOCK_SIZE
from onepath.models.moe import Experts
from onepath.models.nemotron_h import Experts as HybridExperts

# Modules recorded as one site (their output, one row per token): their ops calls are per pair, not token.
MODULE_SITES = (Experts, HybridExperts)
# Methods recorded as one site (their return value, one row per token): their ops calls are per window, not token;
# ops calls made while one runs are not recorded.
METHOD_SITES = ((Compressor, "compress"),)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_of(module: str) -> int | None:
    m = _LAYER.search(module)
    return int(m.group(1)) if m else None


@dataclass(slots=True)
class Call:
    index: int
    op: str
    module: str
    ops: object                              # the backend that ran it (a module-level site: the module)
    outputs: tuple[torch.Tensor, ...] | None
    inputs: dict | None = None               # bound arguments cloned before the call (captured calls only)

    def function(self):
        """What ran: the backend's op, a module-level site's module, or a method site's method."""
        if isinstance(self.ops, torch.nn.Module) and not hasattr(type(self.ops), self.op):
            return self.ops
        return getattr(self.ops, self.op)


class Recorder:
    def __init__(self, capture=()):
        self.calls: list[Call] = []
        self.capture = set(capture)
        self.inside = 0  # method sites running now: their ops calls are not recorded

    @contextmanager
    def installed(self, model: torch.nn.Module):
        whole = [(name, m) for name, m in model.named_modules() if isinstance(m, MODULE_SITES)]
        inside = {id(sub) for _, m in whole for sub in m.modules()}
        swapped = [(name, m, m.ops) for name, m in model.named_modules() if "ops" in vars(m) and id(m) not in inside]
        for name, m, ops in swapped:
            m.ops = RecordingOps(ops, self, name)
        originals = [(m, m.forward) for _, m in whole]
        for name, m in whole:
            # an instance attribute shadows the class's forward; nn.Module.__call__ runs it with the hooks
            m.forward = lambda *args, _m=m, _forward=m.forward, _name=name, **kwargs: self.call(
                _m, type(_m).__name__.lower(), _name, args, kwargs, _forward)
        methods = [(name, m, method) for name, m in model.named_modules() for cls, method in METHOD_SITES
                   if isinstance(m, cls)]
        for name, m, method in methods:
            setattr(m, method, lambda *args, _m=m, _f=getattr(m, method), _op=method, _name=name, **kwargs:
                    self.call(_m, _op, _name, args, kwargs, _f, site=True))
        try:
            yield self
        finally:
            for _, m, ops in swapped:
                m.ops = ops
            for m, _ in originals:
                del m.forward
            for _, m, method in methods:
                delattr(m, method)

    def call(self, inner, op: str, module: str, args, kwargs, method=None, site: bool = False):
        """Run inner's op (or, for a module-level or method site, `method`) and record it; site: a method site,
        whose own ops calls go unrecorded."""
        method = method or getattr(inner, op)
        if self.inside:
            return method(*args, **kwargs)
        index = len(self.calls)
        inputs = None
        if index in self.capture:
            # cloned before the call: attention writes this step's K/V into the caches it is given
            bound = inspect.signature(method).bind(*args, **kwargs)
            bound.apply_defaults()
            inputs = {k: snapshot(v) for k, v in bound.arguments.items()}
        self.inside += site
        try:
            out = method(*args, **kwargs)
        finally:
            self.inside -= site
        outs = out if isinstance(out, tuple) else (out,)
        kept = tuple(o.detach().clone() for o in outs if isinstance(o, torch.Tensor))
        self.calls.append(Call(index, op, module, inner, kept, inputs))
        return out


class RecordingOps:
    """Forwards every public method of the wrapped ops to it and records the call."""

    def __init__(self, inner, recorder: Recorder, module: str):
        self._inner, self._recorder, self._module = inner, recorder, module

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if name.startswith("_") or not callable(value):
            return value
        return lambda *args, **kwargs: self._recorder.call(self._inner, name, self._module, args, kwargs)


def snapshot(value):
    """A copy that later in-place writes (a KV cache) do not reach."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


@dataclass(frozen=True, slots=True)
class Layout:
    """How a side's forward passes compute its sequences."""
    prefill: int | None = None   # tokens of each sequence computed by prefill (None: all); the rest decode one per pass
    chunk: int | None = None     # prefill chunk size (None: the whole prefill in one pass)
    head: str = "all"            # rows that get logits: "all" (the trainer) or "last" (the engine: rows that sample)

    def __post_init__(self):
        if self.prefill is not None and self.prefill < 1:
            raise ValueError(f"prefill {self.prefill} must be >= 1: the first pass computes at least one token")
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"chunk {self.chunk} must be >= 1")
        if self.head not in ("all", "last"):
            raise ValueError(f"head {self.head!r} is unknown: use 'all' (trainer) or 'last' (engine)")

    def prefill_len(self, n: int) -> int:
        return n if self.prefill is None else min(self.prefill, n)

    def schedule(self, lengths: list[int]) -> list[list[tuple[int, int, int]]]:
        """Passes, each a list of (sequence, start, end): the tokens [start, end) it computes."""
        done, passes = [0] * len(lengths), []
        while any(d < n for d, n in zip(done, lengths)):
            pieces = []
            for i, n in enumerate(lengths):
                if done[i] >= n:
                    continue
                p = self.prefill_len(n)
                end = done[i] + 1 if done[i] >= p else p if self.chunk is None else min(p, done[i] + self.chunk)
                pieces.append((i, done[i], end))
                done[i] = end
            passes.append(pieces)
        return passes

    def head_rows(self, pieces, lengths) -> list[tuple[int, int, int]]:
        """(row in the pass, sequence, position) of each row that gets logits."""
        heads, offset = [], 0
        for s, a, b in pieces:
            if self.head == "all":
                wanted = range(a, b)
            else:  # the engine samples once a sequence's prefill is complete: the last row of each such piece
                wanted = [b - 1] if b >= self.prefill_len(lengths[s]) else []
            heads += [(offset + pos - a, s, pos) for pos in wanted]
            offset += b - a
        return heads

    def describe(self) -> str:
        parts = ["whole prefill" if self.prefill is None else f"prefill {self.prefill} then decode"]
        if self.chunk:
            parts.append(f"chunks of {self.chunk}")
        if self.head == "last":
            parts.append("logits on sampling rows")
        return ", ".join(parts)


@dataclass(slots=True)
class Site:
    op: str
    module: str
    layer: int | None

    @property
    def name(self) -> str:
        return f"{self.op} at {self.module}" if self.module else self.op


@dataclass(slots=True)
class SiteRows:
    """One sequence's rows at one site, in position order."""
    positions: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)   # global call index of the launch that computed each position
    rows: list[int] = field(default_factory=list)    # its row in that launch's output
    parts: list[list[torch.Tensor]] = field(default_factory=list)
    values: tuple[torch.Tensor, ...] = ()
    present: tuple[torch.Tensor | None, ...] = ()  # per output: which elements are real (None: all of them)

    def add(self, call: Call, rows: list[int], positions: list[int]):
        if not call.outputs:  # a write into a cache returns nothing to compare
            return
        index = torch.tensor(rows, dtype=torch.long, device=call.outputs[0].device)
        if not self.parts:
            self.parts = [[] for _ in call.outputs]
        for acc, out in zip(self.parts, call.outputs):
            acc.append(out.index_select(0, index))
        self.positions += positions
        self.calls += [call.index] * len(rows)
        self.rows += rows

    def finish(self):
        """Concatenate the launches' rows. An output whose trailing dims grow with its pass (DeepSeek-V4's
        candidate entries: as many as the pass's longest context has) is zero-padded to the longest, `present`
        marking the real elements; what lies past a launch's own length is past every row's valid entries."""
        values, present = [], []
        for parts in self.parts:
            widest = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
            if all(list(p.shape[1:]) == widest for p in parts):
                values.append(torch.cat(parts))
                present.append(None)
                continue
            padded, masks = [], []
            for p in parts:
                out = p.new_zeros(p.shape[0], *widest)
                mask = torch.zeros(out.shape, dtype=torch.bool, device=p.device)
                region = (slice(None),) + tuple(slice(0, n) for n in p.shape[1:])
                out[region], mask[region] = p, True
                padded.append(out)
                masks.append(mask)
            values.append(torch.cat(padded))
            present.append(torch.cat(masks))
        self.values, self.present, self.parts = tuple(values), tuple(present), []

    def common(self, other: "SiteRows") -> tuple[list[int], list[int], list[int]]:
        """Positions both computed at this site, and their indices into self.values and other.values."""
        mine = {p: i for i, p in enumerate(self.positions)}
        theirs = {p: i for i, p in enumerate(other.positions)}
        shared = sorted(mine.keys() & theirs.keys())
        return shared, [mine[p] for p in shared], [theirs[p] for p in shared]


@dataclass(slots=True)
class Trace:
    sites: list[Site]
    rows: list[list[SiteRows]]        # [site][sequence]
    captured: dict[int, Call]         # call index -> the call with its inputs


def common_region(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor cropped to the trailing shape they share (the rows kept): two launches of a site whose trailing
    dims grow with the pass agree on the region every row's valid entries lie in."""
    dims = tensors[0].dim()
    if any(t.dim() != dims for t in tensors):
        raise ValueError(f"rows of shapes {[tuple(t.shape) for t in tensors]}: compare one architecture under two "
                         "sides")
    region = (slice(None),) + tuple(slice(0, min(t.shape[d] for t in tensors)) for d in range(1, dims))
    return [t[region] for t in tensors]


def check_same_sites(a: Trace, b: Trace) -> None:
    for k, (x, y) in enumerate(zip(a.sites, b.sites)):
        if (x.op, x.module) != (y.op, y.module):
            raise ValueError(f"site {k} is {x.name} on side A but {y.name} on side B: the two models make different "
                             "ops calls; compare one architecture under two sides")
    if len(a.sites) != len(b.sites):
        raise ValueError(f"side A makes {len(a.sites)} ops calls per pass, side B {len(b.sites)}: compare one "
                         "architecture under two sides")


class _Gather:
    """Turns each pass's calls into sites and gathers every sequence's rows per site."""

    def __init__(self, num_seqs: int):
        self.num_seqs, self.passes = num_seqs, 0
        self.sites: dict[str, list[Site]] = {}
        self.rows: dict[tuple[str, int], list[SiteRows]] = {}

    def add(self, part: str, calls: list[Call], owners: list[tuple[int, int]], keep: set[int]):
        """calls: one pass's body or head calls; owners: (sequence, position) of each row of their launches."""
        if part not in self.sites:
            self.sites[part] = [Site(c.op, c.module, layer_of(c.module)) for c in calls]
        expected = [(s.op, s.module) for s in self.sites[part]]
        if [(c.op, c.module) for c in calls] != expected:
            raise RuntimeError(f"pass {self.passes} made {len(calls)} {part} ops calls that differ from pass 0's "
                               f"{len(expected)}: the model's call sequence depends on the data, so its calls "
                               "cannot be aligned by site")
        by_seq: dict[int, tuple[list[int], list[int]]] = {}
        for row, (s, pos) in enumerate(owners):
            by_seq.setdefault(s, ([], []))[0].append(row)
            by_seq[s][1].append(pos)
        for k, call in enumerate(calls):
            for out in call.outputs:
                if out.shape[0] != len(owners):
                    raise RuntimeError(f"{call.op} at {call.module or 'the model'} returned {out.shape[0]} rows for a "
                                       f"launch of {len(owners)} tokens: only ops with one output row per token align")
            per_seq = self.rows.setdefault((part, k), [SiteRows() for _ in range(self.num_seqs)])
            for s, (rows, positions) in by_seq.items():
                per_seq[s].add(call, rows, positions)
            if call.index not in keep:
                call.outputs = None  # gathered: free the launch's full output

    def finish(self, captured: dict[int, Call]) -> Trace:
        keys = [(part, k) for part in ("body", "head") for k in range(len(self.sites.get(part, [])))]
        for key in keys:
            for r in self.rows[key]:
                if r.parts:
                    r.finish()
        return Trace(self.sites["body"] + self.sites.get("head", []), [self.rows[key] for key in keys], captured)


def trace_cache(model: DenseDecoder, num_blocks: int, block_size: int, num_seqs: int):
    """A trace's private cache, and whether its sequences take state slots: a model with per-sequence state (a
    hybrid's, DeepSeek-V4's rings) gets one slot per sequence, so chunks and decode passes continue from it."""
    stateful = model.has_recurrent_state
    return model.make_cache(num_blocks, block_size, num_seqs if stateful else 0), stateful


@torch.no_grad()
def trace(model: DenseDecoder, sequences: list[list[int]], layout: Layout = Layout(), block_size: int = BLOCK_SIZE,
          capture=()) -> Trace:
    """Run `sequences` through `model` as `layout` says and record every site's rows per sequence.
    `capture`: global call indices whose inputs are kept (Trace.captured)."""
    lengths = [len(s) for s in sequences]
    if not sequences or min(lengths) == 0:
        raise ValueError("every sequence needs at least one token")
    tables, next_block = [], 0
    for n in lengths:
        tables.append(list(range(next_block, next_block - (-n // block_size))))
        next_block = tables[-1][-1] + 1
    device = model.device
    cache, stateful = trace_cache(model, next_block, block_size, len(sequences))
    recorder, gather = Recorder(capture), _Gather(len(sequences))
    with recorder.installed(model):
        for pieces in layout.schedule(lengths):
            chunks = [SeqChunk(sequences[s][a:b], a, tables[s], s if stateful else None) for s, a, b in pieces]
            mark = len(recorder.calls)
            hidden = model(ForwardBatch.build(chunks, block_size, device), cache)
            owners = [(s, pos) for s, a, b in pieces for pos in range(a, b)]
            gather.add("body", recorder.calls[mark:], owners, recorder.capture)
            heads = layout.head_rows(pieces, lengths)
            if heads:
                mark = len(recorder.calls)
                rows = torch.tensor([r for r, _, _ in heads], dtype=torch.long, device=device)
                targets = torch.tensor([sequences[s][min(pos + 1, lengths[s] - 1)] for _, s, pos in heads],
                                       dtype=torch.long, device=device)
                logits = model.compute_logits(hidden.index_select(0, rows))
                model.ops.token_logprobs(logits, targets, torch.ones(len(heads), dtype=torch.float32, device=device))
                gather.add("head", recorder.calls[mark:], [(s, pos) for _, s, pos in heads], recorder.capture)
            gather.passes += 1
    return gather.finish({c.index: c for c in recorder.calls if c.index in recorder.capture})
