"""The trainer recomputes the engine's log-probs bit for bit, before and after an update + in-place sync.
The baseline backend, same weights and tokens, must differ (negative control)."""
import torch

from onepath.config import load_run_config
from onepath.numerics.diff import is_exact, rollout_diff
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.train.actor import Actor, Responses
from onepath.train.grpo import policy_loss
from onepath.train.trainer import GRPOTrainer, prepare
from tests.tiny import random_prompts, tiny_model

PARAMS = [SamplingParams(max_tokens=20, seed=1), SamplingParams(max_tokens=20, temperature=0.8, top_k=7, seed=2),
          SamplingParams(max_tokens=20, temperature=1.2, top_p=0.85, seed=3)]


def rollout_and_recompute(mode: str, update: bool):
    return engine_vs_trainer(tiny_model(mode, seed=4), tiny_model(mode, seed=4), update)


def engine_vs_trainer(engine_model, policy, update: bool, sampling=PARAMS, prompts: int = 12, num_blocks: int = 256,
                      max_model_len: int = 128, after_update=None):
    """Rollout diff metrics of one step (two with update: an update + in-place sync between them), the
    engine sampling with engine_model, the trainer recomputing with policy; after_update(before) sees the
    policy's parameters from before the update."""
    engine = LLMEngine(engine_model, num_blocks=num_blocks, block_size=16,
                       scheduler=SchedulerConfig(max_model_len=max_model_len))
    actor = Actor(policy, block_size=16, lr=1e-2)
    gen = torch.Generator().manual_seed(9)
    diffs = []
    for step in range(2 if update else 1):
        step_prompts = random_prompts(gen, prompts)
        params = [sampling[i % len(sampling)] for i in range(len(step_prompts))]
        outs = engine.generate(step_prompts, params, request_ids=[step * 100 + i for i in range(len(step_prompts))])
        r = Responses.build([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], params,
                            [o.logprobs for o in outs])
        lp, _ = actor.logprobs(r)  # on the policy's device; the rollout's tensors on the CPU
        diffs.append(rollout_diff(r.rollout_logprobs, lp.detach().cpu(), r.mask))
        if update:
            advantages = torch.randn(len(outs), generator=gen).to(lp.device)
            loss, _ = policy_loss(lp, lp.detach(), advantages, r.mask.to(lp.device), 0.2)
            before = {n: p.detach().clone() for n, p in policy.named_parameters()} if after_update else None
            actor.update(loss)
            if after_update:
                after_update(before)
            engine.update_weights(policy.named_parameters())
    return diffs


def test_trainer_logprobs_equal_engine_logprobs():
    (metrics,) = rollout_and_recompute("consistent", update=False)
    assert metrics["rollout_corr/valid_tokens"] > 100
    assert is_exact(metrics), metrics


def test_after_update_and_in_place_sync_still_equal():
    before, after = rollout_and_recompute("consistent", update=True)
    assert is_exact(before) and is_exact(after), (before, after)


def test_negative_control_baseline_trainer_differs():
    (metrics,) = rollout_and_recompute("baseline", update=False)
    assert metrics["rollout_corr/tokens_differing_frac"] > 0


def test_sync_copies_into_the_same_storage():
    engine_model, policy = tiny_model("consistent", seed=1), tiny_model("consistent", seed=2)
    engine = LLMEngine(engine_model, num_blocks=8, block_size=16, scheduler=SchedulerConfig(max_model_len=64))
    pointers = {n: p.data_ptr() for n, p in engine_model.named_parameters()}
    engine.update_weights(policy.named_parameters())
    for name, p in engine_model.named_parameters():
        assert p.data_ptr() == pointers[name]
        assert torch.equal(p, dict(policy.named_parameters())[name])


def grpo_run(mode, tmp_path):
    cfg = load_run_config(None, ["--warm_start.steps", "20", "--train.steps", "2", "--train.prompts_per_step", "4",
                                 "--rollout.n", "4", "--data.n_train", "64", "--data.n_test", "8",
                                 "--rollout.top_p", "0.9", "--rollout.prefill_chunk_size", "3",
                                 "--out", str(tmp_path)])
    setup = prepare(cfg, tmp_path, progress=False)
    return GRPOTrainer(cfg, mode, setup, tmp_path / mode).run(progress=False)


def test_grpo_steps_keep_diff_exactly_zero(tmp_path):
    history = grpo_run("consistent", tmp_path)
    assert len(history) == 2 and all(is_exact(m) for m in history)
    assert (tmp_path / "consistent" / "metrics.jsonl").read_text().count("\n") == 2
    assert (tmp_path / "consistent" / "step_2" / "model.safetensors").exists()


def test_grpo_negative_control_baseline_reports_a_diff(tmp_path):
    history = grpo_run("baseline", tmp_path)
    assert any(m["training/rollout_probs_diff_max"] > 0 for m in history)


def test_micro_batches_and_head_chunks_do_not_move_a_bit():
    engine_model, policy = tiny_model("consistent", seed=6), tiny_model("consistent", seed=6)
    engine = LLMEngine(engine_model, num_blocks=256, block_size=16, scheduler=SchedulerConfig(max_model_len=128))
    prompts = random_prompts(torch.Generator().manual_seed(3), 9)
    outs = engine.generate(prompts, PARAMS[2], request_ids=list(range(9)))
    r = Responses.build([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], [PARAMS[2]] * 9,
                        [o.logprobs for o in outs])
    actor = Actor(policy, block_size=16, lr=1e-3)
    with torch.no_grad():
        whole, _ = actor.logprobs(r)
        split, _ = actor.logprobs(r, max_tokens=50, head_rows=7)
    assert len(actor.micro_batches(r, 50)) > 2
    assert torch.equal(whole, split) and torch.equal(whole, r.rollout_logprobs)
