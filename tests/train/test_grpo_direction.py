"""One GRPO step moves the policy towards the rewarded responses: through the real train_step (rollout,
reward, group advantages, loss rows, AdamW step, weight sync), the trainer's log-probs of the very
responses it sampled rise for those the planted reward paid and fall for the others. This checks the
whole alignment responses <-> rewards <-> groups <-> advantages <-> loss rows, which every bitwise
check passes blind (a shuffled advantage leaves diff = 0). Negative control: the opposite reward, on
the same responses (same weights, same seeds), moves them the opposite way."""
import dataclasses

import pytest
import torch

from onepath.config import load_run_config
from onepath.train.rewards import get_reward
from onepath.train.trainer import GRPOTrainer, prepare

# about half of a random model's first characters are of each parity: mixed groups from the first step
PARITY = ("def even(prompt, completion, **row):\n    return float(bool(completion) and ord(completion[0]) % 2 == 0)\n\n"
          "def odd(prompt, completion, **row):\n    return 1.0 - even(prompt, completion, **row)\n")


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("reward") / "parity.py"
    path.write_text(PARITY)
    return str(path)


def config(out, reward: str):
    # warmup 0: the first step runs the full lr, large enough that each response's change is the update's
    return load_run_config(None, ["--warm_start.steps", "0", "--train.prompts_per_step", "8", "--rollout.n", "8",
                                  "--data.n_train", "64", "--data.n_test", "8", "--train.val_every", "0",
                                  "--train.lr", "1e-3", "--train.lr_warmup_steps", "0", "--train.reward", reward,
                                  "--out", str(out)])


def first_step(tmp_path, reward: str, name: str):
    """(responses, rewards, each response's log-prob change [B]) of one train_step; the change is of the
    trainer's log-prob summed over the response's tokens, from the weights that sampled to the stepped ones."""
    cfg = config(tmp_path, reward)
    setup = prepare(cfg, tmp_path, progress=False)
    setup = dataclasses.replace(setup, reward_fn=get_reward(reward))
    trainer = GRPOTrainer(cfg, "consistent", setup, tmp_path / name)
    seen = []
    sample_batch = trainer.sample_batch
    trainer.sample_batch = lambda step: seen.append(sample_batch(step)) or seen[-1]
    metrics = trainer.train_step(1)
    responses, rewards, _ = seen[0]
    assert metrics["critic/uniform_groups_frac"] < 0.5, "too few mixed groups for a signal"
    with torch.no_grad():
        after, _ = trainer.actor.logprobs(responses)
    # the engine, after the sync, holds the stepped weights: the next rollout samples from them
    engine = dict(trainer.engine.model.named_parameters())
    assert all(torch.equal(p, engine[name]) for name, p in trainer.policy.named_parameters())
    change = ((after - responses.rollout_logprobs) * responses.mask).sum(1)
    return responses, rewards, change


def agreeing(advantages: torch.Tensor, change: torch.Tensor) -> float:
    """The share of responses with an advantage whose log-prob moved the advantage's way."""
    moved = advantages != 0
    return float((torch.sign(change[moved]) == torch.sign(advantages[moved])).float().mean())


def test_one_step_raises_the_rewarded_responses_and_the_opposite_reward_lowers_them(tmp_path, parity):
    responses, even, change = first_step(tmp_path, f"{parity}:even", "even")
    same, odd, opposite = first_step(tmp_path, f"{parity}:odd", "odd")
    assert same.completion_ids == responses.completion_ids and torch.equal(odd, 1 - even)
    # GRPO's advantages from the rewards, group by group, written out here rather than taken from grpo.py
    groups = even.view(-1, 8)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).flatten()
    paid = even.bool()
    assert change[paid].mean() > change[~paid].mean() + 0.5
    assert (advantages * change).sum() > 0 and agreeing(advantages, change) > 0.8
    assert opposite[paid].mean() < opposite[~paid].mean() - 0.5
    assert (advantages * opposite).sum() < 0 and agreeing(-advantages, opposite) > 0.8
