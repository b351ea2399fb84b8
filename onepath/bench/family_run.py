"""A new family's GRPO run at the recipe's shapes, consistent and baseline from one random checkpoint.

Per step and mode: the exact flag (every diff metric 0), max |dp|, k3, MoE routing agreement and the step's time.

    python -m onepath.bench.family_run --preset nemotron-3-nano-13l --device cuda --out nemotron-h-run.json
    python -m onepath.bench.family_run --preset nemotron-3-nano-13l --layers 8 --device cuda ...   # fewer layers
    python -m onepath.bench.family_run --preset deepseek-v4-flash-4l --device cuda --out deepseek-v4-run.json

The checkpoint is the preset's config (published layer shapes; --layers N keeps its first N layers, --set
model.FIELD=VALUE sets a config.json field) with the task's tokenizer as its vocabulary, written by the model's own
save in BF16 with tokenizer.json beside it. Both modes then run `onepath train --model.path CHECKPOINT` in a process
each, with RUN's settings (--set KEY=VALUE overrides any onepath train key) and --quant, by default the family's
recipe (FAMILY_QUANT). Targets (issues 33 and 34): the consistent run exact on every step, the baseline not, routing
agreement 1.0 on every step. Exit status 1 unless the consistent run was exact on every one of --steps steps.
On CUDA a model that cannot fit the GPU (check_fits) is refused before any work, naming the --layers that fit.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

import torch
import yaml

from onepath.bench import runs
from onepath.bench.results import environment, save_json
from onepath.bench.workloads import MODELS
from onepath.models import build_decoder
from onepath.models.checkpoint import save_checkpoint
from onepath.models.config import ModelConfig
from onepath.numerics.diff import DIFF_METRICS, is_exact
from onepath.ops import ExecutionSpec, Ops
from onepath.train import checkpoint as train_checkpoint
from onepath.train.metrics import read_metrics
from onepath.train.trainer import embedded_task

MODES = ("consistent", "baseline")
# the recipe's formats per family: Nemotron-H by module class (FP8 Mamba projections, NVFP4 W4A16 routed experts,
# FP8 KV), DeepSeek-V4 block-FP8 W8A8 with FP8 KV and the indexer scored in FP8
FAMILY_QUANT = {"nemotron_h": "fp8_mamba+nvfp4_experts+fp8_kv", "deepseek_v4": "fp8+fp8_kv+fp8_indexer"}
# The word problems' prompts (150-250 tokens, the tokenizer is per character) cross a 128-token scan chunk, the
# sliding window and HCA's 128-token compression window, so decode replays the scan past a boundary and reads
# compressed entries; arithmetic's 20-token sequences reach none of these.
TASKS = {"word_problems": dict(max_operand=9, max_tokens=32, max_model_len=384),
         "arithmetic": dict(max_operand=49, max_tokens=16, max_model_len=64)}
# 4 prompts x 8 samples (GRPO groups of 8), 32 sequences a step, decoded as one batch; small
# enough that 30 steps of a mode at the presets' widths take minutes. Trainer micro-batches of 2048 tokens bound the
# activations DeepSeek-V4's gathered candidates keep for backward. No warm start, no validation, old log-probs
# recomputed and diffed on every step.
RUN = ["warm_start.steps=0", "train.val_every=0", "data.n_test=0", "data.n_train=512", "train.prompts_per_step=4",
       "rollout.n=8", "rollout.max_num_seqs=32", "rollout.num_blocks=1024", "train.micro_batch_tokens=2048",
       "train.old_logprob=verify"]
# GPU bytes per parameter at least: BF16 weights in the engine and the trainer (4), gradients (2), AdamW's two
# moments (4) and its foreach step's temporaries (about 2), the quantised weight copies of both sides (about 1 each)
BYTES_PER_PARAMETER = 14
FITS = 0.8  # of the GPU's memory: activations, the cache, captured graphs' pools and fragmentation take the rest


def digit_share(prompt: str, completion: str, ground_truth, **row) -> float:
    """The run's reward: 1 for the exact answer after "####", else the share of digits in the completion. Random
    weights never give the answer; a reward of 0 everywhere would make every advantage 0 and no update would move
    the weights the next step samples with."""
    answer = completion.rpartition("####")[2].strip()
    if answer and answer == str(ground_truth).strip():
        return 1.0
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def preset_config(preset: str, layers: int | None, fields_set: dict, tokenizer, task) -> ModelConfig:
    """The preset's config.json fields, `fields_set` on top, cut to its first `layers` layers, with the
    tokenizer's vocabulary and the task's special tokens."""
    if preset not in MODELS:
        raise ValueError(f"--preset {preset!r} is unknown: use one of {sorted(MODELS)}")
    raw = dict(MODELS[preset])
    known = set(raw) | {f.name for f in fields(type(ModelConfig.from_dict(raw)))} | {"hybrid_override_pattern"}
    unknown = sorted(set(fields_set) - known)
    if unknown:
        raise ValueError(f"--set model.{unknown[0]}: {raw['model_type']}'s config has no field {unknown[0]!r}; "
                         f"its fields: {sorted(known - {'extra'})}")
    raw.update(fields_set)
    if layers is not None:
        raw.update(cut_layers(raw, layers))
    raw.update(vocab_size=tokenizer.get_vocab_size(), bos_token_id=task.BOS_ID, eos_token_id=task.EOS_ID,
               pad_token_id=task.PAD_ID)
    return ModelConfig.from_dict(raw)


def preset_layers(raw: dict) -> int:
    return len(raw["hybrid_override_pattern"]) if "hybrid_override_pattern" in raw else raw["num_hidden_layers"]


def cut_layers(raw: dict, layers: int) -> dict:
    """The fields that keep the first `layers` layers: a hybrid's pattern, else num_hidden_layers and the
    per-layer lists given."""
    total = preset_layers(raw)
    if not 1 <= layers <= total:
        raise ValueError(f"--layers {layers} must be in [1, {total}] (the preset's layers)")
    if "hybrid_override_pattern" in raw:
        return {"hybrid_override_pattern": raw["hybrid_override_pattern"][:layers]}
    cut = {"num_hidden_layers": layers}
    cut.update({name: list(raw[name])[:layers] for name in ("layer_types", "mlp_layer_types") if raw.get(name)})
    return cut


def write_checkpoint(path: Path, config: ModelConfig, tokenizer, task, max_model_len: int, seed: int) -> int:
    """The model's random weights (its init_weights) saved by its own save in BF16, the tokenizer beside them;
    the parameter count."""
    model = build_decoder(config, Ops(ExecutionSpec("baseline")), max_positions=max_model_len)
    model.init_weights(seed)
    state = {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in model.hf_state_dict().items()}
    count = sum(p.numel() for p in model.parameters())
    del model
    save_checkpoint(path, state, config, tokenizer, task.tokenizer_config(tokenizer, max_model_len))
    return count


def parameter_count(config: ModelConfig) -> int:
    with torch.device("meta"):  # shapes only
        model = build_decoder(config, Ops(ExecutionSpec("baseline")), max_positions=2)
    return sum(p.numel() for p in model.parameters())


def device_bytes() -> int | None:
    """The GPU's memory, asked in a child process so that this one holds no CUDA context while the runs do."""
    ask = "import torch; print(torch.cuda.get_device_properties(0).total_memory)"
    done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True)
    return int(done.stdout) if done.returncode == 0 and done.stdout.strip().isdigit() else None


def check_fits(preset: str, layers: int | None, fields_set: dict, tokenizer, task) -> None:
    """On CUDA, refuse a model whose weights, gradients, AdamW state and the engine's copy cannot fit the GPU,
    naming the most --layers that would."""
    total = device_bytes()
    if total is None:
        return
    layers = layers or preset_layers({**MODELS[preset], **fields_set})

    def need(n: int) -> int:
        return parameter_count(preset_config(preset, n, fields_set, tokenizer, task)) * BYTES_PER_PARAMETER

    asked = need(layers)
    if asked <= FITS * total:
        return  # (the smaller cuts are counted only for the refusal's hint)
    fits = [n for n in range(1, layers) if need(n) <= FITS * total]
    hint = f"--layers {fits[-1]}" if fits else "a smaller --set model.n_routed_experts"
    raise SystemExit(f"{preset} with --layers {layers} needs about {asked / 2**30:.0f} GiB of GPU memory "
                     f"({BYTES_PER_PARAMETER} bytes a parameter: both sides' weights, gradients, AdamW), more than "
                     f"{FITS} of this GPU's {total / 2**30:.0f} GiB: run it with {hint}")


def step_record(r: dict) -> dict:
    verified = all(k in r for k in DIFF_METRICS)
    return {"step": r["step"], "exact": is_exact(r) if verified else None,
            "max_dp": r.get("training/rollout_probs_diff_max"), "k3": r.get("rollout_corr/k3_kl"),
            "logprob_abs_diff_max": r.get("rollout_corr/logprob_abs_diff_max"),
            "tokens_differing_frac": r.get("rollout_corr/tokens_differing_frac"),
            "valid_tokens": r.get("rollout_corr/valid_tokens"),
            "routing_agreement": r.get("moe/routing_agreement"),
            "routing_compared_tokens": r.get("moe/routing_compared_tokens"),
            "reward": r.get("critic/score/mean"), "grad_norm": r.get("actor/grad_norm"),
            "step_s": r.get("timing_s/step"), "gen_s": r.get("timing_s/gen"),
            "rollout_tokens_per_s": r.get("perf/rollout_tokens_per_s"),
            "peak_memory_gib": r.get("perf/peak_memory_gib")}


def summary(modes: dict, steps: int) -> dict:
    out = {"steps_asked": steps}
    for mode, run in modes.items():
        records = run["steps"]
        agreements = [s["routing_agreement"] for s in records if s["routing_agreement"] is not None]
        peaks = [s["peak_memory_gib"] for s in records if s["peak_memory_gib"] is not None]  # CUDA only
        out[mode] = dict(steps=len(records), exit_code=run["exit_code"],
                         exact_steps=sum(s["exact"] is True for s in records),
                         max_dp=max((s["max_dp"] or 0.0 for s in records), default=None),
                         min_routing_agreement=min(agreements, default=None),
                         routing_compared_tokens=sum(s["routing_compared_tokens"] or 0 for s in records),
                         mean_step_s=sum(s["step_s"] or 0.0 for s in records) / len(records) if records else None,
                         peak_memory_gib=max(peaks, default=None))
    if "consistent" in modes:
        c = out["consistent"]
        out["consistent_exact_every_step"] = c["steps"] == steps and c["exact_steps"] == steps
        out["consistent_routing_agreement_1"] = c["steps"] > 0 and c["min_routing_agreement"] == 1.0
    if "baseline" in modes:
        out["baseline_nonzero_some_step"] = any(s["exact"] is False for s in modes["baseline"]["steps"])
    return out


def override_pairs(items: list[str]) -> tuple[dict, list[str]]:
    """--set items split into config.json fields (model.FIELD, values read as YAML) and onepath train keys."""
    model, train = {}, []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r} needs KEY=VALUE, e.g. --set train.lr=1e-5 or --set model.hidden_size=64")
        if key.startswith("model."):
            model[key.removeprefix("model.")] = yaml.safe_load(value)
        else:
            train.append(item)
    return model, train


def last_value(overrides: list[str], key: str) -> str:
    return next(item.partition("=")[2] for item in reversed(overrides) if item.partition("=")[0] == key)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m onepath.bench.family_run", description=__doc__.splitlines()[0])
    p.add_argument("--preset", required=True, help=f"a model of bench/workloads.py: {', '.join(sorted(MODELS))}")
    p.add_argument("--layers", type=int, default=None, help="keep the preset's first N layers")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="model.FIELD=VALUE sets a config.json field; any other key an onepath train setting "
                        "(e.g. train.prompts_per_step=8), after RUN's")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--quant", default=None, help="quant presets joined by + (default: the family's recipe, "
                                                 f"{FAMILY_QUANT}); none for the spec's dtype alone")
    p.add_argument("--task", default="word_problems", choices=tuple(TASKS), help="the embedded task: its rows and "
                                                                                  "its tokenizer (the vocabulary)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, run in this order")
    p.add_argument("--mode-timeout", type=float, default=None, metavar="S",
                   help="stop a mode's run after S seconds (its steps so far are kept); default none")
    p.add_argument("--seed", type=int, default=0, help="the checkpoint's random weights")
    p.add_argument("--run-dir", default=None, help="keep the runs' directories (metrics.jsonl, report.png) here; "
                                                   "default: a temporary one. Their final checkpoints are removed")
    p.add_argument("--out", default="family-run.json")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes {args.modes!r}: use consistent and/or baseline, comma-separated")
    if args.steps < 1:
        p.error(f"--steps {args.steps} must be >= 1")
    fields_set, train_set = override_pairs(args.set)
    task = embedded_task(args.task)
    tokenizer = task.build_tokenizer()
    config = preset_config(args.preset, args.layers, fields_set, tokenizer, task)  # bad input fails here, early
    quant = args.quant or FAMILY_QUANT.get(config.model_type, "none")
    if quant != "none":
        ExecutionSpec.default("consistent", args.device, quant=quant)  # names a bad preset before any work
    settings = dict(TASKS[args.task])
    overrides = [f"data.task={args.task}", f"data.max_operand={settings['max_operand']}",
                 f"rollout.max_tokens={settings['max_tokens']}", f"rollout.max_model_len={settings['max_model_len']}",
                 *RUN, *train_set]
    max_model_len = int(last_value(overrides, "rollout.max_model_len"))
    if args.device == "cuda":
        check_fits(args.preset, args.layers, fields_set, tokenizer, task)
    result = dict(environment("cpu"), command="python -m onepath.bench.family_run " + " ".join(argv),
                  preset=args.preset, layers=config.num_hidden_layers, model_type=config.model_type, quant=quant,
                  task=args.task, model_fields=fields_set, overrides=overrides, modes={})
    out = Path(args.out)
    run_root = Path(args.run_dir) if args.run_dir else None
    held = [str(run_root / m) for m in modes if run_root is not None and (run_root / m).exists()]
    if held:
        p.error(f"--run-dir: {held[0]} exists (an earlier run's metrics would be read as this one's): give another")
    with tempfile.TemporaryDirectory(prefix="family-run-") as scratch:
        checkpoint = Path(scratch) / "checkpoint"
        start = time.perf_counter()
        result["parameters"] = write_checkpoint(checkpoint, config, tokenizer, task, max_model_len, args.seed)
        result["checkpoint_s"] = time.perf_counter() - start
        print(f"{args.preset}: {config.num_hidden_layers} layers, {result['parameters'] / 1e9:.2f}B parameters, "
              f"checkpoint written in {result['checkpoint_s']:.0f} s; quant {quant}, {args.steps} steps a mode")
        for mode in modes:
            run_dir = (run_root or Path(scratch)) / mode
            start = time.perf_counter()
            quant_args = ["--quant", quant] if quant != "none" else []
            code = runs.train(["--model.path", str(checkpoint), "--mode", mode, "--device", args.device, *quant_args,
                               "--out", str(run_dir), "--quiet", "--train.steps", str(args.steps),
                               f"--train.reward={Path(__file__).resolve()}:digit_share",
                               *(f"--{item}" for item in overrides)], timeout=args.mode_timeout)
            metrics = run_dir / "metrics.jsonl"
            records = read_metrics(metrics) if metrics.is_file() else []
            result["modes"][mode] = dict(exit_code=code, wall_s=time.perf_counter() - start,
                                         steps=[step_record(r) for r in records])
            for step_dir in run_dir.glob("step_*"):  # the final checkpoint: the size of the model and its AdamW
                shutil.rmtree(step_dir)
            train_checkpoint.remove_leftovers(run_dir)  # a save cut by --mode-timeout
            result["summary"] = summary(result["modes"], args.steps)
            save_json(result, out)
    result.update(environment(args.device))
    save_json(result, out)
    s = result["summary"]
    for mode in modes:
        m = s[mode]
        print(f"{mode}: {m['steps']} steps, {m['exact_steps']} exact, max |dp| {m['max_dp']}, routing agreement "
              f"min {m['min_routing_agreement']} over {m['routing_compared_tokens']} tokens, "
              f"{m['mean_step_s'] or 0:.2f} s a step" +
              (f", peak {m['peak_memory_gib']:.1f} GiB" if m["peak_memory_gib"] is not None else ""))
    print(f"consistent exact on every step: {s.get('consistent_exact_every_step')}, baseline nonzero on some step: "
          f"{s.get('baseline_nonzero_some_step')}; {out}")
    return 0 if s.get("consistent_exact_every_step", True) else 1


if __name__ == "__main__":
    sys.exit(main())
