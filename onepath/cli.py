"""onepath command line: `onepath train | generate | serve | report | check | bisect | diagnose | slice | bench`."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import textwrap
from pathlib import Path

OVERRIDES = """\
settings:
  Every key of the run config is also an option --section.key value (or --section.key=value), applied after
  --config in the order given. The sections and their keys (onepath/config.py; the demo's values, with a
  comment each, in onepath/configs/demo.yaml):
"""


def run_options(parser: argparse.ArgumentParser, train: bool = True) -> None:
    """The options of `train` and `generate` that set the run config's top-level keys."""
    from onepath.config import MODES
    if train:
        parser.add_argument("--out", default=None, help="the run directory, created if missing (default runs/demo)")
        parser.add_argument("--mode", default=None, choices=MODES,
                            help="consistent (default), baseline (the stock fast path), or both side by side")
    else:  # a generate samples in one mode
        parser.add_argument("--mode", default=None, choices=[m for m in MODES if m != "both"],
                            help="consistent (default) or baseline (the stock fast path)")
    parser.add_argument("--device", default=None, choices=("cpu", "cuda"), help="where the model runs (default cpu)")
    parser.add_argument("--quant", default=None, help="low-precision presets joined by '+', e.g. fp8 or fp8+fp8_kv "
                        "(default: none, BF16 on cuda and FP32 on cpu)")


def run_config(config: str | None, args: argparse.Namespace, overrides: list[str], *more: str):
    """The run config: the file, the --section.key overrides, then --out/--mode/--device/--quant and `more`."""
    from onepath.config import load_run_config
    top = [token for key in ("out", "mode", "device", "quant") if getattr(args, key, None) is not None
           for token in (f"--{key}", getattr(args, key))]
    return load_run_config(config, [*overrides, *top, *more])


def settings_help(examples: list[str]) -> str:
    """The epilog of `train` and `generate`: the config's sections with their keys, then examples."""
    from dataclasses import fields

    from onepath.config import SECTIONS
    lines = [OVERRIDES]
    for name, section in SECTIONS.items():
        keys = ", ".join(f.name for f in fields(section))
        lines.append(textwrap.fill(keys, 110, initial_indent=f"    {name:<11s} ", subsequent_indent=" " * 16))
    return "\n".join(lines) + "\n\nexamples:\n" + "\n".join(f"  {e}" for e in examples)


def check_run_dir(out: str) -> None:
    """The run directory (or the first of its parents that exists) must be a writable directory."""
    path = Path(out)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is inside {existing}, which is a file"
        raise ValueError(f"--out {out} {where}: give a directory for the run (created if missing), e.g. runs/demo")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {existing} is not writable: give a directory you can write, e.g. runs/demo")


def train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="onepath train", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="GRPO with bitwise-consistent rollout and trainer. Without --config it trains the embedded demo\n"
        "(a tiny model learning 2-digit arithmetic on the CPU). On several processes launch it with\n"
        "`torchrun --nproc-per-node N -m onepath train ...` and pick the layouts with --parallel.rollout/trainer.",
        epilog=settings_help(["onepath train --mode both --out runs/demo",
                              "onepath train --config my.yaml --out runs/mine --train.steps 50 --train.lr 1e-4",
                              "onepath train --out runs/demo --resume --train.steps 40"]))
    parser.add_argument("--config", default=None, help="YAML run config (default: onepath/configs/demo.yaml)")
    run_options(parser)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest complete step_N checkpoint in the run directory "
                             "(a run directory without one starts at step 1); the layout may differ from the run's")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads per process (default 1: tiny models run fastest on one)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or per-step table")
    args, overrides = parser.parse_known_args(argv)
    if args.threads < 1:
        raise ValueError(f"--threads {args.threads} must be >= 1")
    from onepath.engine.device import require_device
    from onepath.train.run import run

    cfg = run_config(args.config or str(Path(__file__).parent / "configs" / "demo.yaml"), args, overrides)
    require_device(cfg.device)
    check_run_dir(cfg.out)
    import torch
    torch.set_num_threads(args.threads)
    return run(cfg, resume=args.resume, progress=not args.quiet)


def report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="onepath report", description="draw report.png from run directories",
                                     epilog="example: onepath report runs/demo --out runs/demo/report.png")
    parser.add_argument("runs", nargs="+", help="run directories (or parents of runs, e.g. the --out of --mode both)")
    parser.add_argument("--out", default=None, help="directory or .png path (default: the first run directory)")
    args = parser.parse_args(argv)
    from onepath.train.report import draw_report, report_summary
    runs = [Path(p) for p in args.runs]
    path = draw_report(runs, Path(args.out) if args.out else runs[0])
    for label, s in report_summary(runs).items():
        val = "" if s["val_score_last"] is None else f", val {s['val_score_last']:.3f}"
        print(f"{label}: {s['steps']} steps, diff = 0 on {s['steps_with_diff_exactly_0']}, "
              f"max |dp| {s['max_probs_diff']:.3g}, reward {s['reward_first5']:.3f} -> {s['reward_last5']:.3f}{val}")
        if s["wall"] is not None:
            split = " + ".join(f"{key} {seconds:.1f}" for key, seconds in s["wall"]["split_s"].items())
            print(f"  wall {s['wall']['total_s']:.1f} s = {split}")
    print(f"wrote {path}")
    return 0


def checkpoint_engine(args: argparse.Namespace, overrides: list[str], command: str):
    """(run config, engine, tokenizer) of the checkpoint args.model, as `generate` and `serve` sample from it:
    rollout.* sets the engine and the sampling; rollout.max_model_len is at most max_position_embeddings."""
    from onepath.config import RolloutSection, engine_settings
    from onepath.engine.device import require_device
    from onepath.engine.llm_engine import LLMEngine
    from onepath.models import build_decoder
    from onepath.models.checkpoint import load_config, load_state_dict, load_tokenizer
    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops import Ops

    config = load_config(args.model)
    cfg = run_config(args.config, args, overrides, "--model.path", args.model)
    if cfg.mode not in ("consistent", "baseline"):
        raise ValueError(f"--mode {cfg.mode}: {command} samples in one mode, consistent or baseline")
    require_device(cfg.device)
    positions = config.max_position_embeddings
    if cfg.rollout.max_model_len > positions:
        if cfg.rollout.max_model_len != RolloutSection().max_model_len:  # set by the user, not the default
            raise ValueError(f"rollout.max_model_len = {cfg.rollout.max_model_len} > max_position_embeddings = "
                             f"{positions} of {args.model}: the model has no positions past that; "
                             f"pass --rollout.max_model_len {positions} or less")
        cfg = run_config(args.config, args, overrides, "--model.path", args.model,
                         "--rollout.max_model_len", str(positions))
    tokenizer = load_tokenizer(args.model)
    model = build_decoder(config, Ops(ExecutionSpec.default(cfg.mode, cfg.device, quant=cfg.quant)),
                          max_positions=cfg.rollout.max_model_len)
    model.load_hf_state_dict(load_state_dict(args.model))
    return cfg, LLMEngine(model, **engine_settings(cfg), tokenizer=tokenizer), tokenizer


def generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="onepath generate", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Sample completions from a checkpoint, one line per prompt. The engine and the sampling take\n"
        "the run config's settings (rollout.*); rollout.max_model_len is at most the checkpoint's\n"
        "max_position_embeddings. Exit 1 when a prompt fails (the others still print).",
        epilog=settings_help(["onepath generate runs/demo/step_20 '12+3=' '7*8=' --rollout.max_tokens 4",
                              "onepath generate CKPT 'Hello' --rollout.max_model_len 512 --rollout.temperature 0.7",
                              "onepath generate CKPT 'Hello' --rollout.temperature 0   # greedy"]))
    parser.add_argument("model", help="a Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json)")
    parser.add_argument("prompts", nargs="+", help="prompts, before any option")
    parser.add_argument("--config", default=None, help="YAML run config (default: RunConfig's defaults)")
    run_options(parser, train=False)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args, overrides = parser.parse_known_args(argv)
    from onepath.config import sampling_params
    from onepath.models.checkpoint import unknown_characters

    cfg, engine, tokenizer = checkpoint_engine(args, overrides, "generate")
    for i, prompt in enumerate(args.prompts):
        unknown = unknown_characters(tokenizer, prompt)
        if unknown:
            print(f"onepath generate: warning: prompt {i} {prompt!r} has {', '.join(map(repr, unknown))} outside "
                  f"the tokenizer's vocabulary: the model sees <unk> there", file=sys.stderr)
    progress = None if args.quiet or len(args.prompts) < 2 else "generate"
    outputs = engine.generate(args.prompts, sampling_params(cfg, cfg.rollout.seed), progress=progress)
    for prompt, out in zip(args.prompts, outputs):
        if out.error:
            print(f"{prompt!r}: error: {out.error}", file=sys.stderr)
        else:
            print(f"{prompt!r} -> {out.text!r}  ({out.finish_reason}, {len(out.token_ids)} tokens, "
                  f"sum logprob {sum(out.logprobs):.4f})")
    failed = sum(1 for out in outputs if out.error)
    if failed:
        print(f"onepath generate: {failed} of {len(outputs)} prompts failed", file=sys.stderr)
    return 1 if failed else 0


def serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="onepath serve", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="An OpenAI-compatible HTTP server over a checkpoint: /v1/completions, /v1/chat/completions\n"
        "(streaming, tools) and /v1/models; every response carries the token ids, the sampled tokens' log-probs\n"
        "and the weight version (docs/serve.md). The engine takes the run config's rollout.* settings, the chat\n"
        "template data.chat_template (auto: the checkpoint's), tool calls rollout.tool_format. Needs the serve\n"
        "extra: pip install 'onepath[serve]'.",
        epilog=settings_help(["onepath serve runs/demo/step_20 --port 8000",
                              "onepath serve CKPT --rollout.max_model_len 4096 --rollout.max_num_seqs 256 --device cuda",
                              "onepath serve CKPT --data.chat_template my_template.jinja --rollout.tool_format hermes"]))
    parser.add_argument("model", help="a Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json)")
    parser.add_argument("--config", default=None, help="YAML run config (default: RunConfig's defaults)")
    run_options(parser, train=False)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="the port (default 8000; 0: any free port, printed)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name requests give as `model` (default: the checkpoint path as given)")
    args, overrides = parser.parse_known_args(argv)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in [0, 65535] (0: any free port)")
    import signal

    from onepath.serve import require_extra
    require_extra("onepath serve")
    from onepath.models.checkpoint import load_tokenizer_config
    from onepath.serve.app import ServedModel
    from onepath.serve.engine_loop import EngineLoop
    from onepath.serve.frontend import FrontEnd
    from onepath.train.data import chat_template

    cfg, engine, tokenizer = checkpoint_engine(args, overrides, "serve")
    template = chat_template(cfg.data.chat_template, args.model, load_tokenizer_config(args.model))
    loop = EngineLoop(engine)
    served = ServedModel(args.served_model_name or args.model, loop, tokenizer, template,
                         cfg.data.chat_template_kwargs or {}, cfg.rollout.tool_format, seed=cfg.rollout.seed)
    server = FrontEnd(served, args.host, args.port)  # the HTTP work in a process of its own
    loop.start()
    server.start()
    chat = f"chat template {template.source}" if template is not None else "no chat template (completions only)"
    print(f"onepath serve: {served.name} ({cfg.mode}, {cfg.device}, max_model_len {served.max_model_len}, {chat}) "
          f"on {server.url}/v1", flush=True)

    def stop(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        loop.stop()
    if server.failure is not None:
        print(f"onepath serve: error: {server.failure}", file=sys.stderr)
        return 1
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
    parser = argparse.ArgumentParser(prog="onepath bench", description="benchmarks; JSON results with their command",
                                     epilog="example: onepath bench rollout --model tiny --device cpu --requests 8 "
                                            "--scale 0.02")
    benchmarks = parser.add_subparsers(dest="benchmark", required=True)
    rollout.add_arguments(benchmarks.add_parser("rollout", help=rollout.__doc__.splitlines()[0],
                                                description=rollout.__doc__.splitlines()[0], epilog=rollout.EXAMPLE))
    args = parser.parse_args(argv)
    return rollout.run(args, f"onepath bench {shlex.join(argv)}")


# name -> (the command, its line in `onepath --help`)
COMMANDS = {
    "train": (train, "GRPO training, rollout and trainer bitwise consistent (default: the embedded demo)"),
    "generate": (generate, "sample completions from a checkpoint"),
    "serve": (serve, "an OpenAI-compatible HTTP server over a checkpoint (token ids, log-probs, weight version)"),
    "report": (report, "draw report.png from run directories"),
    "check": (check, "run the consistency gates C0..C10 on a checkpoint or 'tiny'"),
    "bisect": (bisect, "find the first operator whose outputs differ between two sides, and a repro"),
    "diagnose": (diagnose, "log-prob, ratio, KL and per-module differences between two sides"),
    "slice": (slice_model, "cut N layers of a checkpoint into a small model"),
    "bench": (bench, "benchmarks: `onepath bench rollout` (engine tokens/s vs HF generate and the roofline)"),
}


def usage() -> str:
    lines = ["usage: onepath COMMAND [options]   (onepath COMMAND --help: its options and an example)", "",
             "commands:"]
    lines += [f"  {name:<10s}{line}" for name, (_, line) in COMMANDS.items()]
    lines += ["", "example: onepath train --mode both --out runs/demo"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        head = f"onepath: error: unknown command {argv[0]!r}\n" if argv else ""
        print(head + usage(), file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]][0](argv[1:])
    except (ValueError, FileNotFoundError) as e:
        print(f"onepath {argv[0]}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
