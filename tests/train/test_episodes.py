"""Multi-turn episodes with a calculator tool: the trainer's log-probs equal the rollout's on every
policy token (baseline differs: negative control), env tokens are outside the mask, later turns are
served from the prefix cache, and an episode's tokens do not depend on its batch."""
import pytest
import torch

from onepath.numerics.diff import is_exact, rollout_diff
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.tasks import arithmetic
from onepath.tasks.calculator import CalculatorEnv, calculate, last_expression, parse
from onepath.train.actor import Actor, Responses
from onepath.train.episodes import (Episode, episode_metrics, episode_responses, masked_logprobs, run_episodes,
                                    turn_request_id)
from onepath.train.grpo import policy_loss
from tests.tiny import tiny_model

BLOCK = 8
TOKENIZER = arithmetic.build_tokenizer()
EQ = TOKENIZER.token_to_id("=")
PARAMS = [SamplingParams(max_tokens=8, stop_token_ids=(EQ,), seed=1),
          SamplingParams(max_tokens=8, stop_token_ids=(EQ,), temperature=0.8, top_k=7, seed=2),
          SamplingParams(max_tokens=8, stop_token_ids=(EQ,), temperature=1.2, top_p=0.85, seed=3)]


def model(mode, seed=4):
    # the arithmetic alphabet, so the calculator can read what the policy writes
    return tiny_model(mode, seed=seed, vocab_size=TOKENIZER.get_vocab_size(), eos_token_id=arithmetic.EOS_ID)


def engine(m, enable_prefix_caching=True, max_model_len=128):
    return LLMEngine(m, num_blocks=512, block_size=BLOCK, scheduler=SchedulerConfig(max_model_len=max_model_len),
                     enable_prefix_caching=enable_prefix_caching)


def prompts(count=12, seed=0):
    rows = arithmetic.make_problems(count, seed, ops=("+", "-", "*"))
    return [TOKENIZER.encode(r["prompt"][0]["content"]).ids for r in rows]


def params_for(n):
    return [PARAMS[i % len(PARAMS)] for i in range(n)]


def rollout(mode, eng=None, ps=None, ids=None, max_turns=3):
    eng = eng or engine(model(mode))
    ps = ps or prompts()
    ids = list(range(100, 100 + len(ps))) if ids is None else ids
    return run_episodes(eng, ps, CalculatorEnv(), params_for(len(ps)), max_turns, ids), eng


def recompute(mode, episodes):
    r = episode_responses(episodes, params_for(len(episodes)))
    actor = Actor(model(mode), block_size=BLOCK, lr=1e-2)
    lp, _ = masked_logprobs(actor, r)
    return r, lp, actor


def test_trainer_equals_engine_on_every_policy_token():
    episodes, eng = rollout("consistent")
    assert sum(e.turns == 3 for e in episodes) >= 6 and all(e.turns >= 1 for e in episodes)
    r, lp, _ = recompute("consistent", episodes)
    metrics = rollout_diff(r.rollout_logprobs, lp.detach(), r.mask)
    assert metrics["rollout_corr/valid_tokens"] > 150
    assert is_exact(metrics), metrics
    assert torch.equal(lp.detach()[r.mask], r.rollout_logprobs[r.mask])


def test_still_equal_after_an_update_and_sync():
    eng, actor = engine(model("consistent")), Actor(model("consistent"), block_size=BLOCK, lr=1e-2)
    for step in range(2):
        ps = prompts(seed=step)
        episodes = run_episodes(eng, ps, CalculatorEnv(), params_for(len(ps)), 3,
                                [step * 1000 + i for i in range(len(ps))])
        r = episode_responses(episodes, params_for(len(ps)))
        assert len(actor.micro_batches(r, 60)) > 2
        lp, _ = masked_logprobs(actor, r, max_tokens=60, head_rows=13)
        assert is_exact(rollout_diff(r.rollout_logprobs, lp.detach(), r.mask))
        loss, _ = policy_loss(lp, lp.detach(), torch.randn(len(ps), generator=torch.Generator().manual_seed(step)),
                              r.mask, 0.2)
        actor.update(loss)
        eng.update_weights(actor.model.named_parameters())


def test_negative_control_baseline_trainer_differs():
    episodes, _ = rollout("baseline")
    r, lp, _ = recompute("baseline", episodes)
    assert rollout_diff(r.rollout_logprobs, lp.detach(), r.mask)["rollout_corr/tokens_differing_frac"] > 0


def test_env_tokens_are_outside_the_mask():
    episodes, _ = rollout("consistent")
    r, lp, _ = recompute("consistent", episodes)
    env = CalculatorEnv()
    num_env = 0
    for i, e in enumerate(episodes):
        policy = torch.zeros(len(e), dtype=torch.bool)
        for turn, (start, end) in enumerate(e.segments):
            policy[start:end] = True
            if turn + 1 < e.turns:  # the tokens after a non-final turn are the calculator's reply
                replay = Episode(e.episode_id, e.token_ids[:end], e.num_prompt_tokens, [], [], e.segments[:turn + 1])
                reply = env.step(replay)[0]
                assert e.token_ids[end:e.segments[turn + 1][0]] == reply
                num_env += len(reply)
        assert e.policy_mask == policy.tolist()
        assert [x for x, m in zip(e.logprobs, e.policy_mask) if not m] == [0.0] * (len(e) - int(policy.sum()))
        n = len(e) - e.num_prompt_tokens
        assert torch.equal(r.mask[i, :n], policy[e.num_prompt_tokens:]) and not r.mask[i, n:].any()
        assert not lp[i][~r.mask[i]].any()
    assert num_env > 20
    assert episode_metrics(episodes)["episode/env_tokens/mean"] == num_env / len(episodes)


def test_negative_control_env_tokens_through_the_head_fail():
    """Feeding every completion token to the LM head puts env tokens under top-k / top-p sets they were
    never sampled from: the consistent head refuses. masked_logprobs skips those rows."""
    episodes, _ = rollout("consistent")
    r, _, actor = recompute("consistent", episodes)
    everything = Responses.build(r.prompt_ids, r.completion_ids, r.params,
                                 [e.logprobs[e.num_prompt_tokens:] for e in episodes])
    with pytest.raises(ValueError, match="outside its top-k/top-p set"):
        actor.logprobs(everything)


def test_masked_logprobs_equal_each_turn_as_its_own_response():
    """An independent recompute: every policy turn as a plain response whose prompt is the history before it."""
    episodes, _ = rollout("consistent")
    r, lp, actor = recompute("consistent", episodes)
    turns = [(e, start, end) for e in episodes for start, end in e.segments]
    params = [params_for(len(episodes))[episodes.index(e)] for e, _, _ in turns]
    per_turn = Responses.build([e.token_ids[:s] for e, s, _ in turns], [e.token_ids[s:t] for e, s, t in turns],
                               params, [e.logprobs[s:t] for e, s, t in turns])
    with torch.no_grad():
        separate, separate_entropy = actor.logprobs(per_turn)
        # with a prefix mask it is Actor.logprobs itself
        masked, masked_entropy = masked_logprobs(actor, per_turn)
    assert torch.equal(separate[per_turn.mask], lp.detach()[r.mask])
    assert torch.equal(separate, masked) and torch.equal(separate_entropy, masked_entropy)


def test_prefix_cache_serves_each_history_across_turns():
    episodes, eng = rollout("consistent")
    # turn t hits every full block turn t - 1 computed: all of its tokens but the last sampled one
    expected = sum((end - 1) // BLOCK * BLOCK for e in episodes for _, end in e.segments[:-1])
    assert expected > 100
    assert eng.stats.cached_tokens == eng.block_manager.num_cached_tokens_hit == expected
    cold, cold_eng = rollout("consistent", engine(model("consistent"), enable_prefix_caching=False))
    assert cold_eng.stats.cached_tokens == 0
    assert [(e.token_ids, e.logprobs) for e in episodes] == [(e.token_ids, e.logprobs) for e in cold]


def alone_vs_batch(mode) -> list[bool]:
    ps, ids = prompts(), list(range(100, 112))
    batch, _ = rollout(mode, ps=ps, ids=ids)
    same = []
    for i in range(len(ps)):
        alone = run_episodes(engine(model(mode)), [ps[i]], CalculatorEnv(), PARAMS[i % 3], 3, [ids[i]])[0]
        same.append((alone.token_ids, alone.logprobs, alone.policy_mask)
                    == (batch[i].token_ids, batch[i].logprobs, batch[i].policy_mask))
    return same


def test_episode_alone_equals_in_batch():
    assert all(alone_vs_batch("consistent"))
    ps, ids = prompts(), list(range(100, 112))
    batch, _ = rollout("consistent", ps=ps, ids=ids)
    shuffled, _ = rollout("consistent", ps=ps[::-1], ids=ids[::-1])
    # params follow the position, so compare the episodes that kept theirs
    kept = [i for i in range(12) if i % 3 == (11 - i) % 3]
    assert kept
    for i in kept:
        assert (batch[i].token_ids, batch[i].logprobs) == (shuffled[11 - i].token_ids, shuffled[11 - i].logprobs)


def test_negative_control_baseline_episode_depends_on_its_batch():
    assert not all(alone_vs_batch("baseline"))


def test_turn_request_ids_are_distinct_and_episode_ids_must_be():
    ids = {turn_request_id(e, t) for e in range(50) for t in range(8)}
    assert len(ids) == 400
    with pytest.raises(ValueError, match="unique"):
        run_episodes(engine(model("consistent")), prompts(2), CalculatorEnv(), PARAMS[0], 2, [7, 7])


def test_episodes_end_at_max_model_len():
    episodes, eng = rollout("consistent", engine(model("consistent"), max_model_len=24), max_turns=6)
    assert all(len(e) <= 24 for e in episodes)
    assert any(e.finish_reason == "length" for e in episodes)
    assert {e.finish_reason for e in episodes} <= {"length", "done", "max_turns"}


@pytest.mark.parametrize("text, value", [
    ("12*7", 84), ("2+3*4", 14), ("(1+2)*3", 9), ("-5+2", -3), ("--5", 5), ("8/4", 2), ("1 + 2", 3), (" 8 *7 ", 56),
    ("((((1))))", 1), ("8 7", None), ("7/2", None), ("1/0", None), ("9" * 13, None), ("1+", None), ("", None),
    ("2**3", None), ("__import__('os').system('x')", None), ("1e3", None), ("\u0663+1", None)])
def test_calculator_evaluates_only_arithmetic(text, value):
    assert calculate(text) == value


def test_calculator_finds_the_call_and_always_answers():
    assert last_expression("*)3+(12*7)") == "3+(12*7)" and last_expression("+*") is None
    with pytest.raises(ValueError):
        parse("1" * 65)
    env = CalculatorEnv()

    def step(text, eos=False):
        ids = TOKENIZER.encode(text, add_special_tokens=False).ids + ([arithmetic.EOS_ID] if eos else [])
        e = Episode.start(0, [arithmetic.BOS_ID])
        e.append_policy(ids, [0.0] * len(ids), "stop")
        tokens, info = env.step(e)
        return (None if tokens is None else TOKENIZER.decode(tokens)), info

    assert step("*)3+(12*7)=") == ("87 ", {"answer": "*)3+(12*7)", "calls": 1, "expression": "3+(12*7)",
                                           "result": 87})
    assert step("12*7")[0] == "=84 "
    assert step("7/0=")[0] == ". " and step("+*(")[0] == "=. "
    assert step("84", eos=True) == (None, {"answer": "84", "calls": 0})
