"""What the HTTP thread spends on one streamed chunk of one token, without the socket: the completion stream's
generator (serve/app.completion_chunks: detokenisation, log-prob entries, the asyncio queue) and the chunk's
json.dumps; and the incremental detokeniser per token, IncrementalText (tokenizers' DecodeStream) beside the
window-twice decode it replaced (two decodes of the last few tokens a step). bench/serve.py's synthetic tokenizer
over Qwen3's vocabulary, 5000 one-token deltas.

    python lab/serve_chunk_cost.py > lab/results/serve-chunk-cost.log
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

from serve import synthetic_tokenizer  # noqa: E402  (bench/serve.py)

from onepath.serve.app import ServedModel, completion_chunks  # noqa: E402
from onepath.serve.engine_loop import Delta, Stream  # noqa: E402
from onepath.serve.protocol import completion_request  # noqa: E402
from onepath.serve.text import IncrementalText  # noqa: E402

N = 5000
VOCAB = 151936
WINDOW = 6


class WindowTwice:
    """The detokeniser before DecodeStream: the last WINDOW tokens decoded with and without the new ones."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def add(self, token_ids):
        self.ids += token_ids
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.read = len(self.ids)
        self.prefix = max(0, self.read - WINDOW)
        return after[len(before):]


def per_token_us(make, tokenizer) -> float:
    text = make(tokenizer)
    start = time.perf_counter()
    for i in range(N):
        text.add([i * 7 % VOCAB])
    return (time.perf_counter() - start) / N * 1e6


async def chunks_us(tokenizer) -> tuple[float, float]:
    class Loop:
        weight_version = 0
    served = ServedModel("bench", Loop(), tokenizer)
    stream = Stream(None)

    async def produce():  # one delta at a time: each becomes its own chunk
        for i in range(N):
            stream.queue.put_nowait(Delta([i * 7 % VOCAB], [-0.5], None if i < N - 1 else "length"))
            await asyncio.sleep(0)
    producer = asyncio.ensure_future(produce())
    req = completion_request({"model": "bench", "prompt": [1, 2, 3], "max_tokens": N, "stream": True})
    count, encoding, start = 0, 0.0, time.perf_counter()
    async for chunk in completion_chunks(served, req, "cmpl-0", [1, 2, 3], [stream],
                                         [IncrementalText(tokenizer, True)]):
        t = time.perf_counter()
        f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        encoding += time.perf_counter() - t
        count += 1
    await producer
    assert count == N, count
    return (time.perf_counter() - start) / N * 1e6, encoding / N * 1e6


def main() -> None:
    tokenizer = synthetic_tokenizer(VOCAB)
    print(f"detokeniser per token: window twice {per_token_us(WindowTwice, tokenizer):.1f} us, "
          f"IncrementalText (DecodeStream) {per_token_us(lambda t: IncrementalText(t, True), tokenizer):.1f} us")
    total, encoding = asyncio.run(chunks_us(tokenizer))
    print(f"completion stream per one-token chunk: {total:.1f} us (the producer's put included), of which "
          f"json.dumps {encoding:.1f} us")


if __name__ == "__main__":
    main()
