"""What the link to a front end process (serve/frontend.py) costs each side a step: the engine's process
builds, pickles and writes one message with every request's new tokens (FrontEnd.put, on the engine thread), the
front end reads it and puts each delta into its stream's queue (EngineClient.receive). 256 one-token deltas a
step, as bench/serve.py's GPU run has them (the HTTP thread paid about 35 us a chunk for them before the split,
lab/serve_chunk_cost.py: some 9 ms a step).

    python lab/serve_link_cost.py > lab/results/serve-link-cost.log
"""
from __future__ import annotations

import asyncio
import os
import pickle
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from onepath.serve.engine_loop import Delta, Stream  # noqa: E402
from onepath.serve.frontend import HEADER, EngineClient, FrontEnd  # noqa: E402

STREAMS = 256
STEPS = 500
VOCAB = 151936


def step_items() -> list[tuple[Stream, Delta]]:
    return [(Stream(None, i), Delta([i * 7 % VOCAB], [-0.5 - i / 1000])) for i in range(STREAMS)]


def engine_side_us() -> tuple[float, int]:
    """FrontEnd.put a step (a reader drains the other end); the message's bytes."""
    class Loop:
        failure = None
    front = object.__new__(FrontEnd)  # the sink alone: no child process
    front.loop, front.lock, front.sending, front.streams = Loop(), threading.Lock(), threading.Lock(), {}
    front.link, other = socket.socketpair()
    threading.Thread(target=lambda: all(iter(lambda: other.recv(1 << 20), b"")), daemon=True).start()
    items = step_items()
    start = time.perf_counter()
    for _ in range(STEPS):
        front.put(items)
    seconds = time.perf_counter() - start
    front.link.close()
    size = len(pickle.dumps(("deltas", [(s.key, d.token_ids, d.logprobs, d.finish_reason, d.error,
                                         d.weight_version) for s, d in items]), protocol=pickle.HIGHEST_PROTOCOL))
    return seconds / STEPS * 1e6, HEADER.size + size


async def front_end_side_us() -> float:
    """The message unpickled and its deltas put into the streams' queues, a step."""
    client = EngineClient(None, 0, VOCAB, (), 0)
    client.streams = {i: Stream(None, i) for i in range(STREAMS)}
    data = pickle.dumps(("deltas", [(i, [i * 7 % VOCAB], [-0.5 - i / 1000], None, None, 0) for i in range(STREAMS)]),
                        protocol=pickle.HIGHEST_PROTOCOL)
    start = time.perf_counter()
    for _ in range(STEPS):
        client.receive(*pickle.loads(data))
        for stream in client.streams.values():
            stream.queue.get_nowait()
    return (time.perf_counter() - start) / STEPS * 1e6


def main() -> None:
    engine_us, size = engine_side_us()
    print(f"{STREAMS} one-token deltas a step, one message of {size} bytes")
    print(f"the engine's process (FrontEnd.put: pickle, socket write): {engine_us:.0f} us a step")
    print(f"the front end process (unpickle, the streams' queues): {asyncio.run(front_end_side_us()):.0f} us a step")


if __name__ == "__main__":
    main()
