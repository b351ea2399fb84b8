"""Multi-turn episodes: the policy's turns interleaved with tokens an environment appends (tool
results, user turns), and the trainer's log-probs of the policy tokens over whole histories.

Each turn, every live episode's whole history goes to the engine in one generate() call; the
prefix cache serves the history's full blocks, written by the previous turn. A turn's request id
is a function of (episode id, turn) only, so an episode's tokens do not depend on its batch.

On the trainer side an episode is one Responses row: prompt = the first prompt, completion =
everything after it, mask = the policy's tokens. One forward runs over each whole history and the
LM head only over the rows that predict a policy token, so top-k / top-p never see an env token.
"""
from __future__ import annotations

from typing import Protocol

import torch

from onepath.chat.episode import Episode
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.models.batch import ForwardBatch
from onepath.train.actor import Actor, Responses

MAX_TURNS = 1 << 10


class Environment(Protocol):
    stop_token_ids: tuple[int, ...]  # tokens that end a policy turn besides EOS (the calculator's "=")

    def step(self, episode: Episode) -> tuple[list[int] | None, dict]:
        """After a policy turn: the tokens to append before the next turn (None: the episode is
        done) and reward info. Must depend on the episode alone, or episodes lose batch invariance."""


def turn_request_id(episode_id: int, turn: int) -> int:
    """The engine keys sampling noise by (seed, request id, position): one id per (episode, turn)."""
    return episode_id * MAX_TURNS + turn


def run_episodes(engine: LLMEngine, prompts: list[list[int]], env: Environment,
                 params: SamplingParams | list[SamplingParams], max_turns: int,
                 episode_ids: list[int] | None = None, conversations: list[list[dict]] | None = None) -> list[Episode]:
    """Up to max_turns policy turns per episode; env.step after each. Env tokens returned after the
    last turn are dropped (no policy turn would follow them), so a history ends with a policy token.
    conversations: each prompt's messages, the start of Episode.messages (chat environments)."""
    if not 1 <= max_turns <= MAX_TURNS:
        raise ValueError(f"max_turns {max_turns} must be in [1, {MAX_TURNS}]")
    params = params if isinstance(params, list) else [params] * len(prompts)
    episode_ids = list(range(len(prompts))) if episode_ids is None else list(episode_ids)
    if not len(params) == len(episode_ids) == len(prompts):
        raise ValueError(f"{len(prompts)} prompts, {len(params)} sampling params and {len(episode_ids)} episode ids: "
                         "give one of each per episode")
    if len(set(episode_ids)) != len(episode_ids):
        raise ValueError("episode ids must be unique: they key each episode's sampling noise")
    max_len = engine.scheduler_config.max_model_len
    conversations = conversations or [None] * len(prompts)
    episodes = [Episode.start(eid, p, m) for eid, p, m in zip(episode_ids, prompts, conversations)]
    live = list(range(len(episodes)))
    for turn in range(max_turns):
        if not live:
            break
        outputs = engine.generate([episodes[i].token_ids for i in live], [params[i] for i in live],
                                  request_ids=[turn_request_id(episodes[i].episode_id, turn) for i in live])
        failed = [o for o in outputs if o.error]
        if failed:
            raise RuntimeError(f"{len(failed)} requests of turn {turn} failed, first: {failed[0].error}")
        next_live = []
        for i, out in zip(live, outputs):
            episode = episodes[i]
            episode.append_policy(out.token_ids, out.logprobs, out.finish_reason)
            tokens, episode.reward_info = env.step(episode)
            if tokens is None:
                episode.finish_reason = "done"
            elif turn == max_turns - 1:
                episode.finish_reason = "max_turns"
            elif len(episode) + len(tokens) >= max_len:  # no room left for one more policy token
                episode.finish_reason = "length"
            else:
                episode.append_env([int(t) for t in tokens])
                next_live.append(i)
        live = next_live
    return episodes


def episode_responses(episodes: list[Episode], params: SamplingParams | list[SamplingParams]) -> Responses:
    """One Responses row per episode: completion = everything after the prompt, mask = policy tokens."""
    params = params if isinstance(params, list) else [params] * len(episodes)
    width = max((len(e) - e.num_prompt_tokens for e in episodes), default=0)
    logprobs = torch.zeros(len(episodes), width)
    mask = torch.zeros(len(episodes), width, dtype=torch.bool)
    for i, e in enumerate(episodes):
        n = len(e) - e.num_prompt_tokens
        logprobs[i, :n] = torch.tensor(e.logprobs[e.num_prompt_tokens:], dtype=torch.float32)
        mask[i, :n] = torch.tensor(e.policy_mask[e.num_prompt_tokens:], dtype=torch.bool)
    return Responses([e.prompt_ids for e in episodes], [e.completion_ids for e in episodes], list(params),
                     logprobs, mask)


def masked_logprobs(actor: Actor, r: Responses, max_tokens: int | None = None,
                    head_rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """Actor.logprobs for a mask with holes: log-probs and entropies [B, T] of the completion tokens
    where r.mask is True, 0 elsewhere. One forward per whole sequence; the LM head runs on masked rows only."""
    lps, entropies = [], []
    for group in actor.micro_batches(r, max_tokens):
        lp, entropy = masked_forward(actor, [r.prompt_ids[i] for i in group], [r.completion_ids[i] for i in group],
                                     [r.mask[i] for i in group], [r.params[i] for i in group], head_rows)
        lps.append(lp)
        entropies.append(entropy)
    mask = r.mask.to(actor.model.device)
    return actor.scatter(torch.cat(lps), mask), actor.scatter(torch.cat(entropies), mask)


def masked_forward(actor: Actor, prompts, completions, masks, params, head_rows):
    batch, num_blocks, all_rows = ForwardBatch.for_completions(prompts, completions, actor.block_size,
                                                              actor.model.device)
    rows, tokens, row_params, k = [], [], [], 0
    for c, m, p in zip(completions, masks, params):
        for j, keep in enumerate(m.tolist()[:len(c)]):
            if keep:
                rows.append(all_rows[k + j])
                tokens.append(c[j])
                row_params.append(p)
        k += len(c)
    cache = actor.model.make_cache(num_blocks, actor.block_size)
    hidden = actor.hidden(batch, cache)
    return actor.head(hidden, rows, tokens, row_params, head_rows)


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    n = max(len(episodes), 1)
    policy = sum(sum(e.policy_mask[e.num_prompt_tokens:]) for e in episodes)
    env = sum(len(e) - e.num_prompt_tokens for e in episodes) - policy
    metrics = {"episode/turns/mean": sum(e.turns for e in episodes) / n,
               "episode/policy_tokens/mean": policy / n,
               "episode/env_tokens/mean": env / n,
               "episode/done_frac": sum(e.finish_reason == "done" for e in episodes) / n}
    for key in ("tool_calls", "tool_errors"):  # what a tool environment reports
        if any(key in e.reward_info for e in episodes):
            metrics[f"episode/{key}/mean"] = sum(e.reward_info.get(key, 0) for e in episodes) / n
    return metrics
