"""One training step (forward + backward + AdamW) on one batch, consistent vs baseline, as the trainer runs it.

    python bench/train_step.py --out bench/results/train/train-step.json    # GPU: 64 x 512 tokens, Qwen3-0.6B shape, bf16
    python bench/train_step.py --tiny --out /tmp/train-step.json       # CPU smoke run, seconds

Each mode builds the same model (same seed) and an Actor, then times Actor.backward (the GRPO loss
of the trainer, micro-batched as --micro-batch-tokens says) + Actor.step: median of --iters after
--warmup, torch.cuda.synchronize around each. consistent: our kernels forward, reference-math
backward (ops/autograd.py); baseline: the stock forward kernels, the same backward. `stock` (off
unless named in --modes) differentiates the baseline kernels with torch's own autograd instead of
the reference backward: what a plain PyTorch trainer pays, the floor of the wrappers' cost.
Also timed apart: one layer's attention backward as the wrappers run it (ops/attention.py
`reference`, full FP32 scores per sequence) and as SDPA's backward runs it, times the layer count,
to show the attention backward's share of the step.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from onepath.bench.results import environment
from onepath.engine.sampling_params import SamplingParams
from onepath.models.batch import ForwardBatch
from onepath.models.config import ModelConfig
from onepath.models.dense import DenseDecoder
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from onepath.ops import attention as attention_op
from onepath.train.actor import Actor, Responses
from onepath.train.grpo import policy_loss
from onepath.train.metrics import Timer

GIB = 2 ** 30
TARGET = 1.10
STOCK_PATCHED = ("linear", "rmsnorm", "rope", "silu_mul", "attention", "logprobs")


def model_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       head_dim=args.head_dim, model_type="qwen3", rope_theta=1e6, tie_word_embeddings=True,
                       max_position_embeddings=args.seq_len + 1, eos_token_id=2)


def batch(args) -> Responses:
    """--sequences sequences of --seq-len fed tokens: a --prompt-len prompt and the rest completion."""
    g = torch.Generator().manual_seed(0)
    completion = args.seq_len - args.prompt_len + 1
    prompts = [torch.randint(3, args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.sequences)]
    completions = [torch.randint(3, args.vocab, (completion,), generator=g).tolist() for _ in range(args.sequences)]
    return Responses.build(prompts, completions, [SamplingParams(max_tokens=completion)] * args.sequences,
                           [[0.0] * completion] * args.sequences)


@contextmanager
def stock_autograd():
    """The ops' kernels run under torch's autograd: apply_kernel(kernel, reference, *x) = kernel(*x)."""
    import importlib
    modules = [importlib.import_module(f"onepath.ops.{name}") for name in STOCK_PATCHED]
    saved = [m.apply_kernel for m in modules]
    for m in modules:
        m.apply_kernel = lambda kernel, reference, *inputs: kernel(*inputs)
    try:
        yield
    finally:
        for m, f in zip(modules, saved):
            m.apply_kernel = f


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_mode(mode: str, args, r: Responses) -> dict:
    spec_mode = "baseline" if mode == "stock" else mode
    model = DenseDecoder(model_config(args), Ops(ExecutionSpec.default(spec_mode, args.device)),
                         max_positions=args.seq_len + 1)
    model.init_weights(seed=0)
    actor = Actor(model, block_size=16, lr=1e-6, recompute=args.recompute)
    device = model.device
    mask = r.mask.to(device)
    advantages = torch.linspace(-1.0, 1.0, len(r.prompt_ids), device=device)
    count = float(r.mask.sum())

    def loss_fn(rows, lp):
        return policy_loss(lp, lp.detach() - 0.01, advantages[rows], mask[rows], 0.2, count=count)

    timer = Timer(sync=(lambda: sync(args.device)))
    totals, phases = [], []
    with stock_autograd() if mode == "stock" else _nothing():
        for i in range(args.warmup + args.iters):
            if i == args.warmup:
                sync(args.device)
                if args.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                timer.metrics()
            sync(args.device)
            start = time.perf_counter()
            actor.backward(r, loss_fn, args.micro_batch_tokens or None, timer=timer, forward_phase="forward")
            with timer("optimizer"):
                actor.step()
            sync(args.device)
            if i >= args.warmup:
                totals.append(time.perf_counter() - start)
                phases.append(timer.metrics())
    tokens = sum(len(p) + len(c) - 1 for p, c in zip(r.prompt_ids, r.completion_ids))
    median = statistics.median(totals)
    out = {"median_s": median, "min_s": min(totals), "times_s": totals, "tokens_per_s": tokens / median,
           "phases_median_s": {k.removeprefix("timing_s/").replace("update", "loss_and_backward"):
                               statistics.median(p[k] for p in phases) for k in phases[0]}}
    if args.device == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / GIB
    del actor, model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


@contextmanager
def _nothing():
    yield


def attention_backward(args, r: Responses) -> dict:
    """One layer's attention backward over the batch: the wrappers' (reference) and SDPA's, median seconds."""
    device, dtype = args.device, ExecutionSpec.default("consistent", args.device).dtype
    fb, _, _ = ForwardBatch.for_completions(r.prompt_ids, r.completion_ids, 16, device)
    meta, tokens = fb.attn, fb.input_ids.shape[0]
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(tokens, h, args.head_dim, generator=g, device=device, dtype=dtype)
               for h in (args.heads, args.kv_heads, args.kv_heads))
    grad = torch.randn(tokens, args.heads, args.head_dim, generator=g, device=device, dtype=dtype)
    scale = args.head_dim ** -0.5

    def reference():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = attention_op.reference(*leaves, meta, scale, None)
        return torch.autograd.grad(out, leaves, grad)

    def sdpa():  # equal lengths here, so one batched call: [B, H, L, D]
        n = len(meta.context_lens)
        leaves = [x.detach().view(n, -1, *x.shape[1:]).transpose(1, 2).requires_grad_() for x in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale, enable_gqa=True)
        return torch.autograd.grad(out, leaves, grad.view(n, -1, *grad.shape[1:]).transpose(1, 2))

    result = {}
    for name, fn in (("reference", reference), ("sdpa", sdpa)):
        if name == "sdpa" and len(set(meta.context_lens)) != 1:
            continue
        times = []
        for i in range(args.warmup + args.iters):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        result[f"{name}_s_per_layer"] = statistics.median(times)
        result[f"{name}_s_all_layers"] = statistics.median(times) * args.layers
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: a smoke run")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda, cpu with --tiny")
    p.add_argument("--modes", nargs="+", default=["consistent", "baseline", "stock"],
                   choices=("consistent", "baseline", "stock"))
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512, help="tokens fed per sequence (prompt + completion - 1)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--micro-batch-tokens", type=int, default=0, help="train.micro_batch_tokens; 0 = one backward")
    p.add_argument("--recompute", action="store_true", help="train.recompute")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    if args.tiny:
        args.sequences, args.seq_len, args.prompt_len, args.vocab = 6, 40, 17, 61
        args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.head_dim = 48, 96, 2, 4, 2, 12
        args.iters, args.warmup = 3, 1
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU, or pass --tiny (or --device cpu) for a CPU smoke run")
    if not 1 <= args.prompt_len <= args.seq_len:
        sys.exit(f"--prompt-len {args.prompt_len} must be in [1, --seq-len {args.seq_len}]")

    r = batch(args)
    results = {}
    for mode in args.modes:
        results[mode] = time_mode(mode, args, r)
        print(f"{mode:>10}: {results[mode]['median_s'] * 1e3:9.1f} ms/step  "
              f"{results[mode]['tokens_per_s']:10.0f} tok/s  "
              + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in results[mode]["phases_median_s"].items())
              + (f"  peak {results[mode]['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in results[mode] else ""),
              flush=True)
    record = {
        "command": "python " + " ".join(sys.argv),
        **environment(args.device),
        "device": args.device,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "modes")},
        "tokens_per_step": sum(len(p) + len(c) - 1 for p, c in zip(r.prompt_ids, r.completion_ids)),
        "results": results,
    }
    if "consistent" in results and "baseline" in results:
        ratio = results["consistent"]["median_s"] / results["baseline"]["median_s"]
        record.update(ratio_consistent_over_baseline=ratio, target=TARGET, meets_target=ratio <= TARGET)
        print(f"consistent / baseline = {ratio:.3f} (target <= {TARGET})")
    if "consistent" in results and "stock" in results:
        record["ratio_consistent_over_stock"] = results["consistent"]["median_s"] / results["stock"]["median_s"]
    attn = record["attention_backward"] = attention_backward(args, r)
    attn["reference_share_of_step"] = attn["reference_s_all_layers"] / results[args.modes[0]]["median_s"]
    print("attention backward, all layers: "
          + "  ".join(f"{k.removesuffix('_s_all_layers')} {v * 1e3:.1f} ms" for k, v in attn.items()
                      if k.endswith("_s_all_layers"))
          + f"  (reference = {attn['reference_share_of_step']:.0%} of a {args.modes[0]} step)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
