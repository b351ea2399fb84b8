"""Where does the MoE model with block-FP8 experts lose trainer == engine? A diagnosis, not a test.

    python lab/diagnose_moe_fp8.py > lab/results/moe-fp8-diagnosis.log   # the H200 case
    python lab/diagnose_moe_fp8.py --device cpu [--plant experts]           # a CPU smoke run, tiny MoE

It runs step 0 of tests/engine/test_engine_gpu.py's trainer_diffs as it is (the model of
tests/models/test_moe_gpu.py with the fp8 preset, the same seeds, requests and engine settings; on the CPU
a tiny MoE) and records, on both sides, every site of every forward: the ops calls as recorder.py
names them (a layer's experts are one site, "experts") and the output of every attention, router,
MoE block (the combine) and decoder layer ("output" sites). It prints:
  1. the diff metrics (an unrecorded run's too: recording must not move a bit) and every differing
     token; for the first one, the engine step that computed it (prefill, chunk or decode: its
     sequences, rows and the MoE layout) and the trainer's packed forward;
  2. that token's row layer by layer on both sides; the first site where the request's rows up to the
     token differ (there every input of the row is equal on both sides: recorder.py's alignment rule);
     that site rerun on each side's captured inputs (by its own module, by the other side's, the row
     alone, the experts in the other side's layout) and a verdict: the launch (other rows, size,
     layout), the module (backend, spec, weights) or the inputs;
  3. the router's top-k margins per layer (k-th minus (k+1)-th probability): a near tie flips an expert.
Then, on CUDA, the cheap checks: the FP8 linear's rows for every M prefix; layer 0's experts masked vs
contiguous vs alone.

--plant puts a defect of tests/planted.py on one side, so that the locator can be checked on the CPU:
experts: the trainer's SplitKExpertsAboveTwoRowsOps (split-K in an expert's down projection above two
rows; the CPU path only: CUDA's grouped expert kernel does not call it) must be named at layer 0's
experts; decode-attention: the engine's DecodeBaselineAttentionOps at layer 0's attention, in a decode step.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from onepath.consistency.bisect import SiteDiff, compare_site, differs  # noqa: E402
from onepath.numerics.diff import rollout_diff  # noqa: E402
from onepath.consistency.recorder import (Call, Recorder, SiteRows, Trace, _Gather, check_same_sites,  # noqa: E402
                                          snapshot)
from onepath.models import build_decoder  # noqa: E402
from onepath.models.dense import Attention, DecoderLayer  # noqa: E402
from onepath.models.moe import Experts, Router, SparseMoeBlock  # noqa: E402
from onepath.numerics.spec import ExecutionSpec  # noqa: E402
from onepath.ops import Ops  # noqa: E402
from onepath.train.actor import Actor, Responses  # noqa: E402
from tests.engine import test_engine_gpu as rl  # noqa: E402  trainer_diffs' engine settings and sampling params
from tests.planted import DecodeBaselineAttentionOps, SplitKExpertsAboveTwoRowsOps  # noqa: E402
from tests.tiny import random_prompts, tiny_moe_config  # noqa: E402

OUTPUT_SITES = (Attention, Router, SparseMoeBlock, DecoderLayer)  # their outputs are sites named "output"
LAUNCH_WIDE = ("weight", "bias", "cos", "sin")  # tensor arguments that are never the launch's rows
COLUMNS = (("attention", "output", "self_attn"), ("router", "router", "mlp.gate"), ("probs", "softmax", "mlp.gate"),
           ("top-k", "topk", "mlp.gate"), ("experts", "experts", "mlp.experts"), ("combine", "output", "mlp"),
           ("layer", "output", ""))
# --plant: a known defect (tests/planted.py) on one side, to check on the CPU that the locator names it
PLANTS = {"experts": ("trainer", SplitKExpertsAboveTwoRowsOps),
          "decode-attention": ("engine", DecodeBaselineAttentionOps)}


def build(device: str, quant: str | None, ops_class=Ops):
    """trainer_diffs' model (seed 2): test_moe_gpu's on CUDA, a tiny MoE on the CPU; every module's ops
    an ops_class."""
    if device == "cuda":
        from tests.models.test_moe_gpu import moe_model
        model = moe_model("consistent", seed=2, quant=quant)
    else:
        spec = ExecutionSpec.default("consistent", "cpu", quant=quant)
        model = build_decoder(tiny_moe_config(max_position_embeddings=1024), Ops(spec), max_positions=1024)
        model.init_weights(2, std=0.15)
    if ops_class is not Ops:
        ops = ops_class(model.ops.spec)
        for m in model.modules():
            if "ops" in vars(m):
                m.ops = ops
    return model


@dataclass(slots=True)
class Pass:
    """One forward: an engine step or the trainer's packed forward."""
    label: str
    calls: range                          # its global call indices, body and head
    chunks: list[tuple[int, int, int]]    # (request, first position, tokens) in row order
    layouts: set[str]                     # the MoE layouts its experts ran

    def covers(self, request: int, position: int) -> bool:
        return any(r == request and a <= position < a + n for r, a, n in self.chunks)

    def describe(self, prompt_lens: list[int]) -> str:
        decode = sum(n == 1 and a >= prompt_lens[r] for r, a, n in self.chunks)
        rows = sum(n for _, _, n in self.chunks)
        return (f"{self.label}: {len(self.chunks)} sequences, T = {rows} rows ({decode} decode rows, "
                f"{rows - decode} rows in {len(self.chunks) - decode} multi-token pieces), "
                f"MoE layout {'/'.join(sorted(self.layouts)) or '-'}")

    def phase(self, request: int, position: int, prompt_len: int) -> str:
        a, n = next((a, n) for r, a, n in self.chunks if r == request and a <= position < a + n)
        if a >= prompt_len and n == 1:
            return "a decode step"
        if a == 0 and n == prompt_len:
            return "the whole prompt's prefill"
        return f"the piece of positions {a}..{a + n - 1}" + (" (prompt + completion)" if a + n > prompt_len else "")


class Tap:
    """Records every forward of `model` inside installed(): its sites' rows per request and position
    (recorder.py's Trace), plus which rows each forward held (end() closes one)."""

    def __init__(self, model, num_requests: int, capture=()):
        self.model, self.recorder, self.gather = model, Recorder(capture), _Gather(num_requests)
        self.passes: list[Pass] = []
        self.body_ends: list[int] = []
        self.layouts: set[str] = set()

    @contextmanager
    def installed(self):
        named = [(n, m) for n, m in self.model.named_modules() if isinstance(m, OUTPUT_SITES)]
        with self.recorder.installed(self.model):
            for name, m in named:  # as the recorder does for the experts: an instance forward that records
                m.forward = lambda *a, _m=m, _f=m.forward, _n=name, **kw: self.recorder.call(
                    _m, "output", _n, a, kw, _f)
            hooks = [self.model.register_forward_hook(lambda *_: self.body_ends.append(len(self.recorder.calls)))]
            hooks += [m.register_forward_pre_hook(lambda _, a: self.layouts.add(a[2] if len(a) > 2 else "contiguous"))
                      for m in self.model.modules() if isinstance(m, Experts)]
            try:
                yield self
            finally:
                for h in hooks:
                    h.remove()
                for _, m in named:
                    del m.forward

    def end(self, label: str, chunks: list[tuple[int, int, int]], heads: list[tuple[int, int]]) -> None:
        """Close the forward run since the last end(): its chunks and the (request, position) of each LM-head row."""
        if len(self.body_ends) != len(self.passes) + 1:
            raise RuntimeError(f"{label} ran {len(self.body_ends) - len(self.passes)} model forwards: one expected")
        calls, first, body = self.recorder.calls, self.passes[-1].calls.stop if self.passes else 0, self.body_ends[-1]
        self.gather.add("body", calls[first:body], [(r, p) for r, a, n in chunks for p in range(a, a + n)],
                        self.recorder.capture)
        if body < len(calls):
            self.gather.add("head", calls[body:], heads, self.recorder.capture)
        self.gather.passes += 1
        self.passes.append(Pass(label, range(first, len(calls)), chunks, self.layouts))
        self.layouts = set()

    def finish(self) -> Trace:
        return self.gather.finish({c.index: c for c in self.recorder.calls if c.inputs is not None})

    def pass_of(self, call: int) -> Pass:
        return next(p for p in self.passes if call in p.calls)


def run_engine(model, prompts, params, capture=()) -> tuple[list, Tap]:
    """trainer_diffs' rollout of step 0 (request ids 0..n-1), every engine step recorded, eagerly."""
    engine = rl.engine(model)
    engine.runner.graphs = None  # a replayed CUDA graph makes no ops calls: record eager steps (graph == eager, C4)
    tap, run = Tap(model, len(prompts), capture), engine.runner.run

    def step(scheduled, *rest):
        out = run(scheduled, *rest)
        tap.end(f"engine step {len(tap.passes)}", [(s.seq.request_id, s.start, s.num_tokens) for s in scheduled],
                [(s.seq.request_id, s.start + s.num_tokens - 1) for s in scheduled if s.samples])
        return out

    engine.runner.run = step
    with tap.installed():
        outs = engine.generate(prompts, params, request_ids=list(range(len(prompts))))
    return outs, tap


def run_trainer(model, r: Responses, capture=()) -> tuple[torch.Tensor, Tap]:
    """trainer_diffs' recompute: Actor.logprobs with grad, every sequence in one packed forward."""
    # built before the tap: its ops (sampling mask, log-probs) stay unrecorded, as the engine's sampler's are
    actor, tap = Actor(model, block_size=16, lr=1e-4), Tap(model, len(r.prompt_ids), capture)
    with tap.installed():
        lp, _ = actor.logprobs(r)
    pairs = list(enumerate(zip(r.prompt_ids, r.completion_ids)))
    tap.end("trainer forward", [(i, 0, len(p) + len(c) - 1) for i, (p, c) in pairs],
            [(i, len(p) - 1 + j) for i, (p, c) in pairs for j in range(len(c))])
    return lp.detach().cpu(), tap


def upto(rows: SiteRows, keep) -> SiteRows:
    """rows restricted to the positions where keep(position)."""
    idx = [n for n, p in enumerate(rows.positions) if keep(p)]
    pick = lambda xs: [xs[n] for n in idx]
    index = torch.tensor(idx, dtype=torch.long, device=rows.values[0].device) if rows.values else None
    return SiteRows(pick(rows.positions), pick(rows.calls), pick(rows.rows), [],
                    tuple(v.index_select(0, index) for v in rows.values))


def row_value(trace: Trace, k: int, request: int, position: int) -> tuple[torch.Tensor, ...] | None:
    rows = trace.rows[k][request]
    if position not in rows.positions:
        return None
    n = rows.positions.index(position)
    return tuple(v[n] for v in rows.values)


def same(a, b) -> bool:
    return (a is not None and b is not None and len(a) == len(b)
            and all(x.shape == y.shape and not bool(differs(x, y).any()) for x, y in zip(a, b)))


def layer_table(te: Trace, tt: Trace, request: int, position: int, layers: int) -> list[str]:
    """The token's row at the main sites of each layer: '=' equal, else max |d|; '-' no such site."""
    index = {(s.op, s.module): k for k, s in enumerate(te.sites)}

    def cell(op, module):
        k = index.get((op, module))
        if k is None:
            return "-"
        d = compare_site(k, te.sites[k], upto(te.rows[k][request], lambda q: q == position),
                         upto(tt.rows[k][request], lambda q: q == position))
        if op == "topk" and d.differing:  # (probabilities, experts): say whether an expert changed
            chosen = [row_value(t, k, request, position)[1] for t in (te, tt)]
            return "flip" if not torch.equal(*chosen) else f"{d.max_abs:.1e}"
        return "-" if not d.elements else "=" if not d.differing else f"{d.max_abs:.1e}"

    lines = ["  layer " + " ".join(f"{c[0]:>10}" for c in COLUMNS)]
    for i in range(layers):
        cells = [cell(op, f"model.layers.{i}" + (f".{m}" if m else "")) for _, op, m in COLUMNS]
        lines.append(f"  {i:5d} " + " ".join(f"{c:>10}" for c in cells))
    return lines + [f"  final norm {cell('rmsnorm', 'model.norm')}, logits {cell('lm_head', '')}"]


def margins(te: Trace, tt: Trace, request: int, position: int, k: int) -> list[str]:
    """Per sparse layer: the k-th minus the (k+1)-th router probability of the token, on both sides,
    and the experts each side chose."""
    lines = []
    for n, site in enumerate(te.sites):
        if site.op != "softmax" or n + 1 >= len(te.sites) or te.sites[n + 1].op != "topk":
            continue
        probs = [row_value(t, n, request, position) for t in (te, tt)]
        chosen = [row_value(t, n + 1, request, position) for t in (te, tt)]
        if None in probs or probs[0][0].numel() <= k:
            continue
        top = [p[0].double().sort(descending=True).values for p in probs]
        gap = [float(t[k - 1] - t[k]) for t in top]
        picks = [c[1].tolist() for c in chosen]
        agree = "same experts" if picks[0] == picks[1] else f"trainer chose {picks[1]}"
        lines.append(f"  layer {site.layer}: margin {gap[0]:.3g} (k-th {float(top[0][k - 1]):.5g}), trainer "
                     f"{'equal' if gap[0] == gap[1] else f'{gap[1]:.3g}'}; engine chose {picks[0]}, {agree}")
    return lines


def per_row(name: str, value, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows and name not in LAUNCH_WIDE


@torch.no_grad()
def replay(function, call: Call, row: int, alone: bool = False, layout: str | None = None):
    """function (a side's op or module) on call's captured inputs, output row `row`. alone: on that row's
    inputs only (None where an argument describes the whole launch: attention metadata, a ForwardBatch)."""
    args = {k: snapshot(v) for k, v in call.inputs.items()}
    if alone:
        if any(dataclasses.is_dataclass(v) for v in args.values()):
            return None
        rows = call.outputs[0].shape[0]
        args = {k: v[row:row + 1] if per_row(k, v, rows) else v for k, v in args.items()}
        row = 0
    if layout is not None:
        args["layout"] = layout
    out = function(**args)
    return tuple(o[row] for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor))


def rerun(first: SiteDiff, engine: tuple[Call, int, Pass], trainer: tuple[Call, int, Pass]) -> tuple[list[str], str]:
    """The first divergent site rerun on each side's captured launch: by its own module, by the other
    side's, on the token's row alone, and (experts) in the other side's layout."""
    (ce, re, pe), (ct, rt, _) = engine, trainer
    fe, ft = ce.function(), ct.function()
    rows_e, rows_t = ce.outputs[0].shape[0], ct.outputs[0].shape[0]
    names = [k for k, v in ce.inputs.items() if per_row(k, v, rows_e) and per_row(k, ct.inputs[k], rows_t)]
    unequal = [k for k in names if not torch.equal(ce.inputs[k][re], ct.inputs[k][rt])]
    recorded = [tuple(o[r] for o in c.outputs) for c, r in ((ce, re), (ct, rt))]
    launched = [replay(fe, ce, re), replay(ft, ct, rt)]
    crossed = [replay(ft, ce, re), replay(fe, ct, rt)]
    alone = [replay(fe, ce, re, alone=True), replay(ft, ct, rt, alone=True)]
    yes = lambda b: "yes" if b else "NO"
    lines = [f"rerun of {first.name} on the captured inputs of the token's row:",
             f"  the row's inputs ({', '.join(names) or 'none comparable'}): "
             + ("equal on both sides" if not unequal else f"DIFFER in {', '.join(unequal)}"),
             f"  engine's launch ({pe.label}, {rows_e} rows) rerun == engine's row: "
             f"{yes(same(launched[0], recorded[0]))}; by the trainer's module: {yes(same(crossed[0], recorded[0]))}",
             f"  trainer's launch ({rows_t} rows) rerun == trainer's row: "
             f"{yes(same(launched[1], recorded[1]))}; by the engine's module: {yes(same(crossed[1], recorded[1]))}"]
    if alone[0] is not None:
        lines.append(f"  the row alone: engine == trainer {yes(same(*alone))}; == its launch's row: engine "
                     f"{yes(same(alone[0], recorded[0]))}, trainer {yes(same(alone[1], recorded[1]))}")
    if first.op == "experts" and ce.inputs["layout"] != ct.inputs["layout"]:
        le, lt = ce.inputs["layout"], ct.inputs["layout"]
        lines += [f"  engine's launch in the trainer's layout ({lt}) == engine's row: "
                  f"{yes(same(replay(fe, ce, re, layout=lt), recorded[0]))}",
                  f"  trainer's launch in the engine's layout ({le}) == trainer's row: "
                  f"{yes(same(replay(ft, ct, rt, layout=le), recorded[1]))}"]
    moved = [side for side, a, r in zip(("engine", "trainer"), alone, recorded) if a is not None and not same(a, r)]
    if unequal:
        verdict = "the inputs: the row's inputs already differ here (an input no site records)"
    elif not (same(launched[0], recorded[0]) and same(launched[1], recorded[1])):
        verdict = "neither: a rerun on the same inputs gives other bits (non-determinism, global state)"
    elif moved:
        verdict = (f"the launch: alone, the row has other bits than in its launch ({' and '.join(moved)}): "
                   "they follow the other rows / the layout")
    elif not (same(crossed[0], recorded[0]) and same(crossed[1], recorded[1])):
        verdict = "the module: the two sides' modules give one launch other bits (backend, spec or weights differ)"
    else:
        verdict = "the launch: both modules agree on each launch; the row's bits follow the launch's size / layout"
    return lines, verdict


def head_rerun(model, logits: torch.Tensor, token: int, params, values: tuple[float, float]) -> list[str]:
    """Every site is equal through the logits: the token's log-prob from its logits row alone."""
    ops, dev = model.ops, logits.device
    t = torch.tensor([params.temperature], device=dev)
    keep = ops.sampling_mask(logits[None], t, torch.tensor([params.top_k], device=dev),
                             torch.tensor([params.top_p], device=dev))
    lp = float(ops.token_logprobs(logits[None], torch.tensor([token], device=dev), t, keep)[0][0])
    return ["  logits equal on both sides: the divergence is in the sampling head (sampling_mask, token_logprobs)",
            f"  the row alone (the trainer's ops) gives {lp!r}; engine {values[0]!r}, trainer {values[1]!r}"]


def first_divergence(te: Trace, tt: Trace, request: int, last: int) -> SiteDiff | None:
    """The first site, in call order, where the request's rows at positions <= last differ: there every
    input of the first differing row is equal on both sides (recorder.py's alignment rule)."""
    for k, site in enumerate(te.sites):
        d = compare_site(k, site, upto(te.rows[k][request], lambda q: q <= last),
                         upto(tt.rows[k][request], lambda q: q <= last))
        if d.differing:
            return d
    return None


def launch_of(trace: Trace, tap: Tap, site: int, request: int, position: int) -> tuple[int, int, Pass]:
    """(call index, row in its output, the forward) that computed the position at the site."""
    rows = trace.rows[site][request]
    n = rows.positions.index(position)
    return rows.calls[n], rows.rows[n], tap.pass_of(rows.calls[n])


def rollout(outs, params) -> Responses:
    return Responses.build([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], params,
                           [o.logprobs for o in outs])


def differing(r: Responses, lp: torch.Tensor) -> list[list[int]]:
    """(request, completion index) of every token whose trainer log-prob is not the engine's, bitwise."""
    return ((lp != r.rollout_logprobs) & r.mask).nonzero().tolist()


def locate(device: str = "cuda", requests: int = 16, prompt_len: int = 200, max_tokens: int = 40,
           quant: str | None = "fp8", plant: str | None = None) -> dict:
    """Run trainer_diffs' step 0 with every site recorded; print where its first differing token diverges."""
    side, planted = PLANTS[plant] if plant else (None, Ops)
    engine_model = build(device, quant, planted if side == "engine" else Ops)
    policy = build(device, quant, planted if side == "trainer" else Ops)
    prompts = random_prompts(torch.Generator().manual_seed(5), requests, high=prompt_len)
    params = [dataclasses.replace(rl.PARAMS[i % 3], max_tokens=max_tokens) for i in range(requests)]
    print(f"model {device} quant {quant}{f' ({side} planted: {planted.__name__})' if plant else ''}, "
          f"{requests} requests")
    # unrecorded first, as trainer_diffs runs it: the recording must not move a bit
    plain = rl.engine(engine_model)
    plain_outs = plain.generate(prompts, params, request_ids=list(range(requests)))
    plain_r = rollout(plain_outs, params)
    plain_tokens = differing(plain_r, Actor(policy, block_size=16, lr=1e-4).logprobs(plain_r)[0].detach().cpu())
    outs, engine = run_engine(engine_model, prompts, params)
    r = rollout(outs, params)
    lp, trainer = run_trainer(policy, r)
    metrics = rollout_diff(r.rollout_logprobs, lp, r.mask)
    print("step 0 diff:", {k: v for k, v in metrics.items() if "max" in k or "frac" in k},
          f"(unrecorded: {len(plain_tokens)} tokens differ, {plain.stats.graph_steps} engine steps from CUDA graphs)")
    tokens = differing(r, lp)
    if [o.token_ids for o in outs] != [o.token_ids for o in plain_outs] or tokens != plain_tokens:
        print(f"WARNING: the recorded run is not the unrecorded one: {len(plain_tokens)} tokens differed unrecorded, "
              f"{len(tokens)} recorded; the recording moves bits, what follows may not be the test's case")
    result = {"metrics": metrics, "tokens": tokens, "site": None, "verdict": None}
    if not tokens:
        print(f"no divergence: all {int(r.mask.sum())} tokens bitwise equal")
        return result
    print(f"{len(tokens)} differing tokens (request, completion index, |d logprob|):",
          [(i, j, float(abs(lp[i, j] - r.rollout_logprobs[i, j]))) for i, j in tokens[:8]])

    i, j = tokens[0]
    prompt_lens = [len(p) for p in r.prompt_ids]
    pos = prompt_lens[i] + j - 1  # the row whose logits sampled completion token j
    te, tt = engine.finish(), trainer.finish()
    check_same_sites(te, tt)
    step = next(p for p in engine.passes if p.covers(i, pos))
    result["engine_phase"] = step.phase(i, pos, prompt_lens[i])
    print(f"token: request {i}, completion token {j} (sampled at position {pos + 1} from row {pos}; prompt "
          f"{prompt_lens[i]} tokens, params {params[i]})")
    print(f"  engine: {result['engine_phase']} in {step.describe(prompt_lens)}")
    print(f"  trainer: {trainer.passes[0].describe(prompt_lens)}")
    print(f"the token's row (position {pos}) per layer, engine vs trainer:")
    print("\n".join(layer_table(te, tt, i, pos, engine_model.config.num_hidden_layers)))

    k_top = engine_model.config.num_experts_per_tok
    first = first_divergence(te, tt, i, pos)
    if first is None:
        print("\n".join(head_rerun(policy, row_value(te, len(te.sites) - 1, i, pos)[0], r.completion_ids[i][j],
                                   params[i], (float(r.rollout_logprobs[i, j]), float(lp[i, j])))))
    else:
        p = first.first_position
        layer = "" if first.layer is None else f"layer {first.layer}, "
        print(f"FIRST DIVERGENCE over request {i}'s positions 0..{pos}: {first.name} ({layer}site {first.site}) "
              f"at position {p}: {first.differing} of {first.elements} elements, max |d| {first.max_abs:.3g}, "
              f"{first.max_ulp} ULP")
        launches = [launch_of(te, engine, first.site, i, p), launch_of(tt, trainer, first.site, i, p)]
        for name, (_, row, where) in zip(("engine", "trainer"), launches):
            print(f"  {name}: position {p} in {where.phase(i, p, prompt_lens[i])} of {where.describe(prompt_lens)}, "
                  f"row {row}")
        # a second, identical run keeps the two launches' inputs (keeping all would copy every KV cache)
        again = [run_engine(engine_model, prompts, params, capture={launches[0][0]})[1],
                 run_trainer(policy, r, capture={launches[1][0]})[1]]
        captured = [(tap.finish().captured[c], row, where) for tap, (c, row, where) in zip(again, launches)]
        if any((c.op, c.module) != (first.op, first.module) for c, _, _ in captured):
            raise RuntimeError("the second run's call at the site's index is another op: the runs are not identical")
        lines, verdict = rerun(first, *captured)
        print("\n".join(lines) + f"\nVERDICT: {verdict}")
        result.update(site=first.name, layer=first.layer, verdict=verdict)
        if p != pos:
            print(f"router top-k margins at position {p} (k = {k_top}):")
            print("\n".join(margins(te, tt, i, p, k_top)))
    print(f"router top-k margins of the token's row {pos} (k = {k_top}):")
    print("\n".join(margins(te, tt, i, pos, k_top)))
    return result


def kernel_checks(quant: str) -> None:
    """The FP8 linear's rows for every M prefix at the expert shapes; layer 0's experts masked ==
    contiguous == each token alone."""
    from onepath.ops.linear_quant import quant_linear
    from tests.models.test_moe_gpu import SHAPE, moe_model

    spec = ExecutionSpec.default("consistent", "cuda", quant=quant)
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((512, 512), (512, 256), (1000, 512), (1536, 512)):
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.05).bfloat16()
        x = torch.randn(300, k, generator=g, device="cuda").bfloat16()
        for out_dtype in (torch.bfloat16, torch.float32):
            full = quant_linear(spec, x, w, None, out_dtype)
            bad = [m for m in (1, 2, 7, 16, 33, 64, 65, 128, 129, 200)
                   if not torch.equal(quant_linear(spec, x[:m], w, None, out_dtype), full[:m])]
            print(f"fp8 linear N {n} K {k} out {out_dtype}: row-prefix M that differ from M=300: {bad}", flush=True)
    block = moe_model("consistent", quant=quant).model.layers[0].mlp
    x = torch.randn(60, SHAPE["hidden_size"], generator=g, device="cuda").bfloat16()
    with torch.no_grad():
        _, chosen = block.gate(x)
        con = block.experts(x, chosen, "contiguous")
        mas = block.experts(x, chosen, "masked")
        alone = torch.cat([block.experts(x[i:i + 1], chosen[i:i + 1], "masked") for i in range(60)])
    print("experts masked == contiguous:", torch.equal(con, mas), "alone == contiguous:", torch.equal(alone, con))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quant", default="fp8", help="quant presets joined by '+'; 'none' for none")
    p.add_argument("--plant", choices=sorted(PLANTS), help="experts: the trainer's experts split K above two rows "
                   "(CPU path); decode-attention: the engine's decode steps run the baseline attention")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=200, help="longest prompt (random lengths 1..N)")
    p.add_argument("--max-tokens", type=int, default=40)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("diagnose_moe_fp8: no CUDA device here: run it on the GPU machine, or pass --device cpu")
        return 2
    quant = None if args.quant == "none" else args.quant
    locate(args.device, args.requests, args.prompt_len, args.max_tokens, quant, args.plant)
    if args.device == "cuda" and quant:
        kernel_checks(quant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
