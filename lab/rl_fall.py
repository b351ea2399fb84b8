"""Probe: why does the held-out reward fall under GRPO in the 150-step evidence runs (val/score 0.469 at step 0,
before any update, then 0.32-0.39 at step 10, in all four modes)? On the CPU, a small word-problems model from
onepath/configs/evidence-dense.yaml (its task, reward, data split, RL batch shape and lr; a smaller model and
batch), one warm start, then consistent runs from it driven step by step through GRPOTrainer.step.

`--part weights`: which weights the engine holds. At step 0 the trainer's; after each sync, at lr 0, the same
bits, and the held-out rows sampled with step 0's seed give the same tokens (so a step-0 validation saw the same
engine as a later one); at the config's lr, how many weight elements the update moved. For FP32 weights (the
CPU's), and for the GPU's layout emulated on the CPU (BF16 weights, FP32 master weights), each without and with
quant fp8+fp8_kv; on the first 32 held-out rows, 2 steps each.

`--part arms`: one run per arm, each changing one thing: lr 0 (the optimizer's; no update), the config's lr,
10x smaller and larger, the config's lr on advantages shuffled over the batch (an update of GRPO's size with
none of its signal). Validation every --val-every steps on the 256 held-out rows: the trainer's own
val/score (sampling seed = the step) and the same rows with step 0's seed (`val/seed0`: the step-0 record's
sampling noise, a paired comparison). One JSON per arm, written after each validation.

    python lab/rl_fall.py --part weights --out lab/results/rl-fall-cpu
    python lab/rl_fall.py --part arms --out lab/results/rl-fall-cpu [--only lr lr-shuffled]

One torch thread: on the shared 2-core machine more threads oversubscribe it (a 64-prompt rollout took 20 s
on two threads against another worker's process, 1.7 s on one).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onepath import cli  # noqa: E402
from onepath.config import load_run_config  # noqa: E402
from onepath.numerics.spec import ExecutionSpec  # noqa: E402
from onepath.train import trainer as trainer_module  # noqa: E402
from onepath.train.trainer import GRPOTrainer, prepare  # noqa: E402

CONFIG = "onepath/configs/evidence-dense.yaml"
SMALL = ["--device", "cpu", "--model.hidden_size", "128", "--model.intermediate_size", "384",
         "--model.num_hidden_layers", "2", "--model.num_attention_heads", "4", "--model.num_key_value_heads", "2",
         "--model.head_dim", "32", "--data.n_train", "6000", "--warm_start.own_rows", "4000",
         "--warm_start.batch_size", "64", "--warm_start.lr", "3e-3", "--warm_start.steps", "600",
         "--train.prompts_per_step", "16", "--rollout.num_blocks", "2048"]
KEYS = ("critic/score/mean", "critic/uniform_groups_frac", "actor/entropy", "actor/grad_norm", "actor/pg_loss",
        "response_length/mean")
ADVANTAGES = trainer_module.group_advantages


def shuffled(rewards, n, norm_by_std=True):
    """GRPO's advantages permuted over the batch: the update's size, none of its signal."""
    a = ADVANTAGES(rewards, n, norm_by_std)
    return a[torch.randperm(len(a), generator=torch.Generator().manual_seed(len(a)))]


@contextmanager
def gpu_precision():
    """ExecutionSpec.default gives the GPU's op dtypes (BF16 weights and GEMMs, FP32 log-probs) on the CPU."""
    default = ExecutionSpec.__dict__["default"]

    def bf16(cls, mode="consistent", device="cpu", quant=None):
        spec = dataclasses.replace(default.__func__(cls, mode, "cuda"), device=device)
        for preset in quant.split("+") if quant else ():
            spec = spec.with_quant(preset)
        return spec

    ExecutionSpec.default = classmethod(bf16)
    try:
        yield
    finally:
        ExecutionSpec.default = default


def validation(trainer: GRPOTrainer, step: int) -> tuple[float, str]:
    """(val/score, a hash of the sampled token ids) of GRPOTrainer.validate(step), whose sampling seed is step's."""
    outputs, generate = [], trainer.generate
    trainer.generate = lambda *a: outputs.append(generate(*a)) or outputs[-1]
    try:
        score = trainer.validate(step)["val/score"]
    finally:
        trainer.generate = generate
    return score, hashlib.sha256(json.dumps([o.token_ids for o in outputs[0]]).encode()).hexdigest()[:16]


def moved(start: dict, trainer: GRPOTrainer) -> dict:
    """The share of the engine's weight elements that differ from step 0's, and |W - W0| / |W0| over all."""
    now = {k: p.detach() for k, p in trainer.engine.model.named_parameters()}
    changed = sum(int((now[k] != w).sum()) for k, w in start.items())
    delta = sum(float((now[k].double() - w.double()).square().sum()) for k, w in start.items())
    norm = sum(float(w.double().square().sum()) for w in start.values())
    return {"engine/changed_frac": changed / sum(w.numel() for w in start.values()),
            "engine/rel_change": (delta / norm) ** 0.5}


def run(name: str, cfg, setup, run_dir: Path, steps: int, every: int, lr0: bool, save) -> dict:
    """Steps 1..steps of one consistent run; the result's records are step 0's validation and every step's metrics,
    with validations every `every` steps. save(result) after each validation."""
    shutil.rmtree(run_dir, ignore_errors=True)
    trainer = GRPOTrainer(cfg, "consistent", setup, run_dir)
    actor = trainer.actor
    if lr0:  # the config refuses lr 0: the optimizer takes it here, the rest of each step runs as it is
        actor.schedule.base_lrs = [0.0] * len(actor.optimizer.param_groups)
        for group in actor.optimizer.param_groups:
            group["lr"] = 0.0
    group = actor.optimizer.param_groups[0]
    policy = dict(trainer.policy.named_parameters())
    start = {k: p.detach().clone() for k, p in trainer.engine.model.named_parameters()}
    result = {"arm": name, "lr": 0.0 if lr0 else cfg.train.lr, "quant": cfg.quant, "optimizer": {
        "weights": str(next(iter(policy.values())).dtype),
        "masters": str(actor.master[0].dtype) if actor.master else None,
        "betas": list(group["betas"]), "eps": group["eps"], "weight_decay": group["weight_decay"],
        "max_grad_norm": actor.max_grad_norm, "lr_warmup_steps": cfg.train.lr_warmup_steps},
        "engine_equals_trainer_at_step_0": all(torch.equal(start[k], p) for k, p in policy.items()),
        "val_rows": len(setup.test_rows), "records": []}
    score, tokens = validation(trainer, 0)
    result["records"].append({"step": 0, "val/score": score, "val/seed0": score})
    print(f"[{name}] lr {result['lr']:g} step 0 val {score:.3f}", flush=True)
    start_time = time.perf_counter()
    for step in range(1, steps + 1):
        metrics = trainer.step(step)
        record = {"step": step, **{k: metrics[k] for k in KEYS}, **moved(start, trainer)}
        if step % every == 0 or step == steps:
            record["val/score"] = validation(trainer, step)[0]
            record["val/seed0"], same = validation(trainer, 0)
            record["val/seed0_same_tokens"] = same == tokens
            print(f"[{name}] step {step} " + " ".join(f"{k.split('/')[-1]} {v:.4g}" for k, v in record.items()
                                                       if isinstance(v, float)), flush=True)
        result["records"].append(record)
        result["wall_s"] = time.perf_counter() - start_time
        if "val/score" in record:
            save(result)
    return result


def summary(out: Path) -> str:
    """A table of the arms' JSONs in `out`: validations (trainer's seed / step 0's seed) and training means."""
    lines = ["arm          lr      val/score (seed = step) at 0,5,..   val/seed0 (step 0's seed)          "
             "reward 1-5 / last 5  entropy 1-5 / last 5  changed"]
    for path in sorted(out.glob("arms-*.json")):
        r = json.loads(path.read_text())
        val = [x for x in r["records"] if "val/score" in x]
        steps = [x for x in r["records"] if x["step"] > 0]
        mean = lambda key, part: sum(x[key] for x in part) / max(len(part), 1)  # noqa: E731
        scores = " ".join(f"{x['val/score']:.3f}" for x in val)
        paired = " ".join(f"{x['val/seed0']:.3f}" for x in val)
        lines.append(f"{r['arm']:<12} {r['lr']:<7g} {scores:<35} {paired:<34} "
                     f"{mean('critic/score/mean', steps[:5]):.3f} / {mean('critic/score/mean', steps[-5:]):.3f}    "
                     f"{mean('actor/entropy', steps[:5]):.3f} / {mean('actor/entropy', steps[-5:]):.3f}        "
                     f"{steps[-1]['engine/changed_frac']:.3f}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("weights", "arms", "summary"), required=True)
    p.add_argument("--out", required=True, help="a folder: one JSON per run")
    p.add_argument("--runs", default="/tmp/rl-fall", help="the warm start and the runs' directories")
    p.add_argument("--steps", type=int, default=20, help="arms: steps per arm")
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--only", nargs="*", help="which arms or weights variants, by name (default all)")
    args = p.parse_args()
    torch.set_num_threads(1)
    out, runs = Path(args.out), Path(args.runs)
    if args.part == "summary":
        (out / "summary.txt").write_text(summary(out) + "\n")
        print(summary(out))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if not (runs / "ws" / "warm_start" / "fingerprint.txt").exists():  # the warm start, as bench/evidence.sh makes it
        cli.main(["train", "--config", CONFIG, *SMALL, "--out", str(runs / "ws"), "--train.steps", "0", "--quiet"])
    shared = [*SMALL, "--model.path", str(runs / "ws" / "warm_start"), "--warm_start.steps", "0",
              "--train.val_every", "0", "--out", str(runs)]
    setup = prepare(load_run_config(CONFIG, shared), runs, progress=False)
    lr = load_run_config(CONFIG, shared).train.lr
    command = "python lab/rl_fall.py " + " ".join(sys.argv[1:])

    def save(result):
        result = {"command": command, "config": CONFIG, "settings": shared, "torch": torch.__version__, **result}
        name = result["arm"].replace("/", "-").replace("*", "x")
        (out / f"{args.part}-{name}.json").write_text(json.dumps(result, indent=1) + "\n")

    if args.part == "weights":
        rows = dataclasses.replace(setup, test_rows=setup.test_rows[:32])
        for precision in ("fp32", "bf16-masters"):
            for quant in (None, "fp8+fp8_kv"):
                cfg = load_run_config(CONFIG, [*shared, *(["--train.master_dtype", "float32"] if precision != "fp32"
                                                          else [])])
                cfg.quant = quant  # the config's is fp8+fp8_kv, and the command line has no null for it
                for lr0 in (True, False):
                    name = f"{precision}-{quant or 'noquant'}-{'lr0' if lr0 else 'lr'}"
                    if args.only and name not in args.only:
                        continue
                    with gpu_precision() if precision != "fp32" else nullcontext():
                        save(run(name, cfg, rows, runs / name, 2, 1, lr0, save))
        return 0
    arms = {"lr0": (lr, False), "lr": (lr, False), "lr-shuffled": (lr, True), "lrx10": (lr * 10, False),
            "lrx10-shuffled": (lr * 10, True), "lr-div10": (lr / 10, False)}
    for name in args.only or arms:
        arm_lr, shuffle = arms[name]
        cfg = load_run_config(CONFIG, [*shared, "--train.lr", f"{arm_lr:g}"])
        trainer_module.group_advantages = shuffled if shuffle else ADVANTAGES
        save(run(name, cfg, setup, runs / name, args.steps, args.val_every, name == "lr0", save))
    trainer_module.group_advantages = ADVANTAGES
    return 0


if __name__ == "__main__":
    sys.exit(main())
