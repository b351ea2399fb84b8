"""Throughput of `onepath serve`: N concurrent streaming requests through the HTTP server vs the same requests
given to the engine directly (LLMEngine.generate); tokens/s of both and their ratio. JSON in bench/results/serve/.

    python bench/serve.py --model tiny --device cpu --requests 32 --prompt-len 32 --max-tokens 64
    python bench/serve.py --model qwen3-0.6b --device cuda --requests 256 --prompt-len 512 --max-tokens 512 \
        --out bench/results/serve/serve-qwen3-0.6b-process-h200.json

The model is a random one of a bench shape (onepath/bench/workloads.py) with a synthetic tokenizer of its
vocabulary (one word per token id: the server decodes every streamed token as it would a real one). Every
request samples max_tokens tokens (ignore_eos), so both sides run the same tokens. The engine runs in this
process; the HTTP front end in a process of its own (--front-end process, serve/frontend.py) or in a thread of
this one (--front-end thread: the two share the GIL, and --gil-switch-ms bounds how long one waits for the
other). The clients run in a further process (raw HTTP/1.1, one connection per stream, SSE parsed, tokens
counted from each chunk's token_ids), so their parsing does not take the server's CPU. Each side runs once
untimed first (kernels compiled, CUDA graphs captured), then --repeat times, the two alternating (the engine
alone runs inside EngineLoop.held()). Beside tokens/s, each side's CPU seconds: this process's (the engine's,
all its threads), the front end process's and the clients' (from /proc on Linux), which say what the engine's
process pays per token whatever else loads the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from onepath.serve.frontend import FrontEnd  # noqa: E402

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
    start, cpu, steps = time.perf_counter(), time.process_time(), engine.stats.steps
    outputs = engine.generate(ids, params)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "errors": sum(o.error is not None for o in outputs), "engine_steps": engine.stats.steps - steps,
            "engine_process_cpu_s": cpu}


def through_server(url: str, ids: list[list[int]], args, engine: LLMEngine, front_end_pid: int | None) -> dict:
    """The clients' process: every request streamed at once; tokens counted from the chunks."""
    job = json.dumps({"url": url, "prompts": ids, "max_tokens": args.max_tokens})
    cpu, front, steps = time.process_time(), cpu_seconds(front_end_pid), engine.stats.steps
    out = subprocess.run([sys.executable, __file__, "--client"], input=job, capture_output=True, text=True, check=True)
    result = {**json.loads(out.stdout), "engine_steps": engine.stats.steps - steps,
              "engine_process_cpu_s": time.process_time() - cpu}
    if front_end_pid is not None:
        result["front_end_process_cpu_s"] = cpu_seconds(front_end_pid) - front
    return result


def cpu_seconds(pid: int | None) -> float:
    """A process's user + system CPU seconds so far (Linux /proc)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    start, cpu = time.perf_counter(), time.process_time()
    results = await asyncio.gather(*(stream(host, int(port), b) for b in bodies))
    seconds = time.perf_counter() - start
    tokens = sum(t for t, _ in results)
    errors = [e for _, e in results if e is not None]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "errors": len(errors),
            "first_error": errors[0] if errors else None, "clients_cpu_s": time.process_time() - cpu}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=sorted(MODELS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--mode", default="consistent", choices=("consistent", "baseline"))
    p.add_argument("--requests", type=int, default=32, help="concurrent streams (and the engine's max_num_seqs)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batched-tokens", type=int, default=4096, help="max_num_batched_tokens")
    p.add_argument("--front-end", default="process", choices=("process", "thread"),
                   help="the HTTP server in a process of its own (as `onepath serve`), or in a thread of the engine's")
    p.add_argument("--gil-switch-ms", type=float, default=None,
                   help="sys.setswitchinterval in ms for this process (default Python's, 5): how long the engine "
                   "thread may wait for the GIL while the HTTP thread holds it")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed runs of each side, alternating; the JSON keeps the run of median ratio, and every ratio")
    p.add_argument("--out", default=None,
                   help="JSON result (default bench/results/serve/serve-MODEL-FRONT_END-DEVICE.json)")
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
    loop = EngineLoop(engine).start()
    served = ServedModel(NAME, loop, tokenizer)
    server = FrontEnd(served, "127.0.0.1", 0) if args.front_end == "process" else \
        HTTPServer(build_app(served), "127.0.0.1", 0)
    server.start()
    pid = server.process.pid if args.front_end == "process" else None
    runs = []
    try:
        for i in range(args.repeat + 1):  # the first untimed
            with loop.held():  # the engine alone, the server idle
                alone = direct(engine, ids, args)
            runs.append((alone, through_server(server.url, ids, args, engine, pid)))
    finally:
        server.stop()
        loop.stop()
    repeats = [{"server_over_direct": s["tokens_per_s"] / d["tokens_per_s"],
                "engine_process_cpu_server_over_direct": s["engine_process_cpu_s"] / d["engine_process_cpu_s"]}
               for d, s in runs[1:]]
    median = sorted(range(args.repeat), key=lambda i: repeats[i]["server_over_direct"])[args.repeat // 2]
    result = {"direct": runs[1 + median][0], "server": runs[1 + median][1], **repeats[median]}
    if args.repeat > 1:
        result["repeats"] = repeats
    command = "python bench/serve.py " + shlex.join(sys.argv[1:])
    report = {"command": command, "environment": environment(args.device),
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "client")}, **result}
    out = Path(args.out or f"bench/results/serve/serve-{args.model}-{args.front_end}-{args.device}.json")
    save_json(report, out)
    for side in ("direct", "server"):
        r = result[side]
        print(f"{side:>7}: {r['tokens']} tokens in {r['seconds']:.2f} s = {r['tokens_per_s']:.0f} tokens/s, "
              f"{r['errors']} errors, {r['engine_steps']} steps; CPU s: engine's process "
              f"{r['engine_process_cpu_s']:.2f}"
              + (f", front end's {r['front_end_process_cpu_s']:.2f}" if "front_end_process_cpu_s" in r else "")
              + (f", clients' {r['clients_cpu_s']:.2f}" if "clients_cpu_s" in r else ""))
    if args.repeat > 1:
        print("server / direct tokens/s in each run: "
              + ", ".join(f"{r['server_over_direct']:.3f}" for r in result["repeats"]) + "; the median's:")
    print(f"server / direct = {result['server_over_direct']:.3f} tokens/s, "
          f"{result['engine_process_cpu_server_over_direct']:.3f} engine-process CPU ({args.requests} streams, "
          f"front end in a {args.front_end}); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
