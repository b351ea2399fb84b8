"""The rollout driven by an external agent (rollout.agent http): the trainer serves its engine over the
OpenAI API (onepath/serve) and, each step, opens the step's episodes, waits for the agent to run and finish
them, trains on them and syncs the weights, with the engine held (serve/engine_loop.held), so that no
request meets two weight versions and none reads a K/V block the sync dropped. docs/serve.md.
"""
from __future__ import annotations

from pathlib import Path

from onepath.chat.episode import Episode
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.train.episodes import turn_request_id


class AgentRollout:
    def __init__(self, cfg, engine: LLMEngine, prompts, say):
        """prompts: the run's train.data.Prompts (its chat encoder: template, kwargs)."""
        from onepath.serve import require_extra
        require_extra("rollout.agent http")
        from onepath.serve.app import ServedModel
        from onepath.serve.engine_loop import EngineLoop
        from onepath.serve.episodes import AgentEpisodes
        from onepath.serve.frontend import FrontEnd
        r = cfg.rollout
        chat = prompts.chat
        if chat is None:
            raise ValueError("rollout.agent = http needs a chat template (the agent's chat requests are rendered by "
                             "it): give model.path with one, or data.chat_template PATH")
        chat.check_episodes(("tool",))   # refuses a template that would rewrite earlier turns
        self.timeout_s = r.agent_timeout_s
        name = Path(cfg.model.path).name if cfg.model.path else "onepath"
        self.loop = EngineLoop(engine)
        served = ServedModel(name, self.loop, prompts.tokenizer, chat.template, chat.kwargs, r.tool_format,
                             max_tokens=r.max_tokens, seed=r.seed, episodes=AgentEpisodes(name, turn_request_id))
        # the HTTP work (and the episodes' store) in a process of its own; the engine and its weights stay here
        self.server = FrontEnd(served, r.agent_host, r.agent_port)
        self.loop.start()
        self.server.start()
        self.episodes = self.server.episodes
        say(f"agent rollout: model {name!r} served on {self.server.url}/v1; the step's episodes at "
            f"{self.server.url}/onepath/rollout")

    @property
    def url(self) -> str:
        return self.server.url

    def run(self, step: int, rows: list[dict], episode_ids: list[int], params: SamplingParams) -> list[Episode]:
        """The step's episodes, len(episode_ids) of them over rows (each row's group in a row), as the agent
        ran them under the weights the engine holds now."""
        n = len(episode_ids) // len(rows)
        tasks = [(eid, rows[i // n]) for i, eid in enumerate(episode_ids)]
        self.episodes.open(step, self.loop.weight_version, tasks, params)
        return self.episodes.wait(self.timeout_s, lambda: self.server.failure)

    def held(self):
        """The engine to the trainer alone (validation, the weight sync): requests in flight finish first."""
        return self.server.held()

    def close(self) -> None:
        self.episodes.close()
        self.server.stop()
        self.loop.stop()
