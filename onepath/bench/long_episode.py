"""Long multi-turn tool episodes, rollout to update, with diff = 0 on every policy token.

    python -m onepath.bench.long_episode --out bench/results/train/long-episode-qwen3-0.6b.json   # CUDA: 4 x 32,768
    python -m onepath.bench.long_episode --device cpu --out /tmp/long-episode.json              # CPU: 4 x 2,048, tiny

The model is a bench preset with random weights (onepath/bench/workloads.py: qwen3-0.6b on CUDA, the embedded
tiny shape on the CPU). --episodes G episodes of one prompt (one GRPO group) run through the episode machinery
of training (train/episodes.py run_episodes, train/tool_env.py ChatEnv): each policy turn of up to --turn-tokens
tokens, then a tool result of --reply-tokens tokens rendered by a ChatML chat template with tools and appended
as tokens, until the episode is --tokens long. A random-weight policy writes no tool calls, so the environment
is scripted: after every turn it answers with `read_output`, the next slice of a build log, run through a
Toolbox like any tool (the calls the policy did write are parsed and counted); the last slice is sized so that
the final turn ends at --tokens. The tokenizer has one token per printable character (a tool result of N
characters is N tokens), ChatML's control tokens at the top of the vocabulary, and a word for every other id, so
every sampled token decodes.

The engine's max_model_len is --tokens and its KV cache is sized for the episodes: by gpu_memory_utilization on
CUDA (the engine's own sizing, engine/memory.py), G x max_model_len tokens on the CPU. Then the trainer (a second
copy of the weights, as a colocated run holds them): its log-probs of every policy token with no grad, diffed
against the engine's (torch.equal over the mask and the verl metrics); forward and backward of one GRPO loss at
each --micro-batch-tokens setting with train.recompute on (plus the first setting with recompute off,
--recompute-control), each with its peak memory (torch.cuda.max_memory_allocated on CUDA; on the CPU the growth
of the process's peak resident set, reset before each phase through /proc/self/clear_refs); one AdamW step; the
weights into the engine; a second rollout and its diff. --modes consistent baseline runs both modes: the
baseline is the control (its engine and trainer are expected to differ). A setting that runs out of GPU memory
is a row with its error (the others still run). The group's scores are the mean of each episode's sampled token
ids (a random policy has no task; any score that differs within the group gives the update a gradient). Exit
status 1 when the consistent mode's diff is not 0.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import math
import resource
import string
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from onepath.bench.results import environment, print_table, save_json
from onepath.bench.workloads import MODELS, model_config
from onepath.chat.encoder import ChatEncoder
from onepath.chat.template import ChatTemplate
from onepath.chat.tool_calls import ToolCall, detect_format, parse
from onepath.chat.tools import Toolbox
from onepath.engine.device import require_device
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models import build_decoder
from onepath.numerics.diff import is_exact, rollout_diff
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from onepath.train.actor import Actor
from onepath.train.episodes import MAX_TURNS, episode_responses, masked_logprobs, run_episodes
from onepath.train.grpo import group_advantages, policy_loss
from onepath.train.tool_env import ChatEnv

GIB = 1 << 30
BLOCK_SIZE = 16
CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
           "</tool_response>")
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
# ChatML: the tools (name, arguments, description) in the system turn, tool results as user turns, Hermes calls
TEMPLATE = r"""
{%- set system = messages[0].content if messages[0].role == 'system' else '' -%}
{%- if system or tools -%}
{{ '<|im_start|>system\n' + system }}
{%- if tools -%}
{{ '\n\nTools, called as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>:' }}
{%- for tool in tools %}
{{- '\n- ' + tool.function.name + '(' + (tool.function.parameters.properties | list | join(', ')) + '): ' }}
{{- tool.function.description }}
{%- endfor -%}
{%- endif -%}
{{ '<|im_end|>\n' }}
{%- endif -%}
{%- for m in messages if m.role != 'system' -%}
{%- if m.role == 'tool' -%}
{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- else -%}
{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}
"""
PROMPT = [{"role": "system", "content": "Read the build log and fix the failing tests."},
          {"role": "user", "content": "The nightly build failed. What broke?"}]
LOG_LINE = 48  # characters per line of the job's log


def chat_tokenizer(vocab_size: int) -> Tokenizer:
    """One token per printable ASCII character and newline, ChatML's control tokens as the top ids of the
    vocabulary, and a word `[id]` for every other id: every id a model of this vocabulary samples decodes,
    and a text of N plain characters is N tokens."""
    words = CHARS + [f"[{i}]" for i in range(len(CHARS), vocab_size - len(CONTROL))]
    if len(words) != vocab_size - len(CONTROL):
        raise ValueError(f"vocab_size {vocab_size} is too small for the bench's tokenizer: it needs at least "
                         f"{len(CHARS) + len(CONTROL)} ids")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL])
    return tok


def chat_encoder(vocab_size: int) -> ChatEncoder:
    template = ChatTemplate({"default": TEMPLATE}, "the long-episode bench's ChatML template",
                            {"eos_token": "<|im_end|>"})
    return ChatEncoder(template, chat_tokenizer(vocab_size), tools=[read_output])


def read_output(offset: int, length: int) -> str:
    """The build log.

    Args:
        offset: First character.
        length: Characters to read.
    """
    first, last = offset // LOG_LINE, (offset + length) // LOG_LINE + 1
    lines = "".join(f"[{i:06d}] test_case_{i % 97:02d} ... {'ok' if i % 13 else 'FAILED'}".ljust(LOG_LINE - 1) + "\n"
                    for i in range(first, last))
    return lines[offset - first * LOG_LINE:][:length]


class LogEnv(ChatEnv):
    """After each policy turn, the next slice of the build log as a read_output tool result of `reply_tokens`
    tokens; the last one is sized so that the episode reaches `target` tokens when its final turn runs to
    `turn_tokens`; done when no room is left. The answer depends on the episode alone (its tool results so far),
    as run_episodes requires."""

    def __init__(self, chat: ChatEncoder, target: int, turn_tokens: int, reply_tokens: int):
        super().__init__(chat)
        self.toolbox = Toolbox([read_output])
        self.tool_format = detect_format(chat.template.source_for(self.toolbox.schemas))
        self.target, self.turn_tokens, self.reply_tokens = target, turn_tokens, reply_tokens
        # the tokens around an empty result, the end-of-turn token a cut-off turn lacks included
        probe = PROMPT + [{"role": "assistant", "content": "x"}]
        self.wrap = len(chat.append_ids(probe, [self.result(0, 0, "probe")], ended=False))
        # enough turns to reach the target with every turn and result at its shortest (one token)
        self.max_turns = min(MAX_TURNS, math.ceil(target / (self.wrap + 2)) + 1)

    def result(self, offset: int, length: int, call_id: str) -> dict:
        return self.toolbox.call(ToolCall("read_output", {"offset": offset, "length": length}, call_id))

    def reply(self, episode, text: str):
        written = parse(text, self.tool_format)
        read = sum(len(m["content"]) for m in episode.messages if m["role"] == "tool")
        room = self.target - len(episode) - self.wrap - self.turn_tokens
        info = {"tool_calls": episode.reward_info.get("tool_calls", 0) + len(written.calls),
                "tool_errors": episode.reward_info.get("tool_errors", 0) + len(written.errors)}
        if room < 1:
            return None, info
        # the last result takes all the room when no full round (result, wrap, turn) would follow it
        length = room if room <= self.reply_tokens + self.wrap + self.turn_tokens else self.reply_tokens
        return [self.result(read, length, f"call_{episode.turns - 1}")], info


@contextmanager
def peak_memory(device: str, out: dict):
    """out["peak_gib"] (CUDA: the allocator's peak) and out["peak_growth_gib"] (above what was allocated, or
    resident on the CPU, at the start); on the CPU the growth of the process's peak resident set."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        yield
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        out.update(peak_gib=peak / GIB, peak_growth_gib=(peak - base) / GIB, memory="torch.cuda.max_memory_allocated")
        return
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)  # freed heap back to the OS, so that the resident set starts from what is live
    resettable = reset_peak_rss()
    base = proc_status("VmRSS") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    yield
    peak = proc_status("VmHWM") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.update(peak_gib=peak / GIB, peak_growth_gib=(peak - base) / GIB,
               memory="peak resident set growth" + ("" if resettable else " (ru_maxrss, never reset: a lower bound)"))


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak resident set starts again from now
        return True
    except OSError:
        return False


def proc_status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_model(args, mode: str):
    spec = ExecutionSpec.default(mode, args.device)
    model = build_decoder(model_config(args.model), Ops(spec), max_positions=args.tokens)
    model.init_weights(args.seed, std=args.init_std)
    if args.device == "cuda":
        model.to(torch.device("cuda"))
    return model


def build_engine(args, model, chat: ChatEncoder) -> LLMEngine:
    scheduler = SchedulerConfig(max_num_seqs=args.episodes, max_model_len=args.tokens,
                                max_num_batched_tokens=args.batched_tokens)
    # the CPU cache holds every episode at max_model_len; on CUDA the engine sizes it from the memory fraction
    blocks = None if args.device == "cuda" else args.episodes * -(-args.tokens // BLOCK_SIZE) + 1
    return LLMEngine(model, num_blocks=blocks, block_size=BLOCK_SIZE, scheduler=scheduler,
                     eos_token_ids=(chat.end_of_turn_id,), tokenizer=chat.tokenizer,
                     gpu_memory_utilization=args.gpu_memory_utilization)


def rollout(engine: LLMEngine, chat: ChatEncoder, env: LogEnv, args, first_id: int, seed: int):
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.turn_tokens, seed=seed,
                            stop_token_ids=(chat.end_of_turn_id,))
    prompt = chat.prompt_ids(PROMPT)
    preempted, cached = engine.stats.preemptions, engine.stats.cached_tokens
    summary = {}
    start = time.perf_counter()
    with peak_memory(args.device, summary):
        episodes = run_episodes(engine, [prompt] * args.episodes, env, params, env.max_turns,
                                episode_ids=list(range(first_id, first_id + args.episodes)),
                                conversations=[PROMPT] * args.episodes)
    seconds = time.perf_counter() - start
    rows = [{"tokens": len(e), "policy_tokens": sum(e.policy_mask), "env_tokens": len(e) - e.num_prompt_tokens
             - sum(e.policy_mask), "prompt_tokens": e.num_prompt_tokens, "turns": e.turns,
             "finish_reason": e.finish_reason, "tool_calls_written": e.reward_info.get("tool_calls", 0)}
            for e in episodes]
    policy = sum(r["policy_tokens"] for r in rows)
    summary.update(seconds=seconds, policy_tokens_per_s=policy / seconds,
                   preemptions=engine.stats.preemptions - preempted, cached_tokens=engine.stats.cached_tokens - cached)
    return episodes, episode_responses(episodes, params), rows, summary


def diff_of(actor: Actor, r, micro_batch_tokens: int | None, device: str) -> tuple[dict, dict]:
    """The diff of the trainer's log-probs (no grad) against the engine's over every policy token, and that
    forward's seconds and peak memory."""
    cost = {"micro_batch_tokens": micro_batch_tokens or 0}
    start = time.perf_counter()
    with torch.no_grad(), peak_memory(device, cost):
        lp, _ = masked_logprobs(actor, r, micro_batch_tokens)
    cost["seconds"] = time.perf_counter() - start
    mask = r.mask.to(lp.device)
    rollout_lp = r.rollout_logprobs.to(lp.device)
    metrics = rollout_diff(rollout_lp, lp, mask)
    equal = torch.equal(lp[mask], rollout_lp[mask])
    return {"torch_equal": equal, "exact": is_exact(metrics) and equal, "policy_tokens": int(mask.sum()),
            **metrics}, cost


def settings_of(args) -> list[tuple[int, bool]]:
    """(micro_batch_tokens, recompute) per measured forward + backward; 0 = the whole batch at once."""
    settings = [(m, True) for m in args.micro_batch_tokens]
    return settings + [(args.micro_batch_tokens[0], False)] if args.recompute_control else settings


def train(actor: Actor, r, episodes, args) -> dict:
    """Forward + backward of one GRPO loss at each setting, then one AdamW step on the last one's gradients (the last
    setting that did not run out of memory)."""
    device = actor.model.device
    mask, old = r.mask.to(device), r.rollout_logprobs.to(device)
    # no task for a random policy: the mean of its token ids is a score that differs within the group
    rewards = torch.tensor([sum(e.token_ids[i] for i, p in enumerate(e.policy_mask) if p) / max(sum(e.policy_mask), 1)
                            for e in episodes], dtype=torch.float64)
    advantages = group_advantages(rewards, len(episodes)).to(device)
    count = float(mask.sum())

    def loss_fn(rows, lp):
        return policy_loss(lp, old[rows], advantages[rows], mask[rows], args.clip_ratio, count=count)

    rows, reference = [], None
    for micro_batch_tokens, recompute in settings_of(args):
        actor.recompute = recompute
        row = {"micro_batch_tokens": micro_batch_tokens, "recompute": recompute,
               "micro_batches": len(actor.micro_batches(r, micro_batch_tokens or None))}
        start = time.perf_counter()
        try:
            with peak_memory(args.device, row):
                lp, _, stats = actor.backward(r, loss_fn, micro_batch_tokens or None,
                                              forward=partial(masked_logprobs, actor))
        except torch.OutOfMemoryError as e:
            row["error"] = f"out of memory: {str(e).splitlines()[0]}"
            actor.optimizer.zero_grad(set_to_none=True)
            actor.model.zero_grad(set_to_none=True)
            rows.append(row)
            continue
        row["seconds"] = time.perf_counter() - start
        row["pg_loss"] = stats["actor/pg_loss"]
        # a micro-batch's or a recomputed layer's log-probs are the same bits as the whole batch's
        reference = lp if reference is None else reference
        row["logprobs_equal_first_setting"] = torch.equal(lp[mask], reference[mask])
        rows.append(row)
    if reference is None:
        raise RuntimeError("every micro-batch setting ran out of memory: give --micro-batch-tokens one episode "
                           f"(--tokens {args.tokens}) or lower --gpu-memory-utilization")
    if "error" in rows[-1]:  # the failed setting's backward cleared the gradients: the last good one's again
        good = next(row for row in reversed(rows) if "error" not in row)
        actor.recompute = good["recompute"]
        actor.backward(r, loss_fn, good["micro_batch_tokens"] or None, forward=partial(masked_logprobs, actor))
    before = [p.detach().clone() for p in actor.model.parameters()]
    start = time.perf_counter()
    grad_norm = actor.step()
    sync(args.device)
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(actor.model.parameters(), before))
    return {"settings": rows, "step_seconds": time.perf_counter() - start, "grad_norm": grad_norm,
            "advantages": advantages.tolist(), "weights_changed_frac": changed / sum(b.numel() for b in before)}


def run_mode(mode: str, args, chat: ChatEncoder, env: LogEnv) -> dict:
    """Rollout, the diff, forward and backward per setting, one update, the weights into the engine, a second
    rollout and its diff, on one engine and one trainer of this mode."""
    engine = build_engine(args, build_model(args, mode), chat)
    # FP32 master weights under a BF16 model, as train.master_dtype float32 (none on the CPU: FP32 already)
    actor = Actor(build_model(args, mode), BLOCK_SIZE, args.lr, recompute=True, master_dtype=torch.float32)
    kv = dict(engine.memory, max_model_len=args.tokens, episodes_that_fit=engine.memory["kv_tokens"] // args.tokens)
    result = {"kv": kv, "rollouts": {}, "diff": {}, "trainer_logprobs": {}}
    first = args.micro_batch_tokens[0] or None

    def measure(phase: str, first_id: int):
        episodes, r, rows, summary = rollout(engine, chat, env, args, first_id, args.seed + first_id)
        result["rollouts"][phase] = {"episodes": rows, **summary}
        result["diff"][phase], result["trainer_logprobs"][phase] = diff_of(actor, r, first, args.device)
        return episodes, r

    episodes, r = measure("before", 0)
    result["trainer"] = train(actor, r, episodes, args)
    start = time.perf_counter()
    engine.update_weights(actor.model.named_parameters())
    sync(args.device)
    result["trainer"]["sync_seconds"] = time.perf_counter() - start
    measure("after", args.episodes)
    return result


def report(record: dict) -> None:
    rows = []
    for mode, m in record["modes"].items():
        for phase in ("before", "after"):
            d, ro = m["diff"][phase], m["rollouts"][phase]
            rows.append([mode, phase, "yes" if d["exact"] else "no", d["policy_tokens"],
                         d["training/rollout_probs_diff_max"], sum(e["tokens"] for e in ro["episodes"]),
                         sum(e["turns"] for e in ro["episodes"]), ro["seconds"]])
    print_table("diff over every policy token (engine vs trainer)",
                ["mode", "rollout", "diff = 0", "policy tokens", "max |dp|", "tokens", "turns", "rollout s"], rows)
    rows = [[mode, s["micro_batch_tokens"], "on" if s["recompute"] else "off", s["micro_batches"]]
            + ([s["error"]] if "error" in s else [s["peak_growth_gib"], s["peak_gib"], s["seconds"]])
            for mode, m in record["modes"].items() for s in m["trainer"]["settings"]]
    print_table("trainer forward + backward per micro-batch setting",
                ["mode", "micro_batch_tokens", "recompute", "micro-batches", "peak growth GiB", "peak GiB", "s"], rows)


def options(argv=None) -> argparse.Namespace:
    """The command line, defaults resolved for the device and checked against the model and the template."""
    p = argparse.ArgumentParser(prog="python -m onepath.bench.long_episode", description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when present")
    p.add_argument("--model", default=None, choices=sorted(MODELS), help="default: qwen3-0.6b on CUDA, tiny on the CPU")
    p.add_argument("--modes", nargs="+", default=["consistent", "baseline"], choices=("consistent", "baseline"))
    p.add_argument("--episodes", type=int, default=4, help="G: episodes of the one prompt (a GRPO group)")
    p.add_argument("--tokens", type=int, default=None, help="episode length and max_model_len (default: 32768 on "
                   "CUDA, 2048 on the CPU)")
    p.add_argument("--turn-tokens", type=int, default=None, help="max_tokens of a policy turn (default: 1024 on "
                   "CUDA, 64 on the CPU)")
    p.add_argument("--reply-tokens", type=int, default=None, help="tokens of a tool result (default: 3072 on CUDA, "
                   "192 on the CPU)")
    p.add_argument("--micro-batch-tokens", type=int, nargs="+", default=None,
                   help="train.micro_batch_tokens settings to measure, 0 = the whole batch (default: one, two and "
                        "all episodes: --tokens, 2 x --tokens, 0); the first also gives the diff's forward")
    p.add_argument("--recompute-control", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure the first micro-batch setting with train.recompute off")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                   help="the engine's share of the GPU (weights, KV, its step peak); the trainer takes the rest")
    p.add_argument("--batched-tokens", type=int, default=None, help="the engine's max_num_batched_tokens (default: "
                   "8192 on CUDA, 2048 on the CPU)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3, help="the one AdamW step's (large enough to move BF16 weights)")
    p.add_argument("--clip-ratio", type=float, default=0.2)
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    require_device(args.device)
    cuda = args.device == "cuda"
    args.model = args.model or ("qwen3-0.6b" if cuda else "tiny")
    args.tokens = args.tokens or (32768 if cuda else 2048)
    args.turn_tokens = args.turn_tokens or (1024 if cuda else 64)
    args.reply_tokens = args.reply_tokens or (3072 if cuda else 192)
    args.batched_tokens = args.batched_tokens or (8192 if cuda else 2048)
    args.micro_batch_tokens = args.micro_batch_tokens or [args.tokens, 2 * args.tokens, 0]
    config = model_config(args.model)
    prompt = len(chat_encoder(config.vocab_size).prompt_ids(PROMPT))
    least = prompt + 2 * args.turn_tokens + args.reply_tokens
    problems = [
        (args.episodes >= 2, f"--episodes {args.episodes} must be >= 2 (a group needs two scores to compare)"),
        (args.turn_tokens >= 1 and args.reply_tokens >= 1,
         f"--turn-tokens {args.turn_tokens} and --reply-tokens {args.reply_tokens} must be >= 1"),
        (args.tokens <= config.max_position_embeddings,
         f"--tokens {args.tokens} > max_position_embeddings {config.max_position_embeddings} of {args.model}: "
         "the model has no positions past it; lower --tokens"),
        (args.tokens >= least, f"--tokens {args.tokens} leaves no room for two turns and a tool result after the "
                               f"{prompt}-token prompt: give at least {least}, or shorter turns"),
        (all(m == 0 or m >= args.tokens for m in args.micro_batch_tokens),
         f"--micro-batch-tokens {args.micro_batch_tokens}: each must be 0 or >= --tokens {args.tokens} (a "
         "micro-batch holds whole episodes, at least one)"),
    ]
    for ok, message in problems:
        if not ok:
            p.error(message)
    args.prompt_tokens = prompt
    return args


def main(argv=None) -> int:
    args = options(argv)
    config = model_config(args.model)
    chat = chat_encoder(config.vocab_size)
    env = LogEnv(chat, args.tokens, args.turn_tokens, args.reply_tokens)
    record = {"command": "python -m onepath.bench.long_episode " + " ".join(sys.argv[1:] if argv is None else argv),
              **environment(args.device),
              "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "config": config.to_dict(), "tool_result_wrap_tokens": env.wrap, "modes": {}}
    for mode in args.modes:
        record["modes"][mode] = run_mode(mode, args, chat, env)
        gc.collect()  # this mode's engine and trainer gone before the next sizes its KV cache
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            save_json(record, Path(args.out))
    report(record)
    if args.out:
        print(f"wrote {args.out}")
    consistent = record["modes"].get("consistent")
    return 0 if consistent is None or all(d["exact"] for d in consistent["diff"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
