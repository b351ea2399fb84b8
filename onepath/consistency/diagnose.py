"""diagnose: frozen-policy analysis of two sides over the same teacher-forced token sequences.

Both sides run the same weights over the same sequences (two ExecutionSpecs or backends, or two
modes such as whole prefill vs prefill + decode); nothing is sampled or updated. Reported over every
token that both sides score (its log-prob of the next token of its sequence):
  |Δ log p| P50 / P99 (nearest rank) / max, Δ = lp_B - lp_A;
  the fraction of tokens whose ratio exp(Δ) falls outside the PPO clip range [1 - ε, 1 + ε];
  k3 KL mean(r - 1 - log r), r = exp(Δ), side A in the rollout's place (diff.py's definition);
and per module the relative L2 of outputs, ||B - A|| / ||A|| over the same tokens' rows, per layer
and over all layers (attention, its projections, the MLP's gate/up/down projections, the norms).
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import torch

from onepath.consistency.bisect import (Side, add_model_args, load_models, load_weights, parse_layout,
                                        sequences_from_args)
from onepath.engine.device import require_device
from onepath.consistency.recorder import Layout, Site, check_same_sites, trace
from onepath.models.dense import DenseDecoder
from onepath.models.kv_cache import BLOCK_SIZE
from onepath.numerics import diff

_LAYER_PREFIX = re.compile(r"^(?:.*\.)?layers\.\d+\.?")


def module_kind(site: Site) -> str:
    """'model.layers.3.mlp.down_proj' + linear -> 'mlp.down_proj:linear'; top-level calls -> the op."""
    base = _LAYER_PREFIX.sub("", site.module)
    return f"{base}:{site.op}" if base else site.op


def diagnose(model_a: DenseDecoder, model_b: DenseDecoder, sequences: list[list[int]], layout_a: Layout = Layout(),
             layout_b: Layout = Layout(), eps: float = 0.2, block_size: int = BLOCK_SIZE) -> dict:
    ta = trace(model_a, sequences, layout_a, block_size)
    tb = trace(model_b, sequences, layout_b, block_size)
    check_same_sites(ta, tb)
    lp_a, lp_b = [], []
    scoring = next(k for k, s in enumerate(ta.sites) if s.op == "token_logprobs")
    for s, seq in enumerate(sequences):
        ra, rb = ta.rows[scoring][s], tb.rows[scoring][s]
        positions, ia, ib = ra.common(rb)
        keep = [j for j, p in enumerate(positions) if p + 1 < len(seq)]  # a sequence's last row has no next token
        if keep:
            lp_a.append(ra.values[0][[ia[j] for j in keep]])
            lp_b.append(rb.values[0][[ib[j] for j in keep]])
    if not lp_a:
        raise ValueError("no token is scored by both sides: give sequences of at least 2 tokens, and layouts whose "
                         "logit rows overlap")
    a, b = torch.cat(lp_a).double().cpu(), torch.cat(lp_b).double().cpu()
    metrics = diff.rollout_diff(a[None], b[None], torch.ones(1, a.numel(), dtype=torch.bool))
    delta = torch.where(a != b, b - a, torch.zeros_like(a))
    ratio = delta.exp()
    return {
        "a": Side(model_a, layout_a).describe(), "b": Side(model_b, layout_b).describe(),
        "sequences": len(sequences), "tokens": a.numel(), "clip_eps": eps,
        "logprob_abs_diff_p50": percentile(delta.abs(), 0.5),
        "logprob_abs_diff_p99": percentile(delta.abs(), 0.99),
        "logprob_abs_diff_max": metrics[diff.LOGPROB_ABS_DIFF_MAX],
        "ratio_outside_clip_frac": float(((ratio < 1 - eps) | (ratio > 1 + eps)).double().mean()),
        "k3_kl": metrics[diff.K3_KL],
        "tokens_differing_frac": metrics[diff.TOKENS_DIFFERING_FRAC],
        "probs_diff_max": metrics[diff.PROBS_DIFF_MAX],
        "modules": _module_rel_l2(ta, tb, len(sequences)),
    }


def percentile(x: torch.Tensor, q: float) -> float:
    """Nearest-rank percentile (torch.quantile refuses more than 2**24 elements)."""
    v = x.sort().values
    return float(v[max(0, math.ceil(q * v.numel()) - 1)])


def _module_rel_l2(ta, tb, num_seqs: int) -> dict:
    sums: dict[str, dict] = {}   # kind -> layer -> [|B - A|^2, |A|^2]
    for k, site in enumerate(ta.sites):
        n = _occurrence(ta.sites, k)  # rope is called twice per layer (q, then k): 'self_attn:rope', '...#1'
        kind = module_kind(site) + (f"#{n}" if n else "")
        acc = sums.setdefault(kind, {}).setdefault(site.layer, [0.0, 0.0])
        for s in range(num_seqs):
            ra, rb = ta.rows[k][s], tb.rows[k][s]
            _, ia, ib = ra.common(rb)
            for x, y in zip(ra.values, rb.values):
                x, y = x[ia].double(), y[ib].double()
                acc[0] += float(((y - x) ** 2).sum())
                acc[1] += float((x ** 2).sum())
    return {kind: {"rel_l2": _ratio(sum(v[0] for v in layers.values()), sum(v[1] for v in layers.values())),
                   "layers": {str(layer): _ratio(*v) for layer, v in layers.items() if layer is not None}}
            for kind, layers in sums.items()}


def _occurrence(sites: list[Site], k: int) -> int:
    """How many earlier sites of the same layer share site k's op and module."""
    s = sites[k]
    return sum(1 for t in sites[:k] if (t.op, t.module, t.layer) == (s.op, s.module, s.layer))


def _ratio(num: float, den: float) -> float:
    if num == 0.0:
        return 0.0
    return (num / den) ** 0.5 if den > 0 else float("inf")


def format_table(result: dict) -> str:
    lines = [f"diagnose  A: {result['a']}", f"          B: {result['b']}",
             f"{result['tokens']} tokens of {result['sequences']} sequences",
             f"|d log p|  P50 {result['logprob_abs_diff_p50']:.3g}  P99 {result['logprob_abs_diff_p99']:.3g}  "
             f"max {result['logprob_abs_diff_max']:.3g}",
             f"ratio outside 1 +- {result['clip_eps']:g}: {result['ratio_outside_clip_frac']:.4g}   "
             f"k3 KL {result['k3_kl']:.3g}   tokens differing {result['tokens_differing_frac']:.4g}",
             "", f"{'module':36s} {'rel L2':>10s} {'worst layer':>22s}"]
    for kind, m in result["modules"].items():
        worst = max(m["layers"].items(), key=lambda kv: kv[1], default=None)
        shown = f"{worst[1]:.3g} (layer {worst[0]})" if worst else "-"
        lines.append(f"{kind:36s} {m['rel_l2']:10.3g} {shown:>22s}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`onepath diagnose`: print the table (and write JSON with --json); exit 0."""
    parser = argparse.ArgumentParser(prog="onepath diagnose", description="teacher-force the same sequences "
                                     "through two sides and report log-prob, ratio, KL and per-module differences",
                                     epilog="example: onepath diagnose tiny --sides spec --num-sequences 4")
    add_model_args(parser)
    parser.add_argument("--sides", default="spec", choices=("spec", "prefill-decode"),
                        help="spec: --spec-a vs --spec-b (default consistent vs baseline), both whole prefill; "
                             "prefill-decode: one spec, whole prefill vs prefill 1 token then decode")
    parser.add_argument("--num-sequences", type=int, default=8, help="random sequences when none is given")
    parser.add_argument("--eps", type=float, default=0.2, help="PPO clip range: ratios outside 1 +- eps are counted")
    args = parser.parse_args(argv)
    require_device(args.device)
    if args.sides == "spec":
        args.spec_b = args.spec_b or "baseline"
        presets = ("", "")
    else:
        args.spec_b = args.spec_b or args.spec_a
        presets = ("", "prefill=1")
    layouts = []
    for text, preset in ((args.layout_a, presets[0]), (args.layout_b, presets[1])):
        layout, batch, _ = parse_layout(preset if text is None else text)
        if batch:
            raise ValueError("diagnose runs all its sequences in each pass: drop batch= from the layout")
        layouts.append(layout)
    config, state, tokenizer, _ = load_weights(args.model, args.seed)
    sequences = sequences_from_args(args, config, tokenizer, count=args.num_sequences)
    model_a, model_b = load_models(args, config, state, max_positions=max(len(s) for s in sequences))
    result = diagnose(model_a, model_b, sequences, layouts[0], layouts[1], args.eps, args.block_size)
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
