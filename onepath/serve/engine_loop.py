"""EngineLoop: the engine in one background thread, fed by requests from any thread (continuous batching).

A request joins the running batch at the next step; after every step the tokens that reached the host
are handed to their requests' streams, one call per sink a step: an asyncio loop of this process (the HTTP
server in a thread), or the link to a front end process (serve/frontend.py), one message with every request's
new tokens. A request's tokens depend on itself alone: its sampling key is (seed, sample id, position) and the
consistent kernels give a row the same bits in any batch (DESIGN.md), so joining a batch moves nothing.

held() gives a caller the engine to itself: admission stops, the requests in flight finish on the weights
they started with, the thread parks, and requests that arrive meanwhile wait. A weight sync done inside
held() therefore never meets a request in flight: each request is computed by one weight version, the one
its response names (LLMEngine.weight_version), and the prefix cache the sync drops held nothing in use.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from onepath.engine.llm_engine import LLMEngine, young_collections_only
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.sequence import PLACEHOLDER, Sequence


@dataclass(slots=True)
class Delta:
    """What one step added to a request: its new tokens and their log-probs; finish_reason and error at the end."""
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    error: str | None = None
    weight_version: int = 0


@dataclass(eq=False)
class Stream:
    """One request's deltas, as its sink hands them over (into `queue`, where an asyncio loop reads them)."""
    sink: Sink | None
    key: int = 0           # the request's id where the sink names it (a front end process's)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None
    sent: int = 0          # completion tokens handed out so far
    version: int = 0       # the weight version it was admitted under


class Sink(Protocol):
    def put(self, items: list[tuple[Stream, Delta]]) -> None:
        """One step's deltas for this sink's streams, called from the engine thread."""


class LoopSink:
    """Deltas into their streams' queues on one asyncio loop: one call into the loop a step."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop

    def put(self, items: list[tuple[Stream, Delta]]) -> None:
        try:
            self.loop.call_soon_threadsafe(put_all, items)
        except RuntimeError:  # that loop is closed: nobody waits for these
            pass


@dataclass(slots=True)
class Submission:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    sample_id: int
    stream: Stream


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.lock = threading.Lock()
        self.holder = threading.Lock()  # one holder at a time
        self.wake = threading.Condition(self.lock)
        self.inbox: deque[list[Submission]] = deque()
        self.aborts: deque[int] = deque()
        self.streams: dict[int, Stream] = {}
        self.hold_requests = 0      # callers waiting for, or inside, held()
        self.parked = False         # the thread is parked for a holder
        self.stopping = False
        self.failure: BaseException | None = None
        self.next_request_id = 0
        self.sinks: dict[asyncio.AbstractEventLoop, LoopSink] = {}
        self.thread = threading.Thread(target=self.run, name="onepath-engine", daemon=True)

    def start(self) -> EngineLoop:
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.wake.notify_all()
        self.thread.join()

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def max_model_len(self) -> int:
        return self.engine.scheduler_config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.engine.eos_token_ids)

    def submit(self, requests: list[tuple[list[int], SamplingParams, int]], sink: Sink | None = None,
               keys: list[int] | None = None) -> list[Stream]:
        """Queue (prompt ids, params, sample id) requests, admitted together at the next step (so they share
        one weight version); their streams, in order. sink: where their deltas go (default: their queues, on
        the calling asyncio loop); keys: the sink's ids for them."""
        if self.failure is not None:
            raise RuntimeError(f"the engine thread stopped: {self.failure!r}")
        if sink is None:
            loop = asyncio.get_running_loop()
            sink = self.sinks.get(loop) or self.sinks.setdefault(loop, LoopSink(loop))
        with self.lock:
            batch = []
            for i, (prompt_ids, params, sample_id) in enumerate(requests):
                stream = Stream(sink, keys[i] if keys is not None else self.next_request_id)
                batch.append(Submission(self.next_request_id, prompt_ids, params, sample_id, stream))
                self.next_request_id += 1
            self.inbox.append(batch)
            self.wake.notify_all()
        return [s.stream for s in batch]

    def abort(self, streams: list[Stream]) -> None:
        """Stop requests whose client went away (a finished one is left alone)."""
        with self.lock:
            self.aborts.extend(rid for rid, s in list(self.streams.items()) if s in streams)
            for batch in self.inbox:  # not admitted yet: drop them there
                batch[:] = [sub for sub in batch if sub.stream not in streams]
            self.wake.notify_all()

    @contextmanager
    def held(self):
        """The engine, to the caller alone, once the requests in flight have finished; requests that arrive
        meanwhile wait and are admitted after (under the weights the caller leaves)."""
        self.holder.acquire()
        with self.lock:
            self.hold_requests += 1
            self.wake.notify_all()
            while not self.parked and self.thread.is_alive():
                self.wake.wait()
        try:
            yield self.engine
        finally:
            with self.lock:
                self.hold_requests -= 1
                self.wake.notify_all()
            self.holder.release()

    def run(self) -> None:
        try:
            with young_collections_only():
                while self.next_step():
                    pass
        except BaseException as e:  # every waiting request learns the engine is gone
            self.failure = e
            self.fail_all(f"the engine failed: {type(e).__name__}: {e}")
            raise
        finally:
            with self.lock:
                self.parked = False
                self.wake.notify_all()

    def next_step(self) -> bool:
        """Admit, abort, step once or wait; False when stopping."""
        engine = self.engine
        with self.lock:
            while True:
                if self.stopping:
                    return False
                busy = engine.has_unfinished()
                if self.hold_requests and not busy:
                    self.parked = True
                    self.wake.notify_all()
                    self.wake.wait()
                    continue
                self.parked = False
                admit = [] if self.hold_requests else list(self.inbox)
                if admit:
                    self.inbox.clear()
                aborts = list(self.aborts)
                self.aborts.clear()
                if busy or admit or aborts:
                    break
                self.wake.wait()
        updates = []
        for batch in admit:
            for sub in batch:
                updates += self.admit(sub)
        for rid in aborts:
            engine.scheduler.abort(rid)
            stream = self.streams.pop(rid, None)
            if stream is not None:
                updates.append((stream, Delta([], [], "abort", None, stream.version)))
        if engine.has_unfinished():
            finished = engine.step()
            updates += self.progress(finished)
        self.deliver(updates)
        return True

    def admit(self, sub: Submission) -> list[tuple[Stream, Delta]]:
        engine = self.engine
        try:
            engine.add_request(sub.prompt_ids, sub.params, sub.request_id, sub.sample_id)
        except ValueError as e:  # this request alone fails
            return [(sub.stream, Delta([], [], "error", str(e), engine.weight_version))]
        sub.stream.seq = engine.scheduler.live[sub.request_id]
        sub.stream.version = engine.weight_version
        self.streams[sub.request_id] = sub.stream
        return []

    def progress(self, finished: list[Sequence]) -> list[tuple[Stream, Delta]]:
        """Each live request's tokens that reached the host since the last step (a placeholder is a token
        still on its way), and the end of the finished ones."""
        updates = []
        for seq in finished:
            stream = self.streams.pop(seq.request_id, None)
            if stream is not None:
                if stream.version != self.engine.weight_version:
                    raise RuntimeError(f"request {seq.request_id} began under weight version {stream.version} and "
                                       f"ended under {self.engine.weight_version}: weights changed outside held()")
                updates.append((stream, Delta(seq.completion_token_ids[stream.sent:], seq.logprobs[stream.sent:],
                                              seq.finish_reason, seq.error, stream.version)))
        for stream in self.streams.values():
            seq = stream.seq
            end = seq.num_tokens - (seq.token_ids[-1] == PLACEHOLDER)
            start = seq.num_prompt_tokens + stream.sent
            if end > start:
                first = start - seq.num_prompt_tokens
                updates.append((stream, Delta(seq.token_ids[start:end], seq.logprobs[first:end - seq.num_prompt_tokens],
                                              None, None, stream.version)))
                stream.sent = end - seq.num_prompt_tokens
        return updates

    def deliver(self, updates: list[tuple[Stream, Delta]]) -> None:
        by_sink: dict[Sink, list] = {}
        for stream, delta in updates:
            by_sink.setdefault(stream.sink, []).append((stream, delta))
        for sink, items in by_sink.items():
            sink.put(items)

    def fail_all(self, error: str) -> None:
        with self.lock:
            pending = [sub.stream for batch in self.inbox for sub in batch]
            self.inbox.clear()
        updates = [(s, Delta([], [], "error", error, s.version)) for s in [*self.streams.values(), *pending]]
        self.streams.clear()
        self.deliver(updates)


def put_all(items: list[tuple[Stream, Delta]]) -> None:
    for stream, delta in items:
        stream.queue.put_nowait(delta)
