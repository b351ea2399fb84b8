"""onepath command line: `onepath train | generate | report | check | bisect | diagnose | slice | bench`."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="onepath train", description="GRPO with bitwise-consistent rollout and trainer; on several processes "
        "launch it with `torchrun --nproc-per-node N -m onepath train ...` and pick the layouts with --parallel.*")
    parser.add_argument("--config", default=None, help="YAML run config (default: the embedded demo)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or per-step table")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads per process (tiny models run fastest on one)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest complete step_N checkpoint in the run directory "
                             "(a run directory without one starts at step 1); the layout may differ from the run's")
    args, overrides = parser.parse_known_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    from onepath.config import load_run_config
    from onepath.train.run import run

    config = args.config or str(Path(__file__).parent / "configs" / "demo.yaml")
    return run(load_run_config(config, overrides), resume=args.resume, progress=not args.quiet)


def report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="onepath report", description="draw report.png from run directories")
    parser.add_argument("runs", nargs="+", help="run directories (or a parent holding consistent/ and baseline/)")
    parser.add_argument("--out", default=None, help="directory or .png path (default: the first run directory)")
    args = parser.parse_args(argv)
    from onepath.train.report import draw_report, report_summary
    runs = [Path(p) for p in args.runs]
    path = draw_report(runs, Path(args.out) if args.out else runs[0])
    for label, s in report_summary(runs).items():
        print(f"{label}: {s['steps']} steps, diff = 0 on {s['steps_with_diff_exactly_0']}, "
              f"max |dp| {s['max_probs_diff']:.3g}, reward {s['reward_first5']:.3f} -> {s['reward_last5']:.3f}")
    print(f"wrote {path}")
    return 0


def generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="onepath generate", description="sample completions from a checkpoint; the engine and the sampling "
        "take the run config's settings (--config, then overrides such as --rollout.max_tokens 32 "
        "--rollout.max_model_len 512 --rollout.temperature 0.7 --mode baseline --device cuda --quant fp8)")
    parser.add_argument("model", help="a Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json)")
    parser.add_argument("prompts", nargs="+", help="prompts, before any override")
    parser.add_argument("--config", default=None, help="YAML run config (default: RunConfig's defaults)")
    args, overrides = parser.parse_known_args(argv)
    from onepath.config import engine_settings, load_run_config, sampling_params
    from onepath.engine.llm_engine import LLMEngine
    from onepath.models import build_decoder
    from onepath.models.checkpoint import load_config, load_state_dict, load_tokenizer
    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops import Ops

    cfg = load_run_config(args.config, [*overrides, "--model.path", args.model])
    if cfg.mode not in ("consistent", "baseline"):
        raise ValueError(f"mode = {cfg.mode!r}: generate samples in one mode, consistent or baseline")
    model = build_decoder(load_config(args.model), Ops(ExecutionSpec.default(cfg.mode, cfg.device, quant=cfg.quant)),
                          max_positions=cfg.rollout.max_model_len)
    model.load_hf_state_dict(load_state_dict(args.model))
    engine = LLMEngine(model, **engine_settings(cfg), tokenizer=load_tokenizer(args.model))
    for prompt, out in zip(args.prompts, engine.generate(args.prompts, sampling_params(cfg, cfg.rollout.seed))):
        if out.error:
            print(f"{prompt!r}: error: {out.error}")
        else:
            print(f"{prompt!r} -> {out.text!r}  ({out.finish_reason}, {len(out.token_ids)} tokens, "
                  f"sum logprob {sum(out.logprobs):.4f})")
    return 0


def check(argv: list[str]) -> int:
    from onepath.consistency.gates import main as check_main
    return check_main(argv)


def bisect(argv: list[str]) -> int:
    from onepath.consistency.bisect import main as bisect_main
    return bisect_main(argv)


def diagnose(argv: list[str]) -> int:
    from onepath.consistency.diagnose import main as diagnose_main
    return diagnose_main(argv)


def slice_model(argv: list[str]) -> int:
    from onepath.consistency.slice import main as slice_main
    return slice_main(argv)


def bench(argv: list[str]) -> int:
    from onepath.bench import rollout
    parser = argparse.ArgumentParser(prog="onepath bench", description="benchmarks; JSON results with their command")
    benchmarks = parser.add_subparsers(dest="benchmark", required=True)
    rollout.add_arguments(benchmarks.add_parser("rollout", help=rollout.__doc__.splitlines()[0],
                                                description=rollout.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    return rollout.run(args, f"onepath bench {shlex.join(argv)}")


COMMANDS = {"train": train, "generate": generate, "report": report, "check": check, "bisect": bisect,
            "diagnose": diagnose, "slice": slice_model, "bench": bench}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: onepath {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except (ValueError, FileNotFoundError) as e:
        print(f"onepath {argv[0]}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
