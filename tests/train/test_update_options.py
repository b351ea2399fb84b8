"""train.recompute and train.micro_batch_tokens: neither moves a forward bit. Recomputation keeps
the gradients bit for bit too; micro-batches change only the gradients' summation order, so the
update matches the whole-batch one to float rounding. The baseline backend shows that micro-batch
size can move its bits (negative control)."""
import pytest
import torch

from onepath.config import LoggerSection, ModelSection, RolloutSection, TrainSection, load_run_config
from onepath.numerics.diff import is_exact
from onepath.engine.sampling_params import SamplingParams
from onepath.train.actor import Actor, Responses
from onepath.train.checkpoint import config_hash
from onepath.train.grpo import policy_loss
from onepath.train.trainer import GRPOTrainer, prepare
from tests.tiny import random_prompts, tiny_model

PARAMS = SamplingParams(max_tokens=12, temperature=0.9, seed=1)


def responses(count: int = 10, seed: int = 5) -> Responses:
    """Random prompts and completions of awkward lengths (the rollout's log-probs are unused here)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = random_prompts(gen, count, 1, 23)
    completions = random_prompts(gen, count, 1, 12)
    return Responses.build(prompts, completions, [PARAMS] * count, [[0.0] * len(c) for c in completions])


def one_update(mode: str, r: Responses, micro_batch_tokens=None, recompute=False, tied=False):
    """(log-probs, summed stats, gradients, weights after the step) of one update from the same weights."""
    actor = Actor(tiny_model(mode, seed=7, tie_word_embeddings=tied), block_size=16, lr=1e-2, recompute=recompute)
    advantages = torch.linspace(-1.0, 1.0, len(r.prompt_ids))
    count = float(r.mask.sum())

    def loss_fn(rows, lp):
        return policy_loss(lp, lp.detach() - 0.05, advantages[rows], r.mask[rows], 0.2, count=count)

    lp, _, stats = actor.backward(r, loss_fn, micro_batch_tokens)
    grads = {n: p.grad.clone() for n, p in actor.model.named_parameters()}
    actor.step()
    weights = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    return lp, stats, grads, weights


@pytest.mark.parametrize("tied", [False, True])
def test_recompute_keeps_logprobs_and_gradients_bitwise(tied):
    r = responses()
    plain = one_update("consistent", r, tied=tied)
    recomputed = one_update("consistent", r, recompute=True, tied=tied)
    assert torch.equal(plain[0], recomputed[0])
    assert plain[1] == recomputed[1]
    for name, g in plain[2].items():
        assert torch.equal(g, recomputed[2][name]), name
    for name, w in plain[3].items():
        assert torch.equal(w, recomputed[3][name]), name


def forward_saving(recompute: bool, r: Responses):
    """(layer forwards run, bytes autograd saved) over one forward with grad, then backward."""
    actor = Actor(tiny_model("consistent", seed=7), block_size=16, lr=1e-2, recompute=recompute)
    calls, saved = [], []
    for layer in actor.model.model.layers:
        layer.forward = (lambda f: lambda *a: (calls.append(1), f(*a))[1])(layer.forward)
    # a checkpoint's own hooks take its layer's tensors: the outer hook sees what stays saved
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.numel() * t.element_size()), t)[1],
                                                  lambda t: t):
        lp, _ = actor.logprobs(r)
    forwards = len(calls)
    lp.sum().backward()
    return forwards, len(calls), sum(saved)


def test_recompute_frees_layer_activations_and_runs_each_layer_again_in_backward():
    r = responses(6)
    plain, recompute = forward_saving(False, r), forward_saving(True, r)
    assert plain[:2] == (2, 2) and recompute[:2] == (2, 4)
    assert recompute[2] < plain[2] / 5
    calls = []
    actor = Actor(tiny_model("consistent", seed=7), block_size=16, lr=1e-2, recompute=True)
    actor.model.model.layers[0].forward = (lambda f: lambda *a: (calls.append(1), f(*a))[1])(
        actor.model.model.layers[0].forward)
    with torch.no_grad():  # nothing to recompute: a plain forward
        actor.logprobs(r)
    assert len(calls) == 1


def test_recompute_refuses_weights_changed_since_the_forward():
    actor = Actor(tiny_model("consistent", seed=7), block_size=16, lr=1e-2, recompute=True)
    lp, _ = actor.logprobs(responses(3))
    with torch.no_grad():
        actor.model.model.layers[0].mlp.up_proj.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place between its forward and its backward"):
        lp.sum().backward()


def test_micro_batched_update_matches_the_whole_batch():
    r = responses(12)
    whole_lp, whole, whole_grads, whole_weights = one_update("consistent", r)
    assert len(Actor.micro_batches(r, 20)) > 3
    split_lp, split, split_grads, split_weights = one_update("consistent", r, micro_batch_tokens=20)
    lr = 1e-2
    assert torch.equal(whole_lp, split_lp)  # forward bits do not depend on the micro-batch
    for key in whole:
        assert abs(whole[key] - split[key]) <= 1e-6 * max(1.0, abs(whole[key])), key
    for name, g in whole_grads.items():
        assert torch.allclose(g, split_grads[name], rtol=1e-5, atol=1e-7), name
    for name, w in whole_weights.items():
        # Adam's first step is lr * g / (|g| + eps): where g is near 0 its rounding moves the step by
        # up to lr, so the weights agree to a share of lr, and on average far closer
        diff = (w - split_weights[name]).abs()
        assert diff.max() <= 0.1 * lr and diff.mean() <= 1e-4 * lr, name
    # and the loss really was split: one backward of the whole batch is a different sum
    assert any(not torch.equal(g, split_grads[n]) for n, g in whole_grads.items())


def test_negative_control_baseline_logprobs_move_with_micro_batch_size():
    r = responses(12)
    actor = Actor(tiny_model("baseline", seed=7), block_size=16, lr=1e-2)
    with torch.no_grad():
        whole, _ = actor.logprobs(r)
        split, _ = actor.logprobs(r, max_tokens=20)
    assert not torch.equal(whole, split)


def test_micro_batches_keep_whole_sequences_in_order():
    r = responses(12)
    groups = Actor.micro_batches(r, 40)
    assert [i for g in groups for i in g] == list(range(12))
    lengths = [len(p) + len(c) for p, c in zip(r.prompt_ids, r.completion_ids)]
    assert all(len(g) == 1 or sum(lengths[i] for i in g) <= 40 for g in groups)
    assert Actor.micro_batches(r, 0) == Actor.micro_batches(r, None) == [list(range(12))]


def test_mis_micro_batches_renormalise_to_the_whole_step_mean():
    """MIS takes tokens out of the mean after the forward: shares normalised by every valid token,
    then scaled by valid / kept, give the whole-batch loss over the kept tokens."""
    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(6, 5, generator=gen, requires_grad=True)
    old, adv = lp.detach() + 0.1 * torch.randn(6, 5, generator=gen), torch.randn(6, generator=gen)
    mask = torch.rand(6, 5, generator=gen) > 0.2
    keep = mask & (torch.rand(6, 5, generator=gen) > 0.3)
    whole, _ = policy_loss(lp, old, adv, keep, 0.2)
    (whole_grad,) = torch.autograd.grad(whole, lp)
    n, k = float(mask.sum()), float(keep.sum())
    parts = [policy_loss(lp[rows], old[rows], adv[rows], keep[rows], 0.2, count=n)[0]
             for rows in ([0, 1], [2, 3, 4], [5])]
    split = sum(parts) * (n / k)
    (split_grad,) = torch.autograd.grad(split, lp)
    assert torch.allclose(whole, split, rtol=1e-6) and torch.allclose(whole_grad, split_grad, rtol=1e-6, atol=1e-8)


def run(tmp_path, name, *extra):
    cfg = load_run_config(None, ["--warm_start.steps", "0", "--train.steps", "2", "--train.prompts_per_step", "4",
                                 "--rollout.n", "4", "--data.n_train", "64", "--data.n_test", "8",
                                 "--train.val_every", "0", "--out", str(tmp_path), *extra])
    trainer = GRPOTrainer(cfg, cfg.mode, prepare(cfg, tmp_path, progress=False), tmp_path / name)
    return trainer.run(progress=False)


def test_trainer_with_recompute_and_micro_batches(tmp_path, reward):
    whole = run(tmp_path, "whole", "--train.reward", reward)
    split = run(tmp_path, "split", "--train.reward", reward, "--train.micro_batch_tokens", "30",
                "--train.recompute", "true")
    assert all(is_exact(m) for m in whole + split)
    first, other = whole[0], split[0]  # same weights at step 1, so the same samples and the same loss
    assert first["critic/score/mean"] == other["critic/score/mean"]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert abs(first[key] - other[key]) <= 1e-5 * max(1.0, abs(first[key])), key
    for m in whole + split:
        assert m["timing_s/step"] >= m["timing_s/gen"] + m["timing_s/update"]
        assert m["perf/max_rss_gib"] > 0 and "perf/peak_memory_gib" not in m  # CPU: process peak RSS


def test_trainer_baseline_mis_with_micro_batches_runs(tmp_path, reward):
    history = run(tmp_path, "mis", "--mode", "baseline", "--train.reward", reward, "--train.micro_batch_tokens", "30",
                  "--train.rollout_rs", "token", "--train.rollout_rs_threshold", "1.0")
    # baseline log-probs differ from the rollout's, so MIS at threshold 1 masks tokens
    assert any(m["rollout_corr/rollout_rs_masked_fraction"] > 0 for m in history)
    assert all(torch.isfinite(torch.tensor(m["actor/pg_loss"])) for m in history)


def test_multiturn_micro_batches_and_recompute(tmp_path, reward):
    turns = ["--rollout.env", "calculator", "--rollout.max_turns", "3", "--rollout.block_size", "4",
             "--train.reward", reward]
    whole = run(tmp_path, "whole", *turns)
    split = run(tmp_path, "split", *turns, "--train.micro_batch_tokens", "30", "--train.recompute", "true")
    assert all(is_exact(m) for m in whole + split)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert abs(whole[0][key] - split[0][key]) <= 1e-5 * max(1.0, abs(whole[0][key])), key


@pytest.mark.parametrize("make, match", [
    (lambda: TrainSection(micro_batch_tokens=-1), r"train.micro_batch_tokens = -1 must be >= 0"),
    (lambda: RolloutSection(gpu_memory_utilization=1.5), r"rollout.gpu_memory_utilization = 1.5 must be in \(0, 1\]"),
    (lambda: ModelSection(hidden_size=100, num_attention_heads=16), r"or set model.head_dim"),
    (lambda: ModelSection(head_dim=7), r"model.head_dim = 7 must be an even number"),
    (lambda: LoggerSection(project=""), r"logger.project = '' is empty"),
    (lambda: ModelSection(model_type="qwen3_moe"), r"model.num_experts = 0 must be >= 1 for model.model_type"),
    (lambda: ModelSection(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=8, num_experts_per_tok=5),
     r"model.num_experts_per_tok = 5 must be in \[1, model.num_experts = 4\]"),
])
def test_option_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_option_values_and_resume_compatibility():
    assert ModelSection(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128).head_dim == 128
    assert RolloutSection(num_blocks=None).num_blocks is None
    cfg = load_run_config(None, ["--rollout.num_blocks", "null", "--rollout.cuda_graphs", "false",
                                 "--train.micro_batch_tokens", "0", "--logger.wandb", "true"])
    assert (cfg.rollout.num_blocks, cfg.rollout.cuda_graphs, cfg.train.micro_batch_tokens) == (None, False, None)
    # recompute, logging and engine capacity move no bit: a resumed run may change them; micro-batches may not
    base = load_run_config(None, [])
    assert config_hash(cfg) == config_hash(load_run_config(None, ["--train.recompute", "true"])) == config_hash(base)
    assert config_hash(load_run_config(None, ["--train.micro_batch_tokens", "64"])) != config_hash(base)
