"""Episode: a conversation as token ids, the policy's turns among the tokens an environment (or an agent
talking to the server) appends; what the trainer trains on (train/episodes.py, serve/episodes.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Episode:
    episode_id: int
    token_ids: list[int]                 # the whole history: prompt, then policy and env segments
    num_prompt_tokens: int
    policy_mask: list[bool]              # True where the policy sampled the token
    logprobs: list[float]                # the rollout's log-prob on policy tokens, 0.0 elsewhere
    segments: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each policy turn
    finish_reasons: list[str] = field(default_factory=list)        # the engine's, per policy turn
    finish_reason: str | None = None     # "done" (env), "max_turns", or "length" (max_model_len)
    reward_info: dict = field(default_factory=dict)                # the env's last answer
    messages: list[dict] = field(default_factory=list)  # the conversation, for envs that speak a chat template
    weight_versions: list[int] = field(default_factory=list)      # per policy turn, where a server recorded it

    @classmethod
    def start(cls, episode_id: int, prompt: list[int], messages: list[dict] | None = None) -> "Episode":
        prompt = [int(t) for t in prompt]
        return cls(episode_id, prompt, len(prompt), [False] * len(prompt), [0.0] * len(prompt),
                   messages=list(messages or []))

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def turns(self) -> int:
        return len(self.segments)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_segment(self) -> list[int]:
        start, end = self.segments[-1]
        return self.token_ids[start:end]

    def append_policy(self, token_ids: list[int], logprobs: list[float], finish_reason: str) -> None:
        self.segments.append((len(self.token_ids), len(self.token_ids) + len(token_ids)))
        self.token_ids += token_ids
        self.policy_mask += [True] * len(token_ids)
        self.logprobs += logprobs
        self.finish_reasons.append(finish_reason)

    def append_env(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.policy_mask += [False] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
