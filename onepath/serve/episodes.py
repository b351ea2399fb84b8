"""Episodes an external agent runs against the server while `onepath train` trains on them.

Per step the trainer opens the step's episodes (GET /onepath/rollout lists them: an id, the base URL to
point an OpenAI client at, the row's prompt), the agent runs each as a chat with the tools it owns, posts
/episodes/{id}/finish, and the trainer trains on the episodes once all are in, then syncs the weights.

Token in, token out: the server keeps each episode's tokens itself. The first request's messages are
rendered by the chat template; every later request must repeat the conversation so far exactly as the
server returned it (the assistant turns as given back) and add messages after it (tool results, user
turns), which are rendered by the template's turn format and appended as tokens (chat/encoder.append_ids).
The policy's turns stay as sampled, with the log-probs and the weight version the responses carried, and
nothing is re-tokenised from text: what the trainer gets is what the engine computed. A conversation that
rewrites a turn is refused (400, naming the message), as is a request to an episode that is finished,
busy with another request, or of another step (409).

A turn's sampling key is (step seed, the trainer's id for (episode, turn), position): the same key
run_episodes gives the trainer's own tool episodes, so an agent that does what ToolEnv does gets the
same episode bit for bit.

With the HTTP front end in a process of its own (serve/frontend.py) the episodes live there, beside the
handlers, and the trainer holds RemoteEpisodes: the same open / wait / close, carried over the front end's link.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from onepath.chat.encoder import ChatEncoder
from onepath.chat.episode import Episode
from onepath.chat.template import ChatTemplateError
from onepath.engine.sampling_params import SamplingParams
from onepath.serve.protocol import ChatRequest, RequestError, error_response, parse_json, short


@dataclass(eq=False)
class Session:
    key: str
    episode_id: int
    row: dict
    episode: Episode | None = None
    returned: list[dict] = field(default_factory=list)  # the conversation as the agent sees it (canonical)
    tools: str = ""                                     # the tools it renders, as JSON
    busy: bool = False
    finished: bool = False
    reward: float | None = None
    pending: tuple[list[int], list[dict]] | None = None  # the env tokens and messages of the request in flight


@dataclass(eq=False)
class Turn:
    """One request of an episode, between begin() and record() / release()."""
    session: Session
    prompt_ids: list[int]
    params: SamplingParams
    sample_id: int
    call_prefix: str


class AgentEpisodes:
    def __init__(self, model: str, sample_id: Callable[[int, int], int]):
        """sample_id(episode id, turn): the id a turn's sampling noise is keyed by."""
        self.model, self.sample_id = model, sample_id
        self.cond = threading.Condition()
        self.status = "waiting"   # waiting (training) | rollout (episodes open) | done
        self.step, self.version = 0, 0
        self.params: SamplingParams | None = None
        self.sessions: dict[str, Session] = {}

    # --- the trainer's side ---------------------------------------------------------------------------

    def open(self, step: int, version: int, tasks: list[tuple[int, dict]], params: SamplingParams) -> None:
        """Open the step's episodes: (the trainer's episode id, its data row) each, sampled with params."""
        with self.cond:
            self.step, self.version, self.params = step, version, params
            self.sessions = {str(eid): Session(str(eid), eid, row) for eid, row in tasks}
            self.status = "rollout"
            self.cond.notify_all()

    def wait(self, timeout_s: float, failure: Callable[[], BaseException | None] = lambda: None) -> list[Episode]:
        """The open episodes, in the order opened, once the agent has finished every one. failure(): what
        stopped the engine, if anything (then no episode can finish: the wait ends at once)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not all(s.finished for s in self.sessions.values()):
                if failure() is not None:
                    raise RuntimeError(f"step {self.step}: the engine stopped while the agent ran its episodes: "
                                       f"{failure()!r}")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [s.key for s in self.sessions.values() if not s.finished]
                    raise TimeoutError(f"step {self.step}: the agent finished {len(self.sessions) - len(missing)} of "
                                       f"{len(self.sessions)} episodes in {timeout_s:g} s (not {', '.join(missing[:5])}"
                                       f"{'...' if len(missing) > 5 else ''}): POST /episodes/ID/finish after each, "
                                       "or raise rollout.agent_timeout_s")
                self.cond.wait(min(left, 1.0))
            self.status = "waiting"
            return [s.episode for s in self.sessions.values()]

    def close(self) -> None:
        with self.cond:
            self.status = "done"
            self.cond.notify_all()

    # --- the handlers' side ---------------------------------------------------------------------------

    def session(self, key: str) -> Session:
        s = self.sessions.get(key)
        if s is None:
            raise RequestError(f"episode {key!r} is not open (step {self.step}, {self.status}): run the episodes "
                               "GET /onepath/rollout lists", status=404)
        if s.finished:
            raise RequestError(f"episode {key!r} is finished: it takes no more requests", status=409)
        return s

    def begin(self, key: str, req: ChatRequest, encoder: ChatEncoder) -> Turn:
        with self.cond:
            s = self.session(key)
            if s.busy:
                raise RequestError(f"episode {key!r} has a request in flight: an episode is one conversation, send "
                                   "its requests one after another", status=409)
            tools = json.dumps(req.tools, sort_keys=True)
            if s.episode is None:
                try:
                    ids = encoder.prompt_ids(req.messages)
                except ChatTemplateError as e:
                    raise RequestError(str(e), "messages") from None
                s.episode, s.tools = Episode.start(s.episode_id, ids, req.messages), tools
                s.returned = [canonical(m) for m in req.messages]
            else:
                if tools != s.tools:
                    raise RequestError(f"tools changed in episode {key!r}: the template wrote them into its first "
                                       "prompt; send the same tools on every request of an episode", "tools")
                ids = s.episode.token_ids + self.appended(s, req, encoder)
            s.busy = True
            turn = s.episode.turns
            return Turn(s, ids, self.params, self.sample_id(s.episode_id, turn), f"call_{turn}")

    def appended(self, s: Session, req: ChatRequest, encoder: ChatEncoder) -> list[int]:
        """The tokens of the messages the request adds after the episode's last turn (kept until record())."""
        n = len(s.returned)
        seen = [canonical(m) for m in req.messages[:n]]
        if seen != s.returned:
            at = next((i for i, (a, b) in enumerate(zip(seen, s.returned)) if a != b), len(seen))
            got = short(seen[at]) if at < len(seen) else "nothing"
            raise RequestError(f"messages[{at}] is {got}, but episode {s.key!r} holds {short(s.returned[at], 120)} "
                               "there: send the conversation as the server returned it, then the new messages",
                               f"messages[{at}]")
        new = req.messages[n:]
        if not new:
            raise RequestError(f"episode {s.key!r}: no message after the last assistant turn; add the tool results "
                               "or the user's turn", "messages")
        if any(m["role"] == "assistant" for m in new):
            at = n + next(i for i, m in enumerate(new) if m["role"] == "assistant")
            raise RequestError(f"messages[{at}] is an assistant turn the policy did not write: in an episode only "
                               "the server's turns are assistant turns", f"messages[{at}]")
        ended = s.episode.finish_reasons[-1] == "stop"
        try:
            tokens = encoder.append_ids(s.episode.messages, new, ended)
        except ChatTemplateError as e:
            raise RequestError(str(e), "messages") from None
        s.pending = (tokens, new)
        return tokens

    def record(self, turn: Turn, tokens: list[int], logprobs: list[float], finish_reason: str, version: int,
               text: str, message: dict) -> None:
        """The turn's response went out: the episode grows by the messages it added and the policy's tokens."""
        with self.cond:
            s, e = turn.session, turn.session.episode
            if s.pending is not None:
                env, new = s.pending
                e.append_env(env)
                e.messages += new
                s.returned += [canonical(m) for m in new]
            e.append_policy(tokens, logprobs, finish_reason)
            e.weight_versions.append(version)
            e.messages.append({"role": "assistant", "content": text})
            e.reward_info = {"answer": message.get("content") or ""}
            s.returned.append(canonical(message))
            s.pending, s.busy = None, False

    def release(self, turn: Turn) -> None:
        """The turn's request failed: the episode stays as it was."""
        with self.cond:
            s = turn.session
            s.pending, s.busy = None, False
            if not s.episode.turns:  # its first request: the next one starts it again
                s.episode, s.returned, s.tools = None, [], ""

    def finish(self, key: str, body: dict) -> dict:
        with self.cond:
            s = self.session(key)
            if s.busy:
                raise RequestError(f"episode {key!r} has a request in flight: finish it after the response",
                                   status=409)
            if s.episode is None or not s.episode.turns:
                raise RequestError(f"episode {key!r} has no turn yet: POST its chat/completions first", status=409)
            unknown = [k for k in body if k != "reward"]
            if unknown:
                raise RequestError(f"unknown field {unknown[0]!r}: finish takes an optional reward", unknown[0])
            reward = body.get("reward")
            if reward is not None and not (isinstance(reward, (int, float)) and not isinstance(reward, bool)
                                           and reward == reward and abs(reward) != float("inf")):
                raise RequestError(f"reward {short(reward)} must be a finite number, or left out for the trainer's "
                                   "reward function", "reward")
            versions = set(s.episode.weight_versions)
            if versions != {self.version}:
                raise RequestError(f"episode {key!r} was sampled by weight versions {sorted(versions)}, not the "
                                   f"step's {self.version}", status=409)
            s.finished, s.reward = True, None if reward is None else float(reward)
            if s.reward is not None:
                s.episode.reward_info["reward"] = s.reward
            self.cond.notify_all()
            return {"id": key, "finished": True, "turns": s.episode.turns}

    def listing(self) -> dict:
        with self.cond:
            episodes = [{"id": s.key, "base_url": f"/episodes/{s.key}/v1", "prompt": s.row.get("prompt"),
                         "row": {k: v for k, v in s.row.items() if k != "reward_model"}, "finished": s.finished}
                        for s in self.sessions.values()] if self.status == "rollout" else []
            return {"status": self.status, "step": self.step, "weight_version": self.version, "model": self.model,
                    "episodes": episodes}

    def record_of(self, key: str) -> dict:
        with self.cond:
            s = self.sessions.get(key)
            if s is None or s.episode is None:
                raise RequestError(f"episode {key!r} is not open or has no turn yet", status=404)
            e = s.episode
            return {"id": key, "token_ids": e.token_ids, "num_prompt_tokens": e.num_prompt_tokens,
                    "policy_mask": e.policy_mask, "logprobs": e.logprobs, "weight_versions": e.weight_versions,
                    "finish_reasons": e.finish_reasons, "finished": s.finished}

    def routes(self) -> list[Route]:
        async def rollout(request: Request):
            return JSONResponse(self.listing())

        async def finish(request: Request):
            try:
                raw = await request.body()
                body = parse_json(raw) if raw.strip() else {}
                return JSONResponse(self.finish(request.path_params["episode"], body))
            except RequestError as e:
                return error_response(e)

        async def record(request: Request):
            try:
                return JSONResponse(self.record_of(request.path_params["episode"]))
            except RequestError as e:
                return error_response(e)

        return [Route("/onepath/rollout", rollout, methods=["GET"]),
                Route("/episodes/{episode}/finish", finish, methods=["POST"]),
                Route("/episodes/{episode}", record, methods=["GET"])]


class RemoteEpisodes:
    """The trainer's side of AgentEpisodes (open, wait, close) that live in a front end process: each call is a
    message (send), and wait() returns when the front end answers with the episodes or the error."""

    def __init__(self, send: Callable[[tuple], None]):
        self.send = send
        self.cond = threading.Condition()
        self.answer: list[Episode] | BaseException | None = None

    def open(self, step: int, version: int, tasks: list[tuple[int, dict]], params: SamplingParams) -> None:
        with self.cond:
            self.answer = None
        self.send(("open", step, version, tasks, params))

    def wait(self, timeout_s: float, failure: Callable[[], BaseException | None] = lambda: None) -> list[Episode]:
        self.send(("wait", timeout_s))
        with self.cond:
            while self.answer is None:
                if failure() is not None:
                    raise RuntimeError(f"the engine or its HTTP front end stopped while the agent ran its episodes: "
                                       f"{failure()!r}")
                self.cond.wait(1.0)
            answer, self.answer = self.answer, None
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def close(self) -> None:
        self.send(("close",))

    def answered(self, answer: list[Episode] | BaseException) -> None:
        with self.cond:
            self.answer = answer
            self.cond.notify_all()


async def remote_call(store: AgentEpisodes, call: tuple, failure: Callable[[], object], reply) -> None:
    """In the front end process: the trainer's call of RemoteEpisodes on the episodes there; wait() replies
    once the agent has finished them (or with the error it ends in)."""
    name, *args = call
    if name != "wait":
        getattr(store, name)(*args)
        return
    try:
        answer = await asyncio.to_thread(store.wait, *args, failure)
    except (TimeoutError, RuntimeError) as e:
        answer = e
    reply(answer)


def canonical(m: dict) -> dict:
    """A message as an agent may echo it back: role, text content, tool calls (arguments as objects)."""
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function", {})
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        calls.append([c.get("id"), fn.get("name"), args])
    return {"role": m.get("role"), "content": m.get("content") or "", "tool_calls": calls,
            "tool_call_id": m.get("tool_call_id")}
