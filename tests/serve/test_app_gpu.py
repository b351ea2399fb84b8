"""The server on the GPU: 256 concurrent streams through HTTP without an error, each stream's tokens and
log-probs bitwise those of the same requests run on the engine directly in one batch (CUDA graphs on), with the
HTTP front end in a thread of the engine's process and in a process of its own (serve/frontend.py)."""
import asyncio
import json

import pytest
import torch

from onepath.engine.sampling_params import SamplingParams
from tests.serve.test_frontend import split
from tests.serving import MODEL, chat_engine, serving

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
STREAMS = 256


async def stream(host: str, port: int, body: dict) -> tuple[list[int], list[float]]:
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps({**body, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n" + data)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    tokens, logprobs = [], []
    events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1].strip() == b"[DONE]", raw[-300:]
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            tokens += choice["token_ids"]
            logprobs += choice["logprobs"]["token_logprobs"]
    return tokens, logprobs


@pytest.mark.parametrize("front_end", ["thread", "process"])
def test_256_concurrent_streams_get_what_the_engine_gives_directly(front_end):
    g = torch.Generator().manual_seed(0)
    bodies = [{"model": MODEL, "prompt": torch.randint(1, 90, (int(n),), generator=g).tolist(), "max_tokens": 64,
               "ignore_eos": True, "seed": i} for i, n in enumerate(torch.randint(1, 200, (STREAMS,), generator=g))]
    direct = chat_engine(device="cuda", max_model_len=512, max_num_seqs=STREAMS, num_blocks=4096)
    for i, b in enumerate(bodies):
        direct.add_request(b["prompt"], SamplingParams(max_tokens=64, ignore_eos=True, seed=b["seed"]), i, 0)
    expected = {}
    while direct.has_unfinished():
        for seq in direct.step():
            expected[seq.request_id] = (seq.completion_token_ids, seq.logprobs)
    engine = chat_engine(device="cuda", max_model_len=512, max_num_seqs=STREAMS, num_blocks=4096)
    with (serving(engine) if front_end == "thread" else split(engine)) as (url, _):
        host, port = url.removeprefix("http://").rsplit(":", 1)

        async def all_streams():
            return await asyncio.gather(*(stream(host, int(port), b) for b in bodies))
        got = asyncio.run(all_streams())
    for i, (tokens, logprobs) in enumerate(got):
        assert tokens == expected[i][0] and torch.equal(torch.tensor(logprobs), torch.tensor(expected[i][1]))
