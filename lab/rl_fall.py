"""Probe: why does the held-out reward fall under GRPO in the 150-step evidence runs (val/score 0.469 at step 0,
before any update, then 0.32-0.39 at step 10, in all four modes)? On the CPU, a small word-problems model with
onepath/configs/evidence-dense.yaml's task, reward, data split, RL batch shape, optimizer and lr (SMALL: hidden
128, 2 layers, 16 prompts x 8 a step), one warm start, then consistent runs from it, step by step through
GRPOTrainer.step.

`--part weights`: which weights the engine holds. At step 0 the trainer's; after each sync, at lr 0, the same
bits, and the held-out rows sampled with step 0's seed give the same tokens (a step-0 validation saw the same
engine a later one does); at the config's lr, the share of weight elements one update moves. For FP32 weights
(the CPU's) and for the GPU's layout emulated on the CPU (BF16 weights, FP32 master weights), each without and
with quant fp8+fp8_kv; on the first 32 held-out rows, 2 steps each.

`--part arms`: one run per arm, each changing one thing: lr 0 (the optimizer's: no update), the config's lr,
10x smaller, 10x larger, and the config's and 10x its lr on advantages shuffled over the batch (an update of
GRPO's size with none of its signal). Every --val-every steps the 256 held-out rows: the trainer's own
val/score (its sampling seed is the step's) and the same rows under step 0's seed (`val/seed0`: the step-0
record's sampling noise, a paired comparison). One JSON per arm, written at each validation; `--part summary`
tables them.

    python lab/rl_fall.py --part weights --out lab/results/rl-fall-cpu
    python lab/rl_fall.py --part arms --out lab/results/rl-fall-cpu [--only lrx10 lrx10-shuffled]
    python lab/rl_fall.py --part summary --out lab/results/rl-fall-cpu

One torch thread: on the shared 2-core machine more oversubscribe it (a 64-prompt rollout took 20 s on two
threads beside another worker's process, 1.7 s on one). `--scale gpu` runs the evidence config as it is (untried).
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
from onepath.engine.sampling_params import SamplingParams  # noqa: E402
from onepath.models.checkpoint import load_state_dict  # noqa: E402
from onepath.numerics.spec import ExecutionSpec  # noqa: E402
from onepath.tasks import word_problems  # noqa: E402
from onepath.train import trainer as trainer_module  # noqa: E402
from onepath.train.actor import Actor, Responses  # noqa: E402
from onepath.train.grpo import policy_loss  # noqa: E402
from onepath.train.trainer import GRPOTrainer, build_model, prepare, supervised_completion  # noqa: E402

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


def one_step_reach(setup, model_args: list[str], state: dict | None, lr: float) -> dict:
    """One AdamW step (no warm-up) on 32 rows' worked solutions with random +-1 advantages (pure noise): the mean
    |change| and change of the log-probs of 32 other rows' solutions (teacher-forced), per token."""
    mc = load_run_config(CONFIG, [*SMALL, *model_args]).model.architecture(
        vocab_size=setup.tokenizer.get_vocab_size(), bos_token_id=word_problems.BOS_ID,
        eos_token_id=word_problems.EOS_ID, pad_token_id=word_problems.PAD_ID)

    def batch(rows):
        completions = [setup.tokenizer.encode(supervised_completion(r), add_special_tokens=False).ids
                       + [word_problems.EOS_ID] for r in rows]
        return Responses.build([setup.prompts.ids(r) for r in rows], completions, [SamplingParams()] * len(rows),
                               [[0.0] * len(c) for c in completions])

    train, held = batch(setup.train_rows[:32]), batch(setup.train_rows[100:132])
    advantages = torch.tensor([1.0, -1.0] * 16)[torch.randperm(32, generator=torch.Generator().manual_seed(0))]
    actor = Actor(build_model(mc, ExecutionSpec.default("baseline", "cpu"), 384, state), 16, lr)
    with torch.no_grad():
        before, _ = actor.logprobs(held)
    count = float(train.mask.sum())
    actor.backward(train, lambda rows, lp: policy_loss(lp, lp.detach(), advantages[rows], train.mask[rows], 0.2,
                                                       count=count))
    grad_norm = actor.step()
    with torch.no_grad():
        after, _ = actor.logprobs(held)
    change = (after - before)[held.mask]
    return {"lr": lr, "held_out_mean_abs_dlogp": float(change.abs().mean()),
            "held_out_mean_dlogp": float(change.mean()), "held_out_mean_logp": float(before[held.mask].mean()),
            "grad_norm": grad_norm}


def summary(out: Path) -> str:
    """Tables of the JSONs in `out`: the arms (validations under each step's seed and under step 0's, training
    means), the weights the engine holds, one step's reach."""
    lines = ["arm             lr      val/score (seed = step) at 0,5,.. val/seed0 (step 0's seed)      "
             "reward 1-5 / 16-20  entropy 1-5 / 16-20"]
    for path in sorted(out.glob("arms-*.json")):
        r = json.loads(path.read_text())
        val = [x for x in r["records"] if "val/score" in x]
        steps = [x for x in r["records"] if x["step"] > 0]
        mean = lambda key, part: sum(x[key] for x in part) / max(len(part), 1)  # noqa: E731
        scores = " ".join(f"{x['val/score']:.3f}" for x in val)
        paired = " ".join(f"{x['val/seed0']:.3f}" for x in val)
        lines.append(f"{r['arm']:<15} {r['lr']:<7g} {scores:<33} {paired:<30} "
                     f"{mean('critic/score/mean', steps[:5]):.3f} / {mean('critic/score/mean', steps[-5:]):.3f}    "
                     f"{mean('actor/entropy', steps[:5]):.3f} / {mean('actor/entropy', steps[-5:]):.3f}")
    lines += ["", "weights (32 held-out rows)        engine = trainer at 0   engine's elements moved at steps 1, 2   "
              "step 0's seed, same tokens at 1, 2"]
    for path in sorted(out.glob("weights-*.json")):
        r = json.loads(path.read_text())
        steps = r["records"][1:]
        moved_frac = " ".join(f"{x['engine/changed_frac']:.4f}" for x in steps)
        same = " ".join(str(x["val/seed0_same_tokens"]) for x in steps)
        lines.append(f"{r['arm']:<33} {str(r['engine_equals_trainer_at_step_0']):<23} {moved_frac:<39} {same}")
    for path in sorted(out.glob("reach-*.json")):
        lines += ["", "one noise-only AdamW step       lr      held-out mean |dlogp| / dlogp a token"]
        lines += [f"{c['model']:<31} {c['lr']:<7g} {c['held_out_mean_abs_dlogp']:.4f} / {c['held_out_mean_dlogp']:+.4f}"
                  for c in json.loads(path.read_text())["cases"]]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("weights", "arms", "reach", "summary"), required=True)
    p.add_argument("--scale", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: the small model (SMALL); gpu: the evidence config as it is (not yet run)")
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
    scale = SMALL if args.scale == "cpu" else []
    if not (runs / "ws" / "warm_start" / "fingerprint.txt").exists():  # the warm start, as bench/evidence.sh makes it
        cli.main(["train", "--config", CONFIG, *scale, "--out", str(runs / "ws"), "--train.steps", "0", "--quiet"])
    shared = [*scale, "--model.path", str(runs / "ws" / "warm_start"), "--warm_start.steps", "0",
              "--train.val_every", "0", "--out", str(runs)]
    setup = prepare(load_run_config(CONFIG, shared), runs, progress=False)
    lr = load_run_config(CONFIG, shared).train.lr
    command = "python lab/rl_fall.py " + " ".join(sys.argv[1:])

    def save(result):
        result = {"command": command, "config": CONFIG, "settings": shared, "torch": torch.__version__, **result}
        name = result["arm"].replace("+", "-")
        (out / f"{args.part}-{name}.json").write_text(json.dumps(result, indent=1) + "\n")

    if args.part == "reach":
        evidence = load_run_config(CONFIG, []).model  # the evidence model's shape, put back over SMALL's
        keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim")
        shape = [f"--model.{k}={getattr(evidence, k)}" for k in keys]
        warm = load_state_dict(runs / "ws" / "warm_start")
        cases = [("small, init", [], None, lr), ("small, init", [], None, 10 * lr), ("small, warm start", [], warm, lr),
                 ("small, warm start", [], warm, 10 * lr), ("evidence shape, init", shape, None, lr)]
        rows = []
        for name, model_args, state, step_lr in cases:
            rows.append({"model": name, **one_step_reach(setup, model_args, state, step_lr)})
            print(rows[-1], flush=True)
        save({"arm": "all", "cases": rows})
        return 0
    if args.part == "weights":
        rows = dataclasses.replace(setup, test_rows=setup.test_rows[:32])
        # the config's master_dtype is float32: masters only under BF16 weights (the GPU's, or emulated here)
        for precision in ("fp32", "bf16-masters") if args.scale == "cpu" else ("gpu",):
            for quant in (None, "fp8+fp8_kv"):
                cfg = load_run_config(CONFIG, shared)
                cfg.quant = quant  # the config's is fp8+fp8_kv, and the command line has no null for it
                for lr0 in (True, False):
                    name = f"{precision}-{quant or 'noquant'}-{'lr0' if lr0 else 'lr'}"
                    if args.only and name not in args.only:
                        continue
                    with gpu_precision() if precision == "bf16-masters" else nullcontext():
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
