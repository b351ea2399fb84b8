"""`onepath check MODEL`: the consistency gates C0..C10, in order, each with its evidence.

Each gate is a function `gate_cN(ctx) -> GateResult` over a GateContext: the model's config and
weights, the ExecutionSpec under test, and the backend factory (`ops_factory`, an `Ops` subclass or
any callable spec -> ops) that builds every model the gate runs. Tests plant defects through that
hook; the baseline that C1 and C10 time always runs the stock `Ops` under the spec's baseline mode.

  C0 inventory       operators recorded in one generate, dtypes, quantisation, layout, spec and hash
  C1 baseline        the baseline engine's tokens/s on a fixed workload (the denominator)
  C2 determinism     the same forward twice, every op output bitwise; the same generate twice
  C3 batch           a request alone vs inside batches of random sizes at random places (engine)
  C4 phase           whole prefill vs chunked prefill vs decode, every op output; engine chunking
  C5 trainer=engine  engine generate -> Actor.logprobs -> rollout_diff exactly 0 (C6 locates a failure)
  C6 layer by layer  trainer vs engine replay, every op of every layer, first divergence
  C7 gradients       d(sum of completion log-probs)/d(every parameter) vs the float64 reference
  C8 RL updates      two rollout -> update -> in-place sync steps, diff exactly 0 before each update
  C9 checkpoint      save, restore: first step diff 0 and exact resume; HF export -> fresh engine
  C10 overhead       consistent / baseline engine tokens/s on C1's workload

A gate passes on exact equality where the contract is bitwise (C2..C6, C8, C9), within a stated
relative-error bound where it compares against float64 (C7), and records numbers for C1 and C10
(C10 gates on --min-ratio when given).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from onepath.consistency.bisect import BisectReport, Side, bisect, compare_site, load_class, load_spec
from onepath.consistency.diff import is_exact, rollout_diff
from onepath.consistency.recorder import Layout, Recorder, RecordingOps, check_same_sites, trace
from onepath.consistency.reference import ReferenceDecoder
from onepath.engine.llm_engine import LLMEngine, RequestOutput
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.checkpoint import load_config, load_state_dict, load_tokenizer, save_checkpoint
from onepath.models.config import ModelConfig
from onepath.models.dense import DenseDecoder
from onepath.numerics.spec import ExecutionSpec, OPS, check_same_spec
from onepath.ops import Ops
from onepath.train import checkpoint
from onepath.train.actor import Actor, Responses
from onepath.train.grpo import policy_loss

TITLES = {"C0": "inventory", "C1": "baseline throughput", "C2": "kernel determinism", "C3": "batch invariance",
          "C4": "phase consistency", "C5": "trainer equals engine", "C6": "layer-by-layer trainer vs engine",
          "C7": "gradients vs float64 reference", "C8": "two RL updates", "C9": "checkpoint and HF export",
          "C10": "consistent / baseline throughput"}
# C7: ||g - g_ref|| / ||g_ref|| per parameter group, by the storage dtype of the spec under test
GRAD_BOUNDS = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
# Ops methods and the ExecutionSpec entry that states their numerics
OP_SPEC = {"token_logprobs": "logprobs", "probs": "logprobs", "sampling_mask": "topk", "sample": "sampling"}
TINY = dict(vocab_size=53, hidden_size=48, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, model_type="qwen3", max_position_embeddings=256, eos_token_id=2)
SAMPLING = [{}, {"temperature": 0.7, "top_k": 9}, {"temperature": 1.3, "top_p": 0.8}]


@dataclass(slots=True)
class GateResult:
    name: str
    passed: bool
    evidence: dict
    detail: str
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"gate": self.name, "title": TITLES.get(self.name, ""), **asdict(self)}


@dataclass(slots=True)
class Workload:
    """C1 and C10's fixed workload: `requests` prompts of random lengths, `max_tokens` each (EOS ignored)."""
    requests: int = 8
    prompt_len: tuple[int, int] = (8, 32)
    max_tokens: int = 16
    repeats: int = 2


@dataclass
class GateContext:
    config: ModelConfig
    state: dict                                  # canonical weights (DenseDecoder.hf_state_dict), on the CPU
    spec: ExecutionSpec                          # the spec under test (consistent mode for a real check)
    ops_factory: Callable = Ops                  # spec -> ops for every model under test
    tokenizer: object = None
    label: str = ""
    seed: int = 0
    max_model_len: int = 256
    block_size: int = 16
    lr: float = 1e-2
    workload: Workload = field(default_factory=Workload)
    repro_dir: Path | None = None                # where C3..C6 write bisect's repro of a divergence
    min_throughput_ratio: float = 0.0
    throughput: dict = field(default_factory=dict)  # mode -> C1/C10 measurement, measured once

    @classmethod
    def load(cls, model, device: str = "cpu", spec: ExecutionSpec | str | None = None, **options) -> "GateContext":
        """model: 'tiny' (built-in random model), a Hugging Face checkpoint directory, or a ModelConfig
        (random weights)."""
        if isinstance(spec, str) or spec is None:
            spec = load_spec(spec or "consistent", device)
        if spec.device != device:
            raise ValueError(f"the spec is for device {spec.device!r}, the check runs on {device!r}: "
                             "give a spec for the same device")
        tokenizer, seed = None, options.get("seed", 0)
        if isinstance(model, ModelConfig) or model == "tiny":
            config, label = (ModelConfig(**TINY), "tiny") if model == "tiny" else (model, model.model_type)
            built = DenseDecoder(config, Ops(ExecutionSpec("baseline", "cpu")), max_positions=2)
            built.init_weights(seed, std=0.15)  # large enough that distributions are far from uniform
            state = built.state_dict()
        else:
            path = Path(model)
            config, state, label = load_config(path), load_state_dict(path), str(path)
            if (path / "tokenizer.json").is_file():
                tokenizer = load_tokenizer(path)
        built = DenseDecoder(config, Ops(ExecutionSpec("baseline", "cpu", spec.ops)), max_positions=2)
        built.load_hf_state_dict(state)
        return cls(config, built.hf_state_dict(), spec, tokenizer=tokenizer, label=label, **options)

    @property
    def device(self) -> str:
        return self.spec.device

    def model(self, state: dict | None = None, spec: ExecutionSpec | None = None,
              ops_factory: Callable | None = None) -> DenseDecoder:
        spec = spec or self.spec
        model = DenseDecoder(self.config, (ops_factory or self.ops_factory)(spec), max_positions=self.max_model_len)
        model.load_hf_state_dict(self.state if state is None else state)
        return model

    def baseline_model(self) -> DenseDecoder:
        return self.model(spec=self.spec.with_mode("baseline"), ops_factory=Ops)

    def engine(self, model: DenseDecoder, prompts, max_tokens: int, prefix_caching: bool = True,
               **scheduler) -> LLMEngine:
        blocks = sum(-(-(len(p) + max_tokens) // self.block_size) for p in prompts) + 4
        return LLMEngine(model, num_blocks=blocks, block_size=self.block_size,
                         scheduler=SchedulerConfig(max_model_len=self.max_model_len, **scheduler),
                         enable_prefix_caching=prefix_caching)

    def rng(self, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 7919 + salt)

    def prompts(self, gen: torch.Generator, count: int, low: int, high: int) -> list[list[int]]:
        high = max(low, min(high, self.max_model_len // 2))
        lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
        return [torch.randint(0, self.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def sampling_params(count: int, max_tokens: int, seed: int, ignore_eos: bool = False) -> list[SamplingParams]:
    """Plain, top-k and top-p sampling in turn, each request its own seed."""
    return [SamplingParams(max_tokens=max_tokens, seed=seed + i, ignore_eos=ignore_eos, **SAMPLING[i % len(SAMPLING)])
            for i in range(count)]


def rollout(engine: LLMEngine, prompts, params, ids) -> tuple[Responses, list[RequestOutput]]:
    outs = engine.generate(prompts, params, request_ids=ids)
    failed = [o for o in outs if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first {failed[0].request_id}: {failed[0].error}")
    r = Responses.build([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], list(params),
                        [o.logprobs for o in outs])
    return r, outs


def diff_evidence(r: Responses, train_logprobs: torch.Tensor) -> dict:
    """rollout_diff's metrics, and the first (request, token) whose log-probs differ."""
    lp = train_logprobs.detach().float().cpu()
    metrics = rollout_diff(r.rollout_logprobs, lp, r.mask)
    out = {"exact": is_exact(metrics), **{k.split("/")[-1]: v for k, v in metrics.items()}}
    bad = ((lp != r.rollout_logprobs) & r.mask).nonzero()
    if len(bad):
        i, t = bad[0].tolist()
        out["first_differing"] = {"request": i, "token": t, "engine": float(r.rollout_logprobs[i, t]),
                                  "trainer": float(lp[i, t])}
    return out


def recompute(actor: Actor, r: Responses) -> tuple[torch.Tensor | None, dict]:
    """The trainer's log-probs of a rollout and their diff evidence. A sampled token outside the
    trainer's top-k/top-p set means its logits differ from the engine's: a divergence, not a crash."""
    try:
        lp, _ = actor.logprobs(r)
    except ValueError as e:
        if "top-k/top-p" not in str(e):
            raise
        return None, {"exact": False, "tokens_differing_frac": float("nan"), "valid_tokens": int(r.mask.sum()),
                      "error": f"{e} (here: the trainer's logits differ from the engine's)"}
    return lp, diff_evidence(r, lp)


def first_difference(a: RequestOutput, b: RequestOutput) -> dict | None:
    """The first generated token whose id or log-prob bits differ between two outputs of one request."""
    for i, (ta, tb, la, lb) in enumerate(zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs)):
        if ta != tb or la != lb:
            return {"token": i, "tokens": [ta, tb], "logprob_abs_diff": abs(la - lb)}
    if len(a.token_ids) != len(b.token_ids):
        return {"token": min(len(a.token_ids), len(b.token_ids)), "lengths": [len(a.token_ids), len(b.token_ids)]}
    return None


def compare_traces(model_a, model_b, sequences, layout_a: Layout, layout_b: Layout, block_size: int) -> dict:
    """Every op output of every sequence's tokens under two layouts; the first differing site in call order."""
    ta = trace(model_a, sequences, layout_a, block_size)
    tb = trace(model_b, sequences, layout_b, block_size)
    check_same_sites(ta, tb)
    elements, differing, first = 0, 0, None
    for k, site in enumerate(ta.sites):
        for s in range(len(sequences)):
            d = compare_site(k, site, ta.rows[k][s], tb.rows[k][s])
            elements += d.elements
            if d.differing:
                differing += 1
                first = first or {"sequence": s, **site_summary(d)}
    return {"layout": layout_b.describe(), "sites": len(ta.sites), "elements": elements,
            "differing_site_rows": differing, "first": first}


def site_summary(d) -> dict:
    return {"op": d.op, "module": d.module, "layer": d.layer, "site": d.site, "position": d.first_position,
            "differing": d.differing, "elements": d.elements, "max_abs": d.max_abs, "max_ulp": d.max_ulp}


def locate(ctx: GateContext, a: Side, b: Side, probe: list[int], gate: str) -> tuple[BisectReport, dict]:
    """bisect's first diverging operator (and its repro under ctx.repro_dir/<gate>)."""
    out = None if ctx.repro_dir is None else Path(ctx.repro_dir) / gate
    report = bisect(a, b, probe, out, ctx.block_size)
    if report.first is None:
        return report, {"found": False, "a": report.a, "b": report.b,
                        "note": "no op differs when this case is replayed teacher-forced with one prefill length for "
                                "every sequence; the engine's own schedule mixed phases: see C4, or run `onepath "
                                "bisect` with other --layout-a/--layout-b"}
    return report, {"found": True, "a": report.a, "b": report.b, **site_summary(report.first),
                    "repro": report.repro, "reproduces": report.reproduces}


# ---- C0 .. C10 ----

def gate_c0(ctx: GateContext) -> GateResult:
    model = ctx.model()
    prompt = ctx.prompts(ctx.rng(0), 1, 8, 8)
    engine = ctx.engine(model, prompt, 3)
    recorder, sampler_ops = Recorder(), engine.runner.ops
    with recorder.installed(model):
        engine.runner.ops = RecordingOps(sampler_ops, recorder, "sampler")
        try:
            rollout(engine, prompt, [SamplingParams(max_tokens=3, ignore_eos=True)], [0])
        finally:
            engine.runner.ops = sampler_ops
    calls = Counter(c.op for c in recorder.calls)
    out_dtypes = {c.op: str(c.outputs[0].dtype).removeprefix("torch.") for c in recorder.calls if c.outputs}
    no_spec = sorted(op for op in calls if OP_SPEC.get(op, op) not in OPS)
    wrong_dtype = sorted(n for n, p in model.named_parameters() if p.dtype != ctx.spec.dtype)
    round_trip = ExecutionSpec.from_json(ctx.spec.to_json()).hash() == ctx.spec.hash()
    c = ctx.config
    evidence = {
        "model": {"source": ctx.label, "model_type": c.model_type, "layers": c.num_hidden_layers,
                  "hidden": c.hidden_size, "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
                  "head_dim": c.head_dim, "vocab": c.vocab_size, "tied_embeddings": c.tie_word_embeddings,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "backend": f"{type(model.ops).__module__}:{type(model.ops).__qualname__}",
        "ops": dict(calls), "workload": f"one request, {len(prompt[0])} prompt tokens, 3 generated, "
                                        f"{engine.stats.steps} passes",
        "parameter_dtypes": dict(Counter(str(p.dtype).removeprefix("torch.") for p in model.parameters())),
        "output_dtypes": out_dtypes,
        "op_dtypes": {op: f"{s.dtype}/{s.accum_dtype} accum" for op, s in ctx.spec.ops.items()},
        "quantisation": "none: the ExecutionSpec defines no quantiser",
        "parallel": {"tensor_parallel": 1, "data_parallel": 1, "device": ctx.device},
        "spec_hash": ctx.spec.hash(), "spec": ctx.spec.to_dict(),
    }
    problems = [f"ops without an ExecutionSpec entry: {no_spec}"] * bool(no_spec)
    problems += [f"parameters not in the spec's {ctx.spec.dtype}: {wrong_dtype[:3]}"] * bool(wrong_dtype)
    problems += ["the spec does not survive a JSON round trip with its hash"] * (not round_trip)
    detail = (f"{len(calls)} ops, {sum(calls.values())} calls; {ctx.spec.mode} {ctx.device} spec {ctx.spec.hash()}; "
              "no quantisation; single device") if not problems else "; ".join(problems)
    return GateResult("C0", not problems, evidence, detail)


def measure_throughput(ctx: GateContext, mode: str) -> dict:
    """tokens/s of the engine in `mode` on the fixed workload (best of `repeats` runs after a warm-up)."""
    if mode in ctx.throughput:
        return ctx.throughput[mode]
    w = ctx.workload
    model = ctx.baseline_model() if mode == "baseline" else ctx.model()
    prompts = ctx.prompts(ctx.rng(10), w.requests, *w.prompt_len)
    params = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True, seed=ctx.seed)
    engine = ctx.engine(model, prompts, w.max_tokens, prefix_caching=False)
    rollout(engine, prompts[:1], [SamplingParams(max_tokens=2, ignore_eos=True)], [-1])
    runs = []
    for k in range(w.repeats):
        tokens, seconds = engine.stats.generated_tokens, engine.stats.seconds
        rollout(engine, prompts, [params] * len(prompts), [k * len(prompts) + i for i in range(len(prompts))])
        runs.append((engine.stats.generated_tokens - tokens, engine.stats.seconds - seconds))
    tokens, seconds = min(runs, key=lambda r: r[1])
    ctx.throughput[mode] = {
        "mode": mode, "tokens_per_s": tokens / max(seconds, 1e-9), "tokens": tokens, "seconds": seconds,
        "runs_s": [s for _, s in runs], "backend": type(model.ops).__qualname__, "spec_hash": model.ops.spec.hash(),
        "workload": {"requests": w.requests, "prompt_len": list(w.prompt_len), "max_tokens": w.max_tokens,
                     "ignore_eos": True, "prefix_caching": False, "repeats": w.repeats}}
    return ctx.throughput[mode]


def gate_c1(ctx: GateContext) -> GateResult:
    m = measure_throughput(ctx, "baseline")
    expected = ctx.workload.requests * ctx.workload.max_tokens
    ok = m["tokens"] == expected and m["tokens_per_s"] > 0
    return GateResult("C1", ok, m, f"baseline engine {m['tokens_per_s']:.1f} tokens/s ({m['tokens']} tokens "
                                   f"in {m['seconds']:.3f} s, best of {len(m['runs_s'])})"
                      + ("" if ok else f"; expected {expected} tokens"))


def gate_c2(ctx: GateContext) -> GateResult:
    model = ctx.model()
    gen = ctx.rng(2)
    seqs = ctx.prompts(gen, 4, 8, 40)
    runs = [compare_traces(model, model, seqs, layout, layout, ctx.block_size)
            for layout in (Layout(), Layout(prefill=6, chunk=4, head="last"))]
    prompts = ctx.prompts(gen, 6, 1, 24)
    params, ids = sampling_params(len(prompts), 12, ctx.seed), list(range(len(prompts)))
    a = rollout(ctx.engine(ctx.model(), prompts, 12), prompts, params, ids)[1]
    b = rollout(ctx.engine(ctx.model(), prompts, 12), prompts, params, ids)[1]
    engine_diffs = [d for d in (first_difference(x, y) for x, y in zip(a, b)) if d]
    bad = [r for r in runs if r["first"]]
    ok = not bad and not engine_diffs
    evidence = {"forward_twice": runs, "generate_twice": {"requests": len(prompts), "differing": len(engine_diffs),
                                                          "first": engine_diffs[0] if engine_diffs else None}}
    if ok:
        detail = (f"{sum(r['elements'] for r in runs)} op output elements over {len(seqs)} sequences and "
                  f"{len(prompts)} generated requests: all bitwise equal run to run")
    elif bad:
        f = bad[0]["first"]
        detail = f"run to run, {f['op']} at {f['module'] or 'the model'} differs first ({bad[0]['layout']})"
    else:
        detail = f"the same generate twice differs on {len(engine_diffs)} of {len(prompts)} requests"
    return GateResult("C2", ok, evidence, detail)


def gate_c3(ctx: GateContext) -> GateResult:
    model = ctx.model()
    gen = ctx.rng(3)
    trials, located = [], None
    for trial, (low, high) in enumerate(((2, 4), (5, 8), (9, 15), (16, 24))):
        probe = ctx.prompts(gen, 1, 1, 24)[0]
        others = ctx.prompts(gen, int(torch.randint(low, high + 1, (1,), generator=gen)) - 1, 1, 40)
        at = int(torch.randint(0, len(others) + 1, (1,), generator=gen))
        budget = int(torch.randint(32, 257, (1,), generator=gen))
        params = sampling_params(len(others) + 1, 12, ctx.seed + 100 * trial)
        prompts = others[:at] + [probe] + others[at:]
        ids = [1000 * trial + i for i in range(len(prompts))]
        alone = rollout(ctx.engine(model, [probe], 12), [probe], [params[at]], [ids[at]])[1][0]
        batch = rollout(ctx.engine(model, prompts, 12, max_num_batched_tokens=budget), prompts, params, ids)[1]
        diff = first_difference(alone, batch[at])
        trials.append({"batch": len(prompts), "at": at, "max_num_batched_tokens": budget,
                       "prompt_len": len(probe), "sampling": SAMPLING[at % len(SAMPLING)], "equal": diff is None,
                       "first_difference": diff})
        if diff and located is None:
            layout = Layout(prefill=len(probe), head="last")
            located = locate(ctx, Side(model, layout), Side(model, layout, [o.prompt_token_ids + o.token_ids for o in
                                                                            batch[:at] + batch[at + 1:]], at),
                             alone.prompt_token_ids + alone.token_ids, "C3")[1]
    bad = [t for t in trials if not t["equal"]]
    evidence = {"trials": trials}
    if bad:
        evidence["first_divergence"] = located
        t = bad[0]
        where = f"; first op: {located['op']} at {located['module']}" if located.get("found") else ""
        detail = (f"{len(bad)} of {len(trials)} trials differ: first in a batch of {t['batch']} at place {t['at']}, "
                  f"token {t['first_difference']['token']}{where}")
    else:
        detail = (f"a request alone equals itself in {len(trials)} batches of "
                  f"{', '.join(str(t['batch']) for t in trials)} at random places: tokens and log-probs bitwise")
    return GateResult("C3", not bad, evidence, detail)


def gate_c4(ctx: GateContext) -> GateResult:
    model = ctx.model()
    gen = ctx.rng(4)
    seqs = ctx.prompts(gen, 3, 17, 40)
    layouts = (Layout(chunk=7), Layout(chunk=16), Layout(prefill=12), Layout(prefill=1))
    replays = [compare_traces(model, model, seqs, Layout(), layout, ctx.block_size) for layout in layouts]
    prompts = ctx.prompts(gen, 4, 17, 40)
    params, ids = sampling_params(len(prompts), 8, ctx.seed), list(range(len(prompts)))
    runs = {c: rollout(ctx.engine(model, prompts, 8, prefill_chunk_size=c), prompts, params, ids)[1]
            for c in (None, 7, 1)}
    engine = []
    for c in (7, 1):
        diffs = [d for d in (first_difference(x, y) for x, y in zip(runs[None], runs[c])) if d]
        engine.append({"prefill_chunk_size": c, "differing_requests": len(diffs), "first": diffs[0] if diffs else None})
    graph = ("N/A on CPU: no CUDA graphs" if ctx.device == "cpu"
             else "N/A: the engine runs eager only (no CUDA graph capture)")
    evidence = {"reference": Layout().describe(), "replays": replays, "engine_vs_whole_prefill": engine,
                "graph_vs_eager": graph}
    bad = [r for r in replays if r["first"]]
    bad_engine = [e for e in engine if e["differing_requests"]]
    if bad:
        f = bad[0]["first"]
        detail = (f"{bad[0]['layout']} differs from whole prefill: first {f['op']} at {f['module'] or 'the model'} "
                  f"(layer {f['layer']}), position {f['position']}")
    elif bad_engine:
        detail = f"engine with prefill_chunk_size {bad_engine[0]['prefill_chunk_size']} differs from whole prefill"
    else:
        detail = (f"every op output of {len(seqs)} sequences equals whole prefill's under "
                  f"{'; '.join(r['layout'] for r in replays)}; the engine with prefill chunks of 7 and 1 equals "
                  f"whole prefill; graph vs eager {graph.split(':')[0]}")
    return GateResult("C4", not bad and not bad_engine, evidence, detail)


def engine_trainer_layers(ctx: GateContext, model, outs: list[RequestOutput], index: int) -> tuple[BisectReport, dict]:
    """Replay one generated request as the trainer's forward (whole sequences, the batch together) and
    as the engine's (prefill then decode, logits on sampling rows), op by op and layer by layer."""
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    probe, others = seqs[index], seqs[:index] + seqs[index + 1:]
    engine_layout = Layout(prefill=len(outs[index].prompt_token_ids), head="last")
    report, first = locate(ctx, Side(model, Layout(), others, index, "trainer"),
                           Side(model, engine_layout, others, index, "engine"), probe, "C6")
    layers = {}
    for s in report.sites:
        key = "-" if s.layer is None else str(s.layer)
        row = layers.setdefault(key, {"sites": 0, "differing_sites": 0, "max_abs": 0.0, "first": None})
        row["sites"] += 1
        if s.differing:
            row["differing_sites"] += 1
            row["max_abs"] = max(row["max_abs"], s.max_abs)
            row["first"] = row["first"] or s.name
    return report, {"first_divergence": first, "layers": layers}


def gate_c5(ctx: GateContext) -> GateResult:
    engine_model, policy = ctx.model(), ctx.model()
    check_same_spec(engine_model.ops.spec, policy.ops.spec)
    prompts = ctx.prompts(ctx.rng(5), 8, 1, 32)
    params = sampling_params(len(prompts), 16, ctx.seed)
    r, outs = rollout(ctx.engine(engine_model, prompts, 16), prompts, params, list(range(len(prompts))))
    _, evidence = recompute(Actor(policy, ctx.block_size, lr=ctx.lr), r)
    if evidence["exact"]:
        return GateResult("C5", True, evidence, f"{evidence['valid_tokens']} tokens of {len(prompts)} requests: "
                                                "trainer log-probs equal the engine's bitwise (every diff metric 0)")
    first = evidence.get("first_differing", {"request": 0})
    evidence["C6"] = engine_trainer_layers(ctx, policy, outs, first["request"])[1]
    where = evidence["C6"]["first_divergence"]
    located = f"; first op: {where['op']} at {where['module']} (layer {where['layer']})" if where["found"] else ""
    if "error" in evidence:
        return GateResult("C5", False, evidence, f"{evidence['error']}{located}")
    return GateResult("C5", False, evidence, f"tokens differing {evidence['tokens_differing_frac']:.3g}, "
                                             f"max |d logp| {evidence['logprob_abs_diff_max']:.3g}, first at request "
                                             f"{first['request']} token {first['token']}{located}")


def gate_c6(ctx: GateContext) -> GateResult:
    model = ctx.model()
    prompts = ctx.prompts(ctx.rng(6), 4, 4, 24)
    outs = rollout(ctx.engine(model, prompts, 12), prompts, sampling_params(4, 12, ctx.seed), list(range(4)))[1]
    report, evidence = engine_trainer_layers(ctx, model, outs, 1)
    if report.first is None:
        return GateResult("C6", True, evidence, f"{len(report.sites)} op sites over {len(evidence['layers'])} "
                                                "layer groups: trainer and engine equal at every one")
    f = report.first
    return GateResult("C6", False, evidence, f"first divergence: {f.name} (layer {f.layer}, site {f.site}), "
                                             f"position {f.first_position}, max |d| {f.max_abs:.3g}, {f.max_ulp} ULP")


def param_group(name: str) -> str:
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    if name.endswith("norm.weight"):
        return "norms"
    for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if f"self_attn.{part}." in name:
            return f"attention.{part}"
    for part in ("gate_proj", "up_proj", "down_proj"):
        if f"mlp.{part}." in name:
            return f"mlp.{part}"
    return "other"


def gate_c7(ctx: GateContext) -> GateResult:
    gen = ctx.rng(7)
    prompts = ctx.prompts(gen, 3, 4, 16)
    completions = ctx.prompts(gen, 3, 4, 12)
    params = [SamplingParams(temperature=t) for t in (1.0, 0.7, 1.3)]
    policy = ctx.model()
    r = Responses.build(prompts, completions, params, [[0.0] * len(c) for c in completions])
    lp, _ = Actor(policy, ctx.block_size, lr=ctx.lr).logprobs(r)
    lp[r.mask.to(lp.device)].sum().backward()
    reference = ReferenceDecoder(ctx.config, ctx.state)
    lp_ref = torch.cat([reference.completion_logprobs(p, c, s.temperature)
                        for p, c, s in zip(prompts, completions, params)])
    lp_ref.sum().backward()
    ref = reference.grads()
    sums: dict[str, list] = {}
    for name, p in policy.named_parameters():
        g = torch.zeros_like(ref[name]) if p.grad is None else p.grad.detach().cpu().double()
        err, norm = float((g - ref[name]).norm()), float(ref[name].norm())
        acc = sums.setdefault(param_group(name), [0.0, 0.0, 0, None, -1.0])
        acc[0], acc[1], acc[2] = acc[0] + err ** 2, acc[1] + norm ** 2, acc[2] + 1
        rel = err / norm if norm else (0.0 if err == 0 else float("inf"))
        if rel > acc[4]:
            acc[3], acc[4] = name, rel
    bound = GRAD_BOUNDS[str(ctx.spec.dtype).removeprefix("torch.")]
    groups = {g: {"rel_err": (e / n) ** 0.5 if n else (0.0 if e == 0 else float("inf")), "params": k,
                  "worst_param": w, "worst_rel_err": wr} for g, (e, n, k, w, wr) in sums.items()}
    lp_valid = lp.detach()[r.mask.to(lp.device)].cpu().double()
    forward = float((lp_valid - lp_ref.detach()).norm() / lp_ref.detach().norm())
    failing = sorted(g for g, v in groups.items() if not v["rel_err"] <= bound)
    ok = not failing and forward <= bound
    evidence = {"bound": bound, "dtype": str(ctx.spec.dtype).removeprefix("torch."),
                "objective": "sum of completion log-probs", "sequences": len(prompts), "tokens": int(r.mask.sum()),
                "forward_logprob_rel_err": forward, "groups": groups}
    worst = max(groups.items(), key=lambda kv: kv[1]["rel_err"])
    if ok:
        detail = (f"{len(groups)} parameter groups within {bound:g} of the float64 reference "
                  f"(worst {worst[0]} {worst[1]['rel_err']:.2g}; forward {forward:.2g})")
    elif failing:
        detail = (f"{len(failing)} of {len(groups)} groups exceed {bound:g}: "
                  + ", ".join(f"{g} {groups[g]['rel_err']:.3g}" for g in failing[:4]))
    else:
        detail = f"forward log-probs {forward:.3g} from the float64 reference (bound {bound:g})"
    return GateResult("C7", ok, evidence, detail)


def train_step(actor: Actor, engine: LLMEngine | None, r: Responses, gen, lp: torch.Tensor | None = None) -> None:
    """One GRPO update on random advantages (from lp, the update's own forward, when given), then the
    in-place weight sync into the engine when given."""
    if lp is None:
        lp, _ = actor.logprobs(r)
    advantages = torch.randn(len(r.completion_ids), generator=gen).to(lp.device)
    loss, _ = policy_loss(lp, lp.detach(), advantages, r.mask.to(lp.device), 0.2)
    actor.update(loss)
    if engine is not None:
        engine.update_weights(actor.model.named_parameters())


def stale_parameters(engine_model, policy) -> list[str]:
    theirs = dict(policy.named_parameters())
    return [n for n, p in engine_model.named_parameters() if not torch.equal(p, theirs[n])]


def gate_c8(ctx: GateContext) -> GateResult:
    engine_model, policy = ctx.model(), ctx.model()
    gen = ctx.rng(8)
    prompts = [ctx.prompts(gen, 6, 1, 24) for _ in range(2)]
    engine = ctx.engine(engine_model, prompts[0] + prompts[1], 12)
    actor = Actor(policy, ctx.block_size, lr=ctx.lr)
    pointers = {n: p.data_ptr() for n, p in engine_model.named_parameters()}
    steps = []
    for step, batch in enumerate(prompts, 1):
        r, _ = rollout(engine, batch, sampling_params(len(batch), 12, ctx.seed + step), [100 * step + i for i in
                                                                                         range(len(batch))])
        lp, diff = recompute(actor, r)
        steps.append({"step": step, **diff})
        if lp is None:
            break
        train_step(actor, engine, r, gen, lp)
        steps[-1]["stale_after_sync"] = stale_parameters(engine_model, policy)
    moved = [n for n, p in engine_model.named_parameters() if p.data_ptr() != pointers[n]]
    problems = []
    for s in steps:
        if not s["exact"]:
            problems.append(f"step {s['step']} before its update: "
                            + (s.get("error") or f"tokens differing {s['tokens_differing_frac']:.3g}"))
        if s.get("stale_after_sync"):
            problems.append(f"after step {s['step']}'s sync the engine differs from the trainer on "
                            f"{s['stale_after_sync'][:3]}")
    if moved:
        problems.append(f"the sync replaced parameter storage instead of copying in place: {moved[:3]}")
    evidence = {"steps": steps, "sync_in_place": not moved, "moved": moved[:5]}
    tokens = ", ".join(str(s["valid_tokens"]) for s in steps)
    detail = "; ".join(problems) or (f"2 updates: diff 0 before each ({tokens} tokens), engine weights equal the "
                                     "trainer's after each in-place sync")
    return GateResult("C8", not problems, evidence, detail)


def gate_c9(ctx: GateContext) -> GateResult:
    engine_model, policy = ctx.model(), ctx.model()
    gen = ctx.rng(9)
    prompts = [ctx.prompts(gen, 6, 1, 24) for _ in range(2)]
    params = [sampling_params(6, 12, ctx.seed + k) for k in (1, 2)]
    engine = ctx.engine(engine_model, prompts[0] + prompts[1], 12)
    actor = Actor(policy, ctx.block_size, lr=ctx.lr)
    train_step(actor, engine, rollout(engine, prompts[0], params[0], list(range(6)))[0], gen)
    with tempfile.TemporaryDirectory(prefix="onepath-check-") as tmp:
        setup = SimpleNamespace(model_config=ctx.config, tokenizer=ctx.tokenizer, tokenizer_config=None)
        state = {"step": 1, "spec_hash": ctx.spec.hash(), "spec": ctx.spec.to_dict()}
        tensors = {"optimizer": actor.optimizer.state_dict(), "schedule": actor.schedule.state_dict()}
        path = checkpoint.save(Path(tmp), 1, policy.hf_state_dict(), setup, state, tensors, keep_last=1)
        saved_state, saved_tensors = checkpoint.load(path)
        restored = ctx.model(state=load_state_dict(path))
        resumed = Actor(restored, ctx.block_size, lr=ctx.lr)
        resumed.optimizer.load_state_dict(saved_tensors["optimizer"])
        resumed.schedule.load_state_dict(saved_tensors["schedule"])
        exported = Path(tmp) / "hf"
        save_checkpoint(exported, policy.hf_state_dict(), ctx.config, ctx.tokenizer)
        fresh = ctx.model(state=load_state_dict(exported))
    restored_differs = stale_parameters(restored, policy)
    ids = [100 + i for i in range(6)]
    r, outs = rollout(engine, prompts[1], params[1], ids)
    restore = recompute(resumed, r)[1]
    r_fresh, outs_fresh = rollout(ctx.engine(fresh, prompts[1], 12), prompts[1], params[1], ids)
    export = recompute(resumed, r_fresh)[1]
    export["equals_running_engine"] = all(first_difference(a, b) is None for a, b in zip(outs, outs_fresh))
    # exact resume: the restored and the uninterrupted trainer take the same next update, bit for bit
    # (plain sampling: a top-k set that misses a token must not stop this check when the engine is stale)
    seed = int(torch.randint(0, 2 ** 31, (1,), generator=gen))
    plain = Responses.build(r.prompt_ids, r.completion_ids, [SamplingParams()] * len(r.prompt_ids),
                            [[0.0] * len(c) for c in r.completion_ids])
    for a in (actor, resumed):
        train_step(a, None, plain, torch.Generator().manual_seed(seed))
    update_differs = stale_parameters(restored, policy)
    evidence = {"saved": "trainer checkpoint step_1 (HF layout + optimizer and LR-schedule state); HF export",
                "spec_hash_saved": saved_state["spec_hash"], "restored_weights_differ": restored_differs[:5],
                "first_step_after_restore": restore, "hf_export_fresh_engine": export,
                "next_update_differs": update_differs[:5]}
    problems = []
    if restored_differs:
        problems.append(f"restored weights differ from the saved trainer's: {restored_differs[:3]}")
    if not restore["exact"]:
        problems.append("first step after restore (the running engine against the restored trainer): "
                        + (restore.get("error") or f"tokens differing {restore['tokens_differing_frac']:.3g}"))
    if not export["equals_running_engine"]:
        problems.append("the HF export in a fresh engine samples other tokens or log-probs than the running engine")
    if not export["exact"]:
        problems.append("the HF export in a fresh engine against the restored trainer: "
                        + (export.get("error") or f"tokens differing {export['tokens_differing_frac']:.3g}"))
    if update_differs:
        problems.append(f"the next update after restore differs from the uninterrupted run's on {update_differs[:3]}")
    if saved_state["spec_hash"] != ctx.spec.hash():
        problems.append(f"the checkpoint's spec hash {saved_state['spec_hash']} is not the run's {ctx.spec.hash()}")
    detail = "; ".join(problems) or (f"restore: first step diff 0 over {restore['valid_tokens']} tokens, next update "
                                     "bitwise equal to the uninterrupted run's; HF export in a fresh engine samples "
                                     "the same tokens and log-probs, diff 0")
    return GateResult("C9", not problems, evidence, detail)


def gate_c10(ctx: GateContext) -> GateResult:
    base, cons = measure_throughput(ctx, "baseline"), measure_throughput(ctx, "consistent")
    ratio = cons["tokens_per_s"] / base["tokens_per_s"]
    ok = ratio >= ctx.min_throughput_ratio and cons["tokens"] == base["tokens"]
    bound = (f">= {ctx.min_throughput_ratio:g}" if ctx.min_throughput_ratio else "recorded, not gated (--min-ratio)")
    evidence = {"ratio": ratio, "bound": bound, "consistent": cons, "baseline": base}
    return GateResult("C10", ok, evidence, f"consistent {cons['tokens_per_s']:.1f} / baseline "
                                           f"{base['tokens_per_s']:.1f} tokens/s = {ratio:.3f} ({bound})")


GATES = {"C0": gate_c0, "C1": gate_c1, "C2": gate_c2, "C3": gate_c3, "C4": gate_c4, "C5": gate_c5, "C6": gate_c6,
         "C7": gate_c7, "C8": gate_c8, "C9": gate_c9, "C10": gate_c10}


def parse_gates(text: str | None) -> tuple[str, ...]:
    if not text:
        return tuple(GATES)
    names = [t.strip().upper() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in GATES]
    if unknown:
        raise ValueError(f"unknown gate {unknown[0]}: choose from {', '.join(GATES)}, e.g. --gates C2,C3")
    return tuple(n for n in GATES if n in names)  # always in gate order


def run_gate(ctx: GateContext, name: str) -> GateResult:
    start = time.perf_counter()
    try:
        result = GATES[name](ctx)
    except Exception as e:  # a gate that crashes fails with the error as its evidence; the others still run
        result = GateResult(name, False, {"error": f"{type(e).__name__}: {e}",
                                          "traceback": traceback.format_exc(limit=-4).splitlines()},
                            f"error: {type(e).__name__}: {e}")
    result.seconds = time.perf_counter() - start
    return result


def run_gates(model, gates=tuple(GATES), device: str = "cpu", *, spec: ExecutionSpec | str | None = None,
              ops_factory: Callable | None = None, **options) -> list[GateResult]:
    """Run `gates` in order on `model` ('tiny', a checkpoint directory or a ModelConfig). `ops_factory`
    (spec -> ops, e.g. an Ops subclass) builds every model under test; options are GateContext fields."""
    names = parse_gates(",".join(gates) if not isinstance(gates, str) else gates)
    ctx = GateContext.load(model, device, spec, ops_factory=ops_factory or Ops, **options)
    return [run_gate(ctx, name) for name in names]


def format_result(r: GateResult, width: int = 150) -> str:
    lines = [f"{r.name:<4s} {TITLES[r.name]:<34s} {'PASS' if r.passed else 'FAIL'}  {r.seconds:6.2f} s  {r.detail}"]
    for key, value in r.evidence.items():
        text = json.dumps(value, default=str) if not isinstance(value, str) else value
        lines.append(f"       {key}: {text if len(text) <= width else text[:width - 3] + '...'}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`onepath check`: exit 0 when every gate run passes, 1 when one fails."""
    parser = argparse.ArgumentParser(prog="onepath check", description="run the consistency gates C0..C10 in order "
                                     "and print PASS/FAIL with evidence for each")
    parser.add_argument("model", help="a Hugging Face checkpoint directory (config.json, safetensors) or 'tiny' "
                                      "(a built-in random model for smoke runs)")
    parser.add_argument("--gates", default=None, help="comma-separated subset, e.g. C2,C3 (default: all, in order)")
    parser.add_argument("--json", default=None, help="also write every gate's result as JSON to this path (CI)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--spec", default="consistent", help="'consistent', 'baseline' (a negative control: gates "
                                                             "C2..C6 should fail) or a spec.json path")
    parser.add_argument("--ops", default=None, help="backend class 'module:Class' (an Ops subclass; default Ops)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--repro-dir", default=None, help="write bisect's standalone repro of a C3..C6 divergence "
                                                          "under this directory")
    parser.add_argument("--min-ratio", type=float, default=0.0, help="C10 fails below this consistent/baseline "
                                                                     "throughput ratio (default: record only)")
    args = parser.parse_args(argv)
    names = parse_gates(args.gates)
    ctx = GateContext.load(args.model, args.device, args.spec, ops_factory=load_class(args.ops), seed=args.seed,
                           max_model_len=args.max_model_len, min_throughput_ratio=args.min_ratio,
                           repro_dir=Path(args.repro_dir) if args.repro_dir else None)
    backend = getattr(ctx.ops_factory, "__qualname__", repr(ctx.ops_factory))
    print(f"onepath check {ctx.label}: {ctx.spec.mode} {ctx.device}, spec {ctx.spec.hash()}, backend {backend}")
    results = []
    for name in names:
        results.append(run_gate(ctx, name))
        print(format_result(results[-1]), flush=True)
    passed = sum(r.passed for r in results)
    print(f"{passed} of {len(results)} gates passed" + ("" if passed == len(results) else ": FAIL"))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": ctx.label, "device": ctx.device, "spec_hash": ctx.spec.hash(), "spec": ctx.spec.to_dict(),
            "backend": backend, "passed": passed == len(results),
            "gates": [r.to_dict() for r in results]}, indent=2, default=str))
    return 0 if passed == len(results) else 1
