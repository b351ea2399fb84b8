"""Throughput of `onepath serve`: N concurrent streaming requests through the HTTP server vs the same requests
given to the engine directly (LLMEngine.generate); tokens/s of both and their ratio. JSON in bench/results/serve/.

    python bench/serve.py --model tiny --device cpu --requests 32 --prompt-len 32 --max-tokens 64
    python bench/serve.py --model qwen3-0.6b --device cuda --requests 256 --prompt-len 512 --max-tokens 512 \
        --out bench/results/serve/serve-qwen3-0.6b-h200.json

The model is a random one of a bench shape (onepath/bench/workloads.py) with a synthetic tokenizer of its
vocabulary (one word per token id: the server decodes every streamed token as it would a real one). Every
request samples max_tokens tokens (ignore_eos), so both sides run the same tokens. The server and its engine
run in this process as `onepath serve` runs them; the clients run in a second process (raw HTTP/1.1, one
connection per stream, SSE parsed, tokens counted from each chunk's token_ids), so their parsing does not
take the server's CPU. Each side runs once untimed first (kernels compiled, CUDA graphs captured).
The engine thread and the HTTP thread share the GIL: --gil-switch-ms bounds how long one waits for the other.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

from onepath.bench.results import environment, save_json  # noqa: E402
from onepath.bench.workloads import MODELS, model_config  # noqa: E402
from onepath.engine.device import require_device  # noqa: E402
from onepath.engine.llm_engine import LLMEngine  # noqa: E402
from onepath.engine.sampling_params import SamplingParams  # noqa: E402
from onepath.engine.scheduler import SchedulerConfig  # noqa: E402
from onepath.models import build_decoder  # noqa: E402
from onepath.numerics.spec import ExecutionSpec  # noqa: E402
from onepath.ops import Ops  # noqa: E402
from onepath.serve.app import HTTPServer, ServedModel, build_app  # noqa: E402
from onepath.serve.engine_loop import EngineLoop  # noqa: E402

NAME = "bench"


def synthetic_tokenizer(vocab: int) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tok


def build_engine(args, tokenizer) -> LLMEngine:
    config = model_config(args.model)
    max_len = args.prompt_len + args.max_tokens + 1
    model = build_decoder(config, Ops(ExecutionSpec.default(args.mode, args.device)), max_positions=max_len)
    model.init_weights(0, std=0.02)
    if args.device == "cuda":
        model.to(torch.device("cuda"))
    scheduler = SchedulerConfig(max_num_seqs=args.requests, max_num_batched_tokens=max(args.batched_tokens, max_len),
                                max_model_len=max_len)
    return LLMEngine(model, scheduler=scheduler, tokenizer=tokenizer, enable_prefix_caching=False,  # runs repeat prompts
                     num_blocks=None if args.device == "cuda" else args.requests * (-(-max_len // 16)) + 8)


def prompts(args, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]


def direct(engine: LLMEngine, ids: list[list[int]], args) -> dict:
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=i) for i in range(len(ids))]
    start = time.perf_counter()
    outputs = engine.generate(ids, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "errors": sum(o.error is not None for o in outputs)}


def through_server(url: str, ids: list[list[int]], args) -> dict:
    """The clients' process: every request streamed at once; tokens counted from the chunks."""
    job = json.dumps({"url": url, "prompts": ids, "max_tokens": args.max_tokens})
    out = subprocess.run([sys.executable, __file__, "--client"], input=job, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


async def stream(host: str, port: int, body: dict) -> tuple[int, str | None]:
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n" + data)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    raw = await reader.read()  # to the end: Connection: close
    writer.close()
    if status != 200:
        return 0, f"HTTP {status}"
    tokens, done = 0, False
    for line in raw.split(b"\n"):
        if line.startswith(b"data: "):
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
            else:
                chunk = json.loads(payload)
                if "error" in chunk:
                    return tokens, chunk["error"]["message"]
                tokens += sum(len(c["token_ids"]) for c in chunk["choices"])
    return tokens, None if done else "no [DONE]"


async def clients(job: dict) -> dict:
    host, port = job["url"].removeprefix("http://").rsplit(":", 1)
    bodies = [{"model": NAME, "prompt": p, "max_tokens": job["max_tokens"], "ignore_eos": True, "seed": i,
               "stream": True} for i, p in enumerate(job["prompts"])]
    start = time.perf_counter()
    results = await asyncio.gather(*(stream(host, int(port), b) for b in bodies))
    seconds = time.perf_counter() - start
    tokens = sum(t for t, _ in results)
    errors = [e for _, e in results if e is not None]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "errors": len(errors),
            "first_error": errors[0] if errors else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=sorted(MODELS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--mode", default="consistent", choices=("consistent", "baseline"))
    p.add_argument("--requests", type=int, default=32, help="concurrent streams (and the engine's max_num_seqs)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batched-tokens", type=int, default=4096, help="max_num_batched_tokens")
    p.add_argument("--gil-switch-ms", type=float, default=None,
                   help="sys.setswitchinterval in ms for this process (default Python's, 5): how long the engine "
                   "thread may wait for the GIL while the HTTP thread holds it")
    p.add_argument("--out", default=None, help="JSON result (default bench/results/serve/serve-MODEL-DEVICE.json)")
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        print(json.dumps(asyncio.run(clients(json.loads(sys.stdin.read())))))
        return 0
    require_device(args.device)
    torch.set_num_threads(1)
    if args.gil_switch_ms is not None:
        sys.setswitchinterval(args.gil_switch_ms / 1000)
    tokenizer = synthetic_tokenizer(model_config(args.model).vocab_size)
    ids = prompts(args, model_config(args.model).vocab_size)
    engine = build_engine(args, tokenizer)
    direct(engine, ids, args)  # untimed
    result = {"direct": direct(engine, ids, args)}
    loop = EngineLoop(engine).start()
    server = HTTPServer(build_app(ServedModel(NAME, loop, tokenizer)), "127.0.0.1", 0).start()
    try:
        through_server(server.url, ids, args)  # untimed
        result["server"] = through_server(server.url, ids, args)
    finally:
        server.stop()
        loop.stop()
    result["server_over_direct"] = result["server"]["tokens_per_s"] / result["direct"]["tokens_per_s"]
    command = "python bench/serve.py " + shlex.join(sys.argv[1:])
    report = {"command": command, "environment": environment(args.device),
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "client")}, **result}
    out = Path(args.out or f"bench/results/serve/serve-{args.model}-{args.device}.json")
    save_json(report, out)
    for side in ("direct", "server"):
        r = result[side]
        print(f"{side:>7}: {r['tokens']} tokens in {r['seconds']:.2f} s = {r['tokens_per_s']:.0f} tokens/s, "
              f"{r['errors']} errors")
    print(f"server / direct = {result['server_over_direct']:.3f} ({args.requests} streams); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
