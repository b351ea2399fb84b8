"""C8 and C9: the RL loop: two rollout -> update -> in-place sync steps, then checkpoint restore and
HF export, diff exactly 0 at every step."""
from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from onepath.consistency.gates.context import (GateContext, GateResult, first_difference, recompute, rollout,
                                               sampling_params)
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.models.checkpoint import load_state_dict, save_checkpoint
from onepath.train import checkpoint
from onepath.train.actor import Actor, Responses
from onepath.train.grpo import policy_loss


def train_step(actor: Actor, engine: LLMEngine | None, r: Responses, gen, lp: torch.Tensor | None = None) -> None:
    """One GRPO update on random advantages (from lp, the update's own forward, when given), then the
    in-place weight sync into the engine when given."""
    if lp is None:
        lp, _ = actor.logprobs(r)
    advantages = torch.randn(len(r.completion_ids), generator=gen).to(lp.device)
    loss, _ = policy_loss(lp, lp.detach(), advantages, r.mask.to(lp.device), 0.2)
    actor.update(loss)
    if engine is not None:
        engine.update_weights(actor.model.named_parameters())


def stale_parameters(engine_model, policy) -> list[str]:
    theirs = dict(policy.named_parameters())
    return [n for n, p in engine_model.named_parameters() if not torch.equal(p, theirs[n])]


def gate_c8(ctx: GateContext) -> GateResult:
    engine_model, policy = ctx.model(), ctx.model()
    gen = ctx.rng(8)
    prompts = [ctx.prompts(gen, 6, 1, 24) for _ in range(2)]
    engine = ctx.engine(engine_model, prompts[0] + prompts[1], 12)
    actor = Actor(policy, ctx.block_size, lr=ctx.lr)
    pointers = {n: p.data_ptr() for n, p in engine_model.named_parameters()}
    steps = []
    for step, batch in enumerate(prompts, 1):
        r, _ = rollout(engine, batch, sampling_params(len(batch), 12, ctx.seed + step), [100 * step + i for i in
                                                                                         range(len(batch))])
        lp, diff = recompute(actor, r)
        steps.append({"step": step, **diff})
        if lp is None:
            break
        train_step(actor, engine, r, gen, lp)
        steps[-1]["stale_after_sync"] = stale_parameters(engine_model, policy)
    moved = [n for n, p in engine_model.named_parameters() if p.data_ptr() != pointers[n]]
    problems = []
    for s in steps:
        if not s["exact"]:
            problems.append(f"step {s['step']} before its update: "
                            + (s.get("error") or f"tokens differing {s['tokens_differing_frac']:.3g}"))
        if s.get("stale_after_sync"):
            problems.append(f"after step {s['step']}'s sync the engine differs from the trainer on "
                            f"{s['stale_after_sync'][:3]}")
    if moved:
        problems.append(f"the sync replaced parameter storage instead of copying in place: {moved[:3]}")
    evidence = {"steps": steps, "sync_in_place": not moved, "moved": moved[:5]}
    tokens = ", ".join(str(s["valid_tokens"]) for s in steps)
    detail = "; ".join(problems) or (f"2 updates: diff 0 before each ({tokens} tokens), engine weights equal the "
                                     "trainer's after each in-place sync")
    return GateResult("C8", not problems, evidence, detail)


def gate_c9(ctx: GateContext) -> GateResult:
    engine_model, policy = ctx.model(), ctx.model()
    gen = ctx.rng(9)
    prompts = [ctx.prompts(gen, 6, 1, 24) for _ in range(2)]
    params = [sampling_params(6, 12, ctx.seed + k) for k in (1, 2)]
    engine = ctx.engine(engine_model, prompts[0] + prompts[1], 12)
    actor = Actor(policy, ctx.block_size, lr=ctx.lr)
    train_step(actor, engine, rollout(engine, prompts[0], params[0], list(range(6)))[0], gen)
    with tempfile.TemporaryDirectory(prefix="onepath-check-") as tmp:
        setup = SimpleNamespace(model_config=ctx.config, tokenizer=ctx.tokenizer, tokenizer_config=None)
        state = {"step": 1, "spec_hash": ctx.spec.hash(), "spec": ctx.spec.to_dict()}
        tensors = {"optimizer": actor.optimizer.state_dict(), "schedule": actor.schedule.state_dict()}
        path = checkpoint.save(Path(tmp), 1, policy.hf_state_dict(), setup, state, tensors, keep_last=1)
        saved_state, saved_tensors = checkpoint.load(path)
        restored = ctx.model(state=load_state_dict(path))
        resumed = Actor(restored, ctx.block_size, lr=ctx.lr)
        resumed.optimizer.load_state_dict(saved_tensors["optimizer"])
        resumed.schedule.load_state_dict(saved_tensors["schedule"])
        exported = Path(tmp) / "hf"
        save_checkpoint(exported, policy.hf_state_dict(), ctx.config, ctx.tokenizer)
        fresh = ctx.model(state=load_state_dict(exported))
    restored_differs = stale_parameters(restored, policy)
    ids = [100 + i for i in range(6)]
    r, outs = rollout(engine, prompts[1], params[1], ids)
    restore = recompute(resumed, r)[1]
    r_fresh, outs_fresh = rollout(ctx.engine(fresh, prompts[1], 12), prompts[1], params[1], ids)
    export = recompute(resumed, r_fresh)[1]
    export["equals_running_engine"] = all(first_difference(a, b) is None for a, b in zip(outs, outs_fresh))
    # exact resume: the restored and the uninterrupted trainer take the same next update, bit for bit
    # (plain sampling: a top-k set that misses a token must not stop this check when the engine is stale)
    seed = int(torch.randint(0, 2 ** 31, (1,), generator=gen))
    plain = Responses.build(r.prompt_ids, r.completion_ids, [SamplingParams()] * len(r.prompt_ids),
                            [[0.0] * len(c) for c in r.completion_ids])
    for a in (actor, resumed):
        train_step(a, None, plain, torch.Generator().manual_seed(seed))
    update_differs = stale_parameters(restored, policy)
    evidence = {"saved": "trainer checkpoint step_1 (HF layout + optimizer and LR-schedule state); HF export",
                "spec_hash_saved": saved_state["spec_hash"], "restored_weights_differ": restored_differs[:5],
                "first_step_after_restore": restore, "hf_export_fresh_engine": export,
                "next_update_differs": update_differs[:5]}
    problems = []
    if restored_differs:
        problems.append(f"restored weights differ from the saved trainer's: {restored_differs[:3]}")
    if not restore["exact"]:
        problems.append("first step after restore (the running engine against the restored trainer): "
                        + (restore.get("error") or f"tokens differing {restore['tokens_differing_frac']:.3g}"))
    if not export["equals_running_engine"]:
        problems.append("the HF export in a fresh engine samples other tokens or log-probs than the running engine")
    if not export["exact"]:
        problems.append("the HF export in a fresh engine against the restored trainer: "
                        + (export.get("error") or f"tokens differing {export['tokens_differing_frac']:.3g}"))
    if update_differs:
        problems.append(f"the next update after restore differs from the uninterrupted run's on {update_differs[:3]}")
    if saved_state["spec_hash"] != ctx.spec.hash():
        problems.append(f"the checkpoint's spec hash {saved_state['spec_hash']} is not the run's {ctx.spec.hash()}")
    detail = "; ".join(problems) or (f"restore: first step diff 0 over {restore['valid_tokens']} tokens, next update "
                                     "bitwise equal to the uninterrupted run's; HF export in a fresh engine samples "
                                     "the same tokens and log-probs, diff 0")
    return GateResult("C9", not problems, evidence, detail)
