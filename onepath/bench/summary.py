"""The rollout benchmark's derived numbers (ratios, roofline fractions), its targets and its console summary."""
from __future__ import annotations

from onepath.bench.results import print_table
from onepath.bench.roofline import COPY_CEILING_B_S, HBM_PEAK_B_S, decode_roofline, roofline_fraction
from onepath.models.config import HYBRID_MODEL_TYPES, MOE_MODEL_TYPES, ModelConfig

WORKLOAD_ROOFLINE = ("a workload's roofline: one decode step at batch min(requests, max_num_seqs) and context "
                     "mean prompt + mean output / 2, reading every weight once (embedding: the batch's rows; MoE "
                     "experts: those the batch touches under uniform routing, all of them at batch 256), "
                     "the batch's K/V and a hybrid's recurrent state; prefill is not counted, so the fraction is "
                     "exact for decode-dominated fixed workloads only")
TARGETS = {"consistent_over_baseline": 0.97, "consistent_over_baseline_moe": 0.90, "consistent_over_hf": 10.0,
           "decode_fraction_of_peak": 0.60, "consistent_over_baseline_deepseek_v4": 0.913}


def derive(entry: dict, state: dict, config: ModelConfig, max_num_seqs: int, kv_bytes_per_token: int) -> None:
    """Ratios, rooflines and roofline fractions from the measurements (K/V bytes per token as the
    engine reports them, else `kv_bytes_per_token`)."""
    reported = [r["memory"]["kv_bytes_per_token"] for row in entry["workloads"].values() for r in row["modes"].values()
                if "kv_bytes_per_token" in r.get("memory", {})]
    kv_bytes_per_token = reported[0] if reported else kv_bytes_per_token
    for row in entry["workloads"].values():
        tps = {mode: r["tokens_per_s"] for mode, r in row["modes"].items() if "tokens_per_s" in r}
        if "consistent" in tps and "baseline" in tps:
            row["consistent_over_baseline"] = tps["consistent"] / tps["baseline"]
        if "tokens_per_s" in row.get("hf", {}):
            row["over_hf"] = {mode: t / row["hf"]["tokens_per_s"] for mode, t in tps.items()}
        context = (row["prompt_tokens"] + row["output_tokens"] / 2) / row["requests"]
        roof = decode_roofline(state, config, min(row["requests"], max_num_seqs), context, kv_bytes_per_token)
        row["roofline"] = dict(roof, fraction={mode: roofline_fraction(t, roof) for mode, t in tps.items()})
    for d in (d for window in entry["decode_steps"] for d in window["modes"].values()):
        if "tokens_per_s" in d:
            d["roofline"] = decode_roofline(state, config, d["batch"], d["context"], kv_bytes_per_token)
            d["fraction"] = roofline_fraction(d["tokens_per_s"], d["roofline"])


def checks(model: str, entry: dict) -> list[dict]:
    def check(name, workload, value, target):
        return dict(name=name, model=model, workload=workload, value=value, target=target,
                    passed=None if value is None else value >= target)

    model_type = entry.get("config", {}).get("model_type")
    # DeepSeek-V4: the recipe's figure; a hybrid's MoE layers: the MoE target (its experts and routing as MoE's)
    target = TARGETS["consistent_over_baseline_deepseek_v4" if model_type == "deepseek_v4" else
                     "consistent_over_baseline_moe" if model_type in MOE_MODEL_TYPES + HYBRID_MODEL_TYPES else
                     "consistent_over_baseline"]
    out = []
    for name, row in entry.get("workloads", {}).items():
        out.append(check("consistent/baseline tokens/s", name, row.get("consistent_over_baseline"), target))
        if "hf" in row:
            out.append(check("consistent/HF generate tokens/s", name, row.get("over_hf", {}).get("consistent"),
                             TARGETS["consistent_over_hf"]))
    for window in entry.get("decode_steps", []):
        step = window["modes"].get("consistent", {})
        if "fraction" in step:
            out.append(check(f"consistent decode step at batch {step['batch']}, context {step['context']:.0f} / HBM "
                             f"roofline ({HBM_PEAK_B_S / 1e12:.1f} TB/s peak)", window["workload"],
                             step["fraction"]["of_peak"], TARGETS["decode_fraction_of_peak"]))
    return out


def print_summary(result: dict) -> None:
    rows, steps = [], []
    for model, entry in result["models"].items():
        if "error" in entry:
            rows.append([model, "-", "-", "error: " + entry["error"][:80]])
        for name, row in entry.get("workloads", {}).items():
            lengths = "/".join(f"{lo}" if lo == hi else f"{lo}..{hi}" for lo, hi in (row["prompt_len"], row["output_len"]))
            for mode, r in [*row["modes"].items(), *([("HF generate", row["hf"])] if "hf" in row else [])]:
                if "error" in r:
                    rows.append([model, name, mode, r.get("requests", row["requests"]), lengths, "error: " + r["error"][:80]])
                    continue
                fraction = row.get("roofline", {}).get("fraction", {}).get(mode, {}).get("of_peak")
                rows.append([model, name, mode, r.get("requests", row["requests"]), lengths, r["tokens_per_s"],
                             r["total_tokens_per_s"], r["seconds"], r.get("steps"),
                             row.get("consistent_over_baseline") if mode == "consistent" else None,
                             row.get("over_hf", {}).get(mode), fraction])
        for mode, d in ((mode, d) for window in entry.get("decode_steps", []) for mode, d in window["modes"].items()):
            if "error" in d:
                steps.append([model, mode, "error: " + d["error"][:80]])
            elif "roofline" in d:
                steps.append([model, mode, d["batch"], d["context"], d["seconds_per_step"] * 1e3, d["tokens_per_s"],
                              d["roofline"]["tokens_per_s_peak"], d["fraction"]["of_peak"], d["fraction"]["of_copy"],
                              "yes" if d["pure_decode"] else "NO"])
    print_table(f"rollout tokens/s on {result['gpu']}; of roofline = output tok/s / decode roofline tok/s at the "
                f"workload's batch and mean context, H200 HBM peak {HBM_PEAK_B_S / 1e12:.1f} TB/s",
                ["model", "workload", "mode", "requests", "prompt/output", "out tok/s", "total tok/s", "seconds",
                 "steps", "cons/base", "vs HF", "of roofline"], rows)
    if steps:
        print_table("decode steps with every sequence decoding (H200 HBM peak and measured copy ceiling)",
                    ["model", "mode", "batch", "context", "ms/step", "tok/s", f"roofline tok/s ({HBM_PEAK_B_S / 1e12:.1f})",
                     f"of {HBM_PEAK_B_S / 1e12:.1f} TB/s", f"of {COPY_CEILING_B_S / 1e12:.1f} TB/s copy", "pure"], steps)
    print("\ntargets")
    for c in result["checks"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[c["passed"]]
        value = "-" if c["value"] is None else f"{c['value']:.3g}"
        print(f"  {verdict}  {c['model']} {c['workload']}: {c['name']} = {value} (target >= {c['target']})")


def errors(entry: dict) -> list[str]:
    found = [entry["error"]] if "error" in entry else []
    found += [r["error"] for row in entry.get("workloads", {}).values()
             for r in [*row["modes"].values(), row.get("hf", {})] if "error" in r]
    return found + [d["error"] for window in entry.get("decode_steps", []) for d in window["modes"].values()
                    if "error" in d]
