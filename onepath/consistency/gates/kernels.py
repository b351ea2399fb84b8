"""C2..C4: the kernels' own contract: determinism run to run, batch invariance in the engine, and
phase consistency (whole prefill, chunked prefill, decode; CUDA-graph decode vs eager)."""
from __future__ import annotations

from dataclasses import replace

import torch

from onepath.consistency.bisect import Side
from onepath.consistency.gates.context import (SAMPLING, GateContext, GateResult, compare_traces, engine_has_graphs,
                                               first_difference, locate, rollout, sampling_params)
from onepath.consistency.recorder import Layout


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
    graph, graph_problem = graph_vs_eager(ctx, model, gen)
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
    elif graph_problem:
        detail = graph_problem
    else:
        graph_summary = (graph.split(":")[0] if isinstance(graph, str) else
                         f"equal over {graph['tokens']} tokens ({graph['cuda_graphs']['graph_steps']} graph steps)")
        detail = (f"every op output of {len(seqs)} sequences equals whole prefill's under "
                  f"{'; '.join(r['layout'] for r in replays)}; the engine with prefill chunks of 7 and 1 equals "
                  f"whole prefill; graph vs eager {graph_summary}")
    return GateResult("C4", not bad and not bad_engine and not graph_problem, evidence, detail)


def graph_vs_eager(ctx: GateContext, model, gen: torch.Generator) -> tuple[str | dict, str | None]:
    """The same requests through an engine that replays its decode steps from captured CUDA graphs and
    one that runs them eager: every token id and log-prob bitwise equal, and the first engine must
    really have replayed graphs. Returns the evidence (a string when N/A) and the problem, if any."""
    if ctx.device == "cpu":
        return "N/A on CPU: no CUDA graphs", None
    if not engine_has_graphs():
        return "N/A: engine has no CUDA graphs (LLMEngine takes no cuda_graphs)", None
    prompts = ctx.prompts(gen, 10, 1, 40)
    # max_tokens 2..20: requests finish one by one, so the decode batch walks down the padded graph sizes
    params = [replace(p, max_tokens=2 + 2 * i)
              for i, p in enumerate(sampling_params(len(prompts), 1, ctx.seed, ignore_eos=True))]
    ids = list(range(len(prompts)))
    outs, steps = {}, {}
    for graphs in (True, False):
        engine = ctx.engine(model, prompts, params[-1].max_tokens, graphs=graphs)
        outs[graphs] = rollout(engine, prompts, params, ids)[1]
        steps[graphs] = {k: getattr(engine.stats, k, None) for k in ("graph_steps", "eager_steps")}
    if steps[True]["graph_steps"] is None:
        return "N/A: engine has no CUDA graphs (its stats count no graph_steps)", None
    pairs = enumerate(zip(outs[True], outs[False]))
    diffs = [{"request": i, **d} for i, (a, b) in pairs if (d := first_difference(a, b))]
    evidence = {"requests": len(prompts), "prompt_lens": [len(p) for p in prompts],
                "max_tokens": [p.max_tokens for p in params], "tokens": sum(len(o.token_ids) for o in outs[True]),
                "cuda_graphs": steps[True], "eager": steps[False], "differing_requests": len(diffs),
                "first": diffs[0] if diffs else None}
    problem = None
    if not steps[True]["graph_steps"]:
        problem = (f"the engine with cuda_graphs=True replayed no CUDA graph ({steps[True]['eager_steps']} eager "
                   "steps): graph vs eager was not compared")
    elif steps[False]["graph_steps"]:
        problem = (f"the engine with cuda_graphs=False replayed {steps[False]['graph_steps']} CUDA graph steps: "
                   "no eager reference")
    elif diffs:
        problem = (f"graph vs eager: {len(diffs)} of {len(prompts)} requests differ, first request "
                   f"{diffs[0]['request']} at token {diffs[0]['token']}")
    return evidence, problem
