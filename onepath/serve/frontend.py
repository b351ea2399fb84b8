"""The HTTP front end in a process of its own: the API (serve/app.py: request checks, chat templates,
detokenisation, log-prob entries, JSON, SSE) runs in a child, `python -m onepath.serve.frontend`; the engine
loop stays in the process that owns the engine and its weights (`onepath serve`, the trainer), so the HTTP work
and the engine's steps overlap instead of taking turns under one GIL (docs/serve.md: Throughput). As in vLLM's
and SGLang's splits, each step's new tokens for every request in flight cross in one message and the text is
made on the front end's side; unlike them the engine stays in the parent, where the trainer syncs its weights.

The two talk over a socket pair, in length-prefixed pickles:

    front end -> engine   ("submit", [(key, prompt ids, SamplingParams, sample id), ...])  admitted together
                          ("abort", [key, ...])                                           clients gone
    engine -> front end   ("deltas", [(key, token ids, log-probs, finish_reason, error, weight version), ...])
                          one a step, for all of the front end's requests that moved
                          ("version", weight version)     after FrontEnd.held(): a weight sync
                          ("failed", message)             the engine thread stopped
    the agent's episodes  ("episodes", (call, *args)) the trainer's RemoteEpisodes call (serve/episodes.py),
                          answered ("episodes", the episodes or the error) for wait()
    at start              ("init", ServedModel's fields, the engine loop's facts, the episodes' model name and
                          sample ids or None), answered ("ready", None) or ("error", the child's traceback)

The parent binds the HTTP socket (a port in use fails there, as in process) and hands it to the child. The
child exits when the socket pair closes (its parent stopped, or died) or its parent changes; the parent turns a
child's exit it did not ask for into FrontEnd.failure and aborts the child's requests in the engine.
"""
from __future__ import annotations

import asyncio
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from contextlib import contextmanager
from dataclasses import fields

from onepath.serve.app import ServedModel, build_app, listen, url_of, uvicorn_server
from onepath.serve.engine_loop import Delta, EngineLoop, Stream
from onepath.serve.episodes import AgentEpisodes, RemoteEpisodes, remote_call

HEADER = struct.Struct("!Q")
START_TIMEOUT_S = 300  # the child imports torch (SamplingParams) before it answers


class FrontEnd:
    """The HTTP server of `served` (whose loop is an EngineLoop of this process) in a child process on
    host:port (0: a free port, read back from .port). start(), stop(), held() for weight syncs. Where `served`
    has an agent's episodes, they live in the child (a fresh AgentEpisodes of the same model name and sample
    ids) and .episodes is the trainer's side of them (open, wait, close)."""

    def __init__(self, served: ServedModel, host: str = "127.0.0.1", port: int = 8000):
        self.loop: EngineLoop = served.loop
        kept = {f.name: getattr(served, f.name) for f in fields(served) if f.name not in ("loop", "episodes")}
        facts = {"max_model_len": self.loop.max_model_len, "vocab_size": self.loop.vocab_size,
                 "eos_token_ids": self.loop.eos_token_ids, "weight_version": self.loop.weight_version}
        store = served.episodes
        self.episodes = RemoteEpisodes(lambda call: self.send(("episodes", call))) if store is not None else None
        try:
            self.init = pickle.dumps(("init", kept, facts, store and (store.model, store.sample_id)),
                                     protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PickleError, TypeError, AttributeError) as e:
            raise ValueError(f"what model {served.name!r} is served with cannot go to a front end process ({e}): "
                             "serve it in process (HTTPServer)") from None
        self.sock = listen(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.lock = threading.Lock()      # streams: the link's reader inserts, the engine thread removes
        self.sending = threading.Lock()   # one message on the socket at a time
        self.streams: dict[int, Stream] = {}
        self.process: subprocess.Popen | None = None
        self.link: socket.socket | None = None
        self.exited: RuntimeError | None = None
        self.told_failure = False
        self.stopping = False
        self.reader = threading.Thread(target=self.read, name="onepath-frontend-link", daemon=True)

    @property
    def url(self) -> str:
        return url_of(self.host, self.port)

    @property
    def failure(self) -> BaseException | None:
        """What stopped serving: the engine thread's error, or the front end process's exit."""
        return self.loop.failure or self.exited

    def start(self) -> FrontEnd:
        self.link, theirs = socket.socketpair()
        # the child resolves imports as this process does (the path multiprocessing's spawn hands over too)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "onepath.serve.frontend", str(theirs.fileno()), str(self.sock.fileno()),
             str(os.getpid())], pass_fds=(theirs.fileno(), self.sock.fileno()), env=env,
            start_new_session=True)  # a Ctrl-C reaches this process alone, which stops the child in order
        theirs.close()
        self.sock.close()  # the child listens now: if it dies, connections are refused, not left waiting
        self.link.settimeout(START_TIMEOUT_S)
        try:
            self.link.sendall(HEADER.pack(len(self.init)) + self.init)
            answer = recv(self.link)
        except OSError as e:  # a timeout too
            answer = ("error", f"{type(e).__name__}: {e}")
        if answer is None or answer[0] != "ready":
            self.stop()
            why = answer[1].rstrip() if answer is not None else "(its output above says why)"
            raise RuntimeError(f"the HTTP front end process for {self.url} did not start (exit code "
                               f"{self.process.returncode}): {why}")
        self.link.settimeout(None)
        self.reader.start()
        return self

    @contextmanager
    def held(self):
        """EngineLoop.held(), and the front end told the weight version it leaves (/v1/models shows it)."""
        try:
            with self.loop.held() as engine:
                yield engine
        finally:
            self.send(("version", self.loop.weight_version))

    def wait(self) -> None:
        """Until the front end process ends (stop(), or it died: then .failure says so)."""
        self.reader.join()

    def stop(self) -> None:
        """The child closes its server (streams in flight end) and exits; its requests leave the engine."""
        self.stopping = True
        if self.link is None:
            self.sock.close()
            return
        try:
            self.link.shutdown(socket.SHUT_WR)  # the child reads the end of the link: it stops
        except OSError:
            pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.reader.is_alive():
            self.reader.join()
        self.link.close()

    # --- the link, this side: the reader thread, and the engine thread's sink ---------------------------------

    def read(self) -> None:
        try:
            while (message := recv(self.link)) is not None:
                kind, body = message
                if kind == "submit":
                    self.submit(body)
                elif kind == "abort":
                    with self.lock:
                        gone = [self.streams.pop(key) for key in body if key in self.streams]
                    self.loop.abort(gone)
                elif kind == "episodes":
                    self.episodes.answered(body)
        except OSError:
            pass
        finally:
            with self.lock:
                left, self.streams = list(self.streams.values()), {}
            self.loop.abort(left)
            if not self.stopping:
                try:
                    code = self.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    code = self.process.wait()
                why = f"killed by {signal.Signals(-code).name}" if code < 0 else "its output above says why"
                self.exited = RuntimeError(f"the HTTP front end process (pid {self.process.pid}) on {self.url} exited "
                                           f"with code {code} ({why}): nothing serves the engine")

    def submit(self, body: list) -> None:
        keys = [key for key, *_ in body]
        try:
            with self.lock:
                streams = self.loop.submit([(ids, params, sample) for _, ids, params, sample in body], self, keys)
                self.streams.update(zip(keys, streams))
        except RuntimeError as e:  # the engine thread stopped
            self.send(("failed", str(e)))
            self.send(("deltas", [(k, [], [], "error", str(e), self.loop.weight_version) for k in keys]))

    def put(self, items: list[tuple[Stream, Delta]]) -> None:
        """The sink of the front end's streams: one step's deltas in one message (from the engine thread)."""
        with self.lock:
            for stream, delta in items:
                if delta.finish_reason is not None:
                    self.streams.pop(stream.key, None)
        if self.loop.failure is not None and not self.told_failure:
            self.told_failure = True
            self.send(("failed", f"the engine thread stopped: {self.loop.failure!r}"))
        self.send(("deltas", [(s.key, d.token_ids, d.logprobs, d.finish_reason, d.error, d.weight_version)
                              for s, d in items]))

    def send(self, message) -> None:
        with self.sending:
            try:
                send(self.link, message)
            except OSError:  # the child is gone: read() reports it
                pass


class EngineClient:
    """The engine loop as the front end process sees it: the calls serve/app.py makes of an EngineLoop, carried
    over the link; each step's deltas come back in one message and go into their streams' queues."""

    def __init__(self, writer: asyncio.StreamWriter, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], weight_version: int):
        self.writer = writer
        self.max_model_len, self.vocab_size, self.eos_token_ids = max_model_len, vocab_size, eos_token_ids
        self.weight_version = weight_version
        self.failure: str | None = None
        self.streams: dict[int, Stream] = {}
        self.next_key = 0

    def submit(self, requests: list[tuple[list[int], object, int]]) -> list[Stream]:
        if self.failure is not None:
            raise RuntimeError(self.failure)
        streams = [Stream(None, self.next_key + i) for i in range(len(requests))]
        self.next_key += len(requests)
        self.streams.update((s.key, s) for s in streams)
        write(self.writer, ("submit", [(s.key, *r) for s, r in zip(streams, requests)]))
        return streams

    def abort(self, streams: list[Stream]) -> None:
        keys = [s.key for s in streams if self.streams.pop(s.key, None) is not None]
        if keys:
            write(self.writer, ("abort", keys))

    def receive(self, kind: str, body) -> None:
        if kind == "deltas":
            for key, tokens, logprobs, reason, error, version in body:
                stream = self.streams.get(key) if reason is None else self.streams.pop(key, None)
                if stream is not None:  # else aborted here already
                    stream.queue.put_nowait(Delta(tokens, logprobs, reason, error, version))
                self.weight_version = version
        elif kind == "version":
            self.weight_version = body
        elif kind == "failed":
            self.failure = body


async def serve(link: socket.socket, http: socket.socket, parent: int) -> None:
    """The child: the app over an EngineClient, served on `http` until the link ends or the parent changes."""
    reader, writer = await asyncio.open_unix_connection(sock=link)
    try:
        _, served_fields, facts, episodes = await read(reader)
        client = EngineClient(writer, **facts)
        store = AgentEpisodes(*episodes) if episodes is not None else None
        server = uvicorn_server(build_app(ServedModel(loop=client, episodes=store, **served_fields)))
        serving = asyncio.ensure_future(server.serve(sockets=[http]))
        while not server.started:
            if serving.done():
                serving.result()
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.01)
    except BaseException:
        write(writer, ("error", traceback.format_exc()))
        await writer.drain()
        raise
    write(writer, ("ready", None))
    calls: set[asyncio.Task] = set()  # the trainer's calls of the episodes, held while they run

    async def follow():
        while (message := await read(reader)) is not None:
            if message[0] == "episodes":
                calls.add(call := asyncio.ensure_future(remote_call(
                    store, message[1], lambda: client.failure, lambda answer: write(writer, ("episodes", answer)))))
                call.add_done_callback(calls.discard)
            else:
                client.receive(*message)

    async def watch():
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
    tasks = [asyncio.ensure_future(follow()), asyncio.ensure_future(watch()), serving]
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    await serving
    for task in tasks[:2]:
        task.cancel()
    writer.close()
    for task in done:
        task.result()  # a failure here: its traceback, and an exit code the parent reports


def send(sock: socket.socket, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(HEADER.pack(len(data)) + data)


def recv(sock: socket.socket):
    """The next message; None at the end of the link."""
    header = recv_exactly(sock, HEADER.size)
    data = None if header is None else recv_exactly(sock, HEADER.unpack(header)[0])
    return None if data is None else pickle.loads(data)


def recv_exactly(sock: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return buf


def write(writer: asyncio.StreamWriter, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(HEADER.pack(len(data)) + data)


async def read(reader: asyncio.StreamReader):
    try:
        header = await reader.readexactly(HEADER.size)
        return pickle.loads(await reader.readexactly(HEADER.unpack(header)[0]))
    except asyncio.IncompleteReadError:
        return None


def main() -> None:
    link, http, parent = map(int, sys.argv[1:4])
    asyncio.run(serve(socket.socket(fileno=link), socket.socket(fileno=http), parent))


if __name__ == "__main__":
    main()
