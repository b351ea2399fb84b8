"""C1 and C10: the baseline engine's tokens/s on a fixed workload, and the consistent engine's against it."""
from __future__ import annotations

from onepath.consistency.gates.context import GateContext, GateResult, rollout
from onepath.engine.sampling_params import SamplingParams


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


def gate_c10(ctx: GateContext) -> GateResult:
    base, cons = measure_throughput(ctx, "baseline"), measure_throughput(ctx, "consistent")
    ratio = cons["tokens_per_s"] / base["tokens_per_s"]
    ok = ratio >= ctx.min_throughput_ratio and cons["tokens"] == base["tokens"]
    bound = (f">= {ctx.min_throughput_ratio:g}" if ctx.min_throughput_ratio else "recorded, not gated (--min-ratio)")
    evidence = {"ratio": ratio, "bound": bound, "consistent": cons, "baseline": base}
    return GateResult("C10", ok, evidence, f"consistent {cons['tokens_per_s']:.1f} / baseline "
                                           f"{base['tokens_per_s']:.1f} tokens/s = {ratio:.3f} ({bound})")
