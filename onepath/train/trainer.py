"""The GRPO loop: rollout on the engine, reward, recompute log-probs on the trainer, compare, update, sync.

One update per step (step batch = mini-batch), so the trainer's weights are the weights that
sampled, and in consistent mode every diff metric is exactly 0 before every update.

The same loop runs on one process or on N started by torchrun, the rollout and trainer layouts
chosen by RunConfig.parallel (train/parallel.py; docs/training.md).

Old log-probs (train.old_logprob): the update's own forward runs with grad on every step; on a
verified step its detached values are the old log-probs and are diffed against the rollout's (no
second forward), on other steps the rollout's log-probs are the old ones. In consistent mode the two
are the same bits, so every policy trains the same weights.

Micro-batches (train.micro_batch_tokens): forward and backward run per micro-batch of whole
sequences, gradients summed. Each micro-batch's loss is a share of the step's token-mean (divided by
all the step's valid tokens); when MIS takes tokens out of the mean, the summed gradients are scaled
by valid / kept before clipping. train.recompute rebuilds each layer's activations in backward.

Evaluation (train.val_every) samples the held-out rows on the same engine after the weight sync,
with request ids below 0 (training's are >= 1_000_000), so no sampling key (seed, request id,
position) is shared; it reads no training row and leaves the engine as it found it.

Multi-turn (rollout.env): each training sample is an episode of up to rollout.max_turns policy turns
with the environment's tokens between them (train.episodes). The reward reads the episode's final
answer, the mask keeps policy tokens only, so the diff, the loss and response_length cover those
alone. Evaluation stays single-turn.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import resource
import tempfile
import time
import uuid
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from onepath.chat.encoder import ChatEncoder
from onepath.chat.tools import Toolbox, load_toolbox
from onepath.config import RunConfig, dump_yaml, engine_settings, sampling_params, trainer_spec
from onepath.numerics.diff import rollout_diff
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.models import build_decoder
from onepath.models.checkpoint import load_config, load_state_dict, load_tokenizer, load_tokenizer_config, save_checkpoint
from onepath.models.config import ModelConfig
from onepath.models.dense import DenseDecoder
from onepath.models.moe import routing_agreement
from onepath.numerics.spec import DTYPES, ExecutionSpec, check_same_spec
from onepath.ops import Ops
from onepath.tasks import arithmetic, code, word_problems
from onepath.tasks.calculator import CalculatorEnv
from onepath.train import checkpoint
from onepath.train.actor import Responses
from onepath.train.agent import AgentRollout
from onepath.train.data import PromptSampler, Prompts, chat_template, load_rows, prompt_text, reward_kwargs
from onepath.train.episodes import episode_metrics, episode_responses, masked_logprobs, run_episodes
from onepath.train.grpo import NonFiniteError, group_advantages, policy_loss, rollout_correction
from onepath.train.metrics import MetricsLogger, Timer, require_wandb
from onepath.train.parallel import World, actor_for, generate_in_lockstep, sync_weights, tensor_parallel_engine_model
from onepath.train.rewards import check_reward, get_reward, overlong_penalty, reward_problem, score_batch
from onepath.train.tool_env import ToolEnv
from onepath.train.warm_start import warm_start


@dataclass
class Setup:
    """What both modes of a run share: tokenizer, architecture, initial weights, data, reward."""
    tokenizer: object
    tokenizer_config: dict
    model_config: ModelConfig
    init_state: dict
    train_rows: list
    test_rows: list
    reward_fn: object
    eos_token_ids: tuple
    prompts: Prompts | None = None      # rows' prompts as token ids (the chat template, when there is one)
    toolbox: Toolbox | None = None      # rollout.tools

    def __post_init__(self):
        if self.prompts is None:
            self.prompts = Prompts(self.tokenizer)


def build_model(model_config: ModelConfig, spec: ExecutionSpec, max_positions: int, state: dict | None) -> DenseDecoder:
    model = build_decoder(model_config, Ops(spec), max_positions=max_positions)
    if state is None:
        model.init_weights(seed=0)
    else:
        model.load_hf_state_dict(state)
    return model


def train_indexer(policy) -> None:
    """train.indexer_loss > 0: the policy's lightning indexer takes gradients (refused by name without one)."""
    kinds = getattr(policy.config, "layer_types", None) or []
    if not hasattr(policy, "freeze_indexer") or "compressed_sparse_attention" not in kinds:
        raise ValueError(f"train.indexer_loss is set but {policy.config.model_type} has no lightning indexer (a "
                         "deepseek_v4 model with compressed_sparse_attention layers has one): set it to 0")
    policy.freeze_indexer(False)


def prepare(cfg: RunConfig, out: Path, progress: bool = True, world: World = World()) -> Setup:
    """On several processes rank 0 prepares first (it writes the data files and the warm start);
    the others then read its warm start and write their copy of the embedded data aside."""
    if world.size > 1 and not world.first:
        world.barrier()
        with tempfile.TemporaryDirectory() as scratch:
            return _prepare(cfg, out, False, Path(scratch), first=False)
    setup = _prepare(cfg, out, progress, out / "data")
    world.barrier()
    return setup


def _prepare(cfg: RunConfig, out: Path, progress: bool, data_dir: Path, first: bool = True) -> Setup:
    if cfg.rollout.temperature == 0:
        raise ValueError("rollout.temperature = 0 decodes greedily: every sample of a group would be the same and "
                         "every advantage 0; train with a temperature > 0 (train.val_temperature 0 validates greedily)")
    if cfg.logger.wandb:
        require_wandb()  # before the warm start, not after it
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)
    task = embedded_task(cfg.data.task)  # its tokenizer too, with the embedded model
    if cfg.data.train_path:
        train_rows = load_rows(cfg.data.train_path)
        test_rows = load_rows(cfg.data.val_path) if cfg.data.val_path else []
    else:
        train_path, test_path = task.write_dataset(data_dir, cfg.data.seed, cfg.data.n_train, cfg.data.n_test,
                                                   max_operand=cfg.data.max_operand)
        train_rows, test_rows = load_rows(train_path), (load_rows(test_path) if cfg.data.n_test else [])
    if cfg.model.path:
        tokenizer = load_tokenizer(cfg.model.path)
        tok_config = load_tokenizer_config(cfg.model.path)
        model_config = load_config(cfg.model.path)
        state = load_state_dict(cfg.model.path)
    else:
        tokenizer = task.build_tokenizer()
        tok_config = task.tokenizer_config(tokenizer, model_max_length=cfg.rollout.max_model_len)
        model_config = cfg.model.architecture(vocab_size=tokenizer.get_vocab_size(), bos_token_id=task.BOS_ID,
                                              eos_token_id=task.EOS_ID, pad_token_id=task.PAD_ID)
        state = None
    eos = model_config.eos_token_ids or (task.EOS_ID,)
    prompts, toolbox = chat_prompts(cfg, tokenizer, tok_config, eos, train_rows, first)
    reward_fn = get_reward(cfg.train.reward)
    if cfg.train.overlong_buffer:
        reward_fn = overlong_penalty(reward_fn, cfg.rollout.max_tokens, cfg.train.overlong_buffer,
                                     cfg.train.overlong_penalty_factor)
    if train_rows:  # before the warm start: a broken reward fails in a line, not after minutes
        answer = str(train_rows[0]["reward_model"]["ground_truth"])
        check_reward(reward_fn, cfg.train.reward, prompt_text(train_rows[0]), answer,
                     {**reward_kwargs(train_rows[0]),
                      "response_length": len(tokenizer.encode(answer, add_special_tokens=False).ids)})
    train_rows, warm_rows = split_warm_start_rows(train_rows, cfg.warm_start.own_rows)
    state = warm_started(cfg, out, model_config, state, tokenizer, tok_config, warm_rows, eos, progress, first,
                         prompts)
    return Setup(tokenizer, tok_config, model_config, state, train_rows, test_rows, reward_fn, eos, prompts, toolbox)


def chat_prompts(cfg: RunConfig, tokenizer, tok_config: dict, eos: tuple, rows: list, first: bool):
    """(Prompts, Toolbox or None): data.chat_template resolved (said in a line), rollout.tools loaded."""
    template = chat_template(cfg.data.chat_template, cfg.model.path, tok_config)
    toolbox = load_toolbox(cfg.rollout.tools) if cfg.rollout.tools else None
    kwargs = cfg.data.chat_template_kwargs or {}
    if template is None and kwargs:
        raise ValueError(f"data.chat_template_kwargs = {kwargs} but no chat template is in use (data.chat_template = "
                         f"{cfg.data.chat_template!r}): give a template, or drop the kwargs")
    chat = None if template is None else ChatEncoder(template, tokenizer, tools=toolbox.schemas if toolbox else None,
                                                     stop_token_ids=eos, **kwargs)
    prompts = Prompts(tokenizer, chat)
    if first:
        none = " (the embedded model has none)" if chat is None and cfg.model.path is None else ""
        tqdm.write(prompts.describe() + none)
    if cfg.rollout.env == "tools":
        if chat is None:
            raise ValueError("rollout.env = tools needs a chat template (the tools, calls and results are written "
                             "in its format): give model.path with one, or data.chat_template PATH")
        strings = [i for i, row in enumerate(rows) if not isinstance(row["prompt"], list)]
        if strings:
            raise ValueError(f"rollout.env = tools continues conversations, but prompt row {strings[0]} is a string: "
                             "give prompts as lists of {'role', 'content'} messages")
    return prompts, toolbox


def split_warm_start_rows(rows: list, own: int) -> tuple[list, list]:
    """(the RL's rows, the warm start's rows): the last `own` rows the warm start's alone, or all rows shared."""
    if own == 0:
        return rows, rows
    if own >= len(rows):
        raise ValueError(f"warm_start.own_rows = {own} leaves none of the {len(rows)} training rows to the RL: "
                         f"give fewer, or more training rows (data.n_train for an embedded task)")
    return rows[:-own], rows[-own:]


def warm_started(cfg, out, model_config, state, tokenizer, tok_config, rows, eos, progress, first=True,
                 prompts: Prompts | None = None) -> dict:
    """Warm-start weights, reused from out/warm_start when its settings match; says which (rank 0)."""
    ws, say = cfg.warm_start, (tqdm.write if first else lambda line: None)
    whose = "the embedded model" if cfg.model.path is None else f"model.path {cfg.model.path}"
    if ws.steps == 0:
        say("no warm start: model.path given; set --warm_start.steps N to ask for one" if cfg.model.path else
            "no warm start: warm_start.steps is 0")
        if state is None:
            state = build_model(model_config, ExecutionSpec("baseline"), cfg.rollout.max_model_len, None).hf_state_dict()
        return state
    fingerprint = hashlib.sha256(json.dumps([cfg.to_dict()[k] for k in ("model", "data", "warm_start")],
                                            sort_keys=True).encode()).hexdigest()[:16]
    where = out / "warm_start"
    what = "worked solutions" if any(solution_of(row) for row in rows) else "answers"
    if (where / "fingerprint.txt").exists() and (where / "fingerprint.txt").read_text() == fingerprint:
        say(f"warm start: {ws.steps} steps on the dataset's {what} ({whose}), reused from {where}")
        return load_state_dict(where)
    say(f"warm start: {ws.steps} steps on the dataset's {what} ({whose})")
    model = build_model(model_config, ExecutionSpec.default("baseline", cfg.device), cfg.rollout.max_model_len, state)
    prompts = prompts or Prompts(tokenizer)
    end = prompts.chat.end_of_turn_id if prompts.chat is not None else eos[0]   # a chat turn ends with its own token
    examples = []
    for row in rows:
        c = tokenizer.encode(supervised_completion(row), add_special_tokens=False).ids + [end]
        examples.append((prompts.ids(row), c))
    losses = warm_start(model, examples, ws.steps, ws.batch_size, ws.lr, ws.seed, cfg.rollout.block_size, progress)
    save_checkpoint(where, model.hf_state_dict(), model_config, tokenizer, tok_config)
    (where / "fingerprint.txt").write_text(fingerprint)
    say(f"warm start: loss {losses[0]:.3f} -> {sum(losses[-20:]) / len(losses[-20:]):.3f}")
    return model.hf_state_dict()


def solution_of(row: dict) -> str | None:
    """The row's worked solution (extra_info.solution: the embedded word problems', or a user's GSM8K-style), if any."""
    solution = (row.get("extra_info") or {}).get("solution")
    return solution if isinstance(solution, str) and solution.strip() else None


def supervised_completion(row: dict) -> str:
    """What the warm start teaches for a row: its worked solution where it has one, else its ground truth."""
    return solution_of(row) or str(row["reward_model"]["ground_truth"])


def make_env(cfg: RunConfig, setup: Setup):
    """rollout.env's environment for train/episodes.py, or None for single-turn rollouts."""
    if cfg.rollout.env == "calculator":
        return CalculatorEnv(setup.tokenizer, setup.eos_token_ids)
    if cfg.rollout.env == "code":
        return code.CodeEnv(setup.train_rows, setup.tokenizer, setup.eos_token_ids)
    if cfg.rollout.env == "tools":
        return ToolEnv(setup.prompts.chat, setup.toolbox, cfg.rollout.tool_format)
    return None


def embedded_task(name: str):
    """The module of an embedded task (config.EMBEDDED_TASKS): its rows, tokenizer and special token ids."""
    return {"arithmetic": arithmetic, "word_problems": word_problems, "code": code}[name]


class GRPOTrainer:
    """`resume`: continue from the latest intact run_dir/step_N (weights into policy and engine,
    optimizer, LR schedule, RNG, sampler cursor, step); with none there, start at step 1 and say so.

    `world`: this process's rank and the layouts (train/parallel.py); every rank runs this same loop.
    Rollout ranks sample their share of the prompts, every rank then holds every response; trainer
    ranks train on theirs and every rank then holds every log-prob, so the diff and the metrics are
    computed over all valid tokens in the batch's order, exactly as on one process. Rank 0 alone
    writes metrics, checkpoints and the run files."""

    def __init__(self, cfg: RunConfig, mode: str, setup: Setup, run_dir: Path, resume: bool = False,
                 world: World = World()):
        self.cfg, self.setup, self.run_dir, self.world = cfg, setup, run_dir, world
        self.spec = ExecutionSpec.default(mode, cfg.device, quant=cfg.quant)  # the rollout's
        self.trainer_spec = trainer_spec(cfg, self.spec)  # the same but in a baseline run with trainer_quant
        found = checkpoint.latest(run_dir)
        if found is not None and not resume:
            raise ValueError(f"{run_dir} holds checkpoints of an earlier run ({found.name} the latest): pass --resume "
                             "to continue it, or remove them or choose another --out to start afresh")
        self.start, saved, init_state = 0, None, setup.init_state
        # a checkpoint damaged since it was written gives way to the newest intact one, said in a line
        loaded = checkpoint.load_intact(run_dir, lambda line: self.say(f"[{mode}] {line}")) if found else None
        if loaded is not None:
            found, state, tensors, init_state = loaded
            checkpoint.check_compatible(found, state, self.spec, setup.model_config.to_dict(), cfg)
            self.start, saved = state["step"], (state, tensors)
        elif resume:
            self.say(f"[{mode}] --resume: no complete step_N checkpoint in {run_dir}: nothing to resume, "
                     "starting at step 1")
        max_len, r, t = cfg.rollout.max_model_len, cfg.rollout, cfg.train
        # MoE: the engine records its routing, the trainer compares it with its own (moe/routing_agreement)
        self.routing_check = setup.model_config.is_moe and r.env is None and r.agent is None
        self.engine = self.policy = self.actor = None
        if world.size > 1:
            world.groups()  # every rank makes every process group, before any side uses one
        if world.has_engine:
            engine_model = build_model(setup.model_config, self.spec, max_len, init_state)
            settings = engine_settings(cfg)
            if world.rollout == "ep":
                # an EP forward's all-to-alls take their split sizes from the host: no CUDA graphs around them
                engine_model.expert_parallel()
                settings["cuda_graphs"] = False
            if world.rollout == "tp":
                tensor_parallel_engine_model(engine_model, world, settings)
            self.engine = LLMEngine(engine_model, **settings, eos_token_ids=setup.eos_token_ids,
                                    tokenizer=setup.tokenizer, record_routing=self.routing_check)
            self.engine.weight_version = self.start  # the step whose update made the weights (0: the initial ones)
        if world.trains:
            self.policy = build_model(setup.model_config, self.trainer_spec, max_len, init_state)
            if t.indexer_loss:
                train_indexer(self.policy)
            self.actor = actor_for(
                world, self.policy, r.block_size, t.lr, t.betas, t.weight_decay, t.max_grad_norm, t.lr_warmup_steps,
                recompute=t.recompute, master_dtype=DTYPES[t.master_dtype] if t.master_dtype else None)
        if self.engine is not None and self.policy is not None and self.trainer_spec is self.spec:
            check_same_spec(self.engine.model.ops.spec, self.policy.ops.spec)
        # every rank walks the same weight names in the sync (a rank with neither side walks none)
        holder = self.policy if self.policy is not None else self.engine.model if self.engine is not None else None
        self.names = [name for name, _ in holder.named_parameters()] if holder is not None else []
        self.sampler = PromptSampler(setup.train_rows, seed=t.seed)
        self.env = make_env(cfg, setup)
        # on CUDA a phase ends when its kernels do, not when they are queued
        self.timer = Timer(sync=torch.cuda.synchronize if cfg.device == "cuda" else None)
        if saved is not None:
            self.restore(*saved)
            self.say(f"[{mode}] resumed from {found} (step {self.start} of {t.steps})")
        # rollout.agent http: an external agent runs the episodes over the OpenAI API (train/agent.py); last, so
        # that nothing after it fails with the server up
        self.agent = AgentRollout(cfg, self.engine, setup.prompts, self.say) if r.agent is not None else None

    def say(self, line: str) -> None:
        if self.world.first:
            tqdm.write(line)

    def state(self, step: int) -> tuple[dict, dict]:
        """Everything besides the weights that the next step depends on: (JSON part, tensor part), in
        a form no layout owns (full tensors per parameter name), so any layout may resume it. The
        engine needs none: sampling seeds and request ids are functions of the step."""
        state = {"step": step, "spec_hash": self.spec.hash(), "spec": self.spec.to_dict(),
                 "config_hash": checkpoint.config_hash(self.cfg), "config": self.cfg.to_dict(),
                 "model_config": self.setup.model_config.to_dict(), "sampler": self.sampler.state_dict()}
        tensors = {"optimizer": self.actor.optimizer_state(), "rng": checkpoint.rng_state(self.cfg.device)}
        master = self.actor.master_state()
        if master is not None:  # the weights the HF checkpoint holds are these, rounded
            tensors["master"] = master
        return state, tensors

    def restore(self, state: dict, tensors: dict):
        self.sampler.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(tensors["rng"])
        if self.actor is None:
            return
        if self.actor.has_master:
            if "master" not in tensors:
                raise ValueError("the checkpoint holds no master weights but train.master_dtype is set: resume "
                                 "with the run's own train.master_dtype")
            self.actor.load_master_state(tensors["master"])
        self.actor.load_optimizer_state(tensors["optimizer"])

    def save(self, step: int) -> Path | None:
        """Every trainer rank gives its part (fsdp and ep gather), rank 0 writes step_N."""
        if self.actor is None:
            return None
        weights, (state, tensors) = self.actor.full_weights(), self.state(step)
        if not self.world.first:
            return None
        return checkpoint.save(self.run_dir, step, weights, self.setup, state, tensors,
                               keep_last=self.cfg.train.keep_last)

    def params(self, step: int) -> SamplingParams:
        # a multi-turn policy ends a turn with its env's stop tokens (the calculator's "="); a chat turn ends
        # with the template's end-of-turn token, whatever the checkpoint's EOS
        chat = self.setup.prompts.chat
        stop = self.env.stop_token_ids if self.env is not None else ()
        if chat is not None and chat.end_of_turn_id not in self.setup.eos_token_ids:
            stop = (*stop, chat.end_of_turn_id)
        return sampling_params(self.cfg, self.cfg.rollout.seed * 1_000_003 + step,
                               stop_token_ids=tuple(t for t in stop if t is not None))

    def prompts(self, rows, n: int) -> list[list[int]]:
        return [self.setup.prompts.ids(row) for row in rows for _ in range(n)]

    def generate(self, rows, params: SamplingParams, ids: list[int], n: int, what: str):
        """Every output, in order, on every rank; each rollout rank samples its share of the prompts."""
        prompts = self.prompts(rows, n)
        mine = self.world.rollout_share(len(prompts), n)
        local = []
        if self.engine is not None:
            generate = generate_in_lockstep if self.world.rollout == "ep" else LLMEngine.generate
            local = generate(self.engine, [prompts[i] for i in mine], params, [ids[i] for i in mine])
        if self.world.size == 1:
            outputs = local
        else:
            led = list(zip(mine, local)) if self.world.leads_rollout else []  # a TP group's rows once
            rows_out = sorted((row for part in self.world.gather(led) for row in part),
                              key=lambda row: row[0])
            outputs = [o for _, o in rows_out]
        failed = [o for o in outputs if o.error]
        if failed:
            raise RuntimeError(f"{len(failed)} {what} requests failed, first: {failed[0].error}")
        return outputs

    def generated_tokens(self) -> int:
        """Tokens the engines have generated so far, over every rank."""
        own = self.engine.stats.generated_tokens if self.world.leads_rollout else 0
        return sum(self.world.gather(own))

    def rollout(self, rows, step, first_id: int = 0) -> tuple[Responses, list[str], dict, list | None]:
        """Responses, the completion texts the reward reads, rollout metrics, and the rewards an external agent
        gave (None where it gave none, or no agent). Request ids run from step * 1_000_000 + first_id (a step's
        later rollouts, dynamic sampling's, start past the earlier ones)."""
        n, params = self.cfg.rollout.n, self.params(step)
        if first_id + len(rows) * n > 1_000_000:
            raise ValueError(f"step {step} would sample {first_id + len(rows) * n} responses, more than the "
                             "1000000 request ids a step has: lower train.prompts_per_step * rollout.n or "
                             "train.max_gen_batches")
        ids = [step * 1_000_000 + first_id + i for i in range(len(rows) * n)]
        start_tokens = self.generated_tokens()
        with self.timer("gen"):
            if self.agent is not None:
                start_cached = self.engine.block_manager.num_cached_tokens_hit
                episodes = self.agent.run(step, rows, ids, params)
                cached = self.engine.block_manager.num_cached_tokens_hit - start_cached
            elif self.env is None:
                outputs = self.generate(rows, params, ids, n, "rollout")
            else:
                start_cached = self.engine.stats.cached_tokens
                conversations = [self.setup.prompts.messages(row) for row in rows for _ in range(n)]
                episodes = run_episodes(self.engine, self.prompts(rows, n), self.env, params,
                                        self.cfg.rollout.max_turns, episode_ids=ids, conversations=conversations)
                cached = self.engine.stats.cached_tokens - start_cached
        given = None
        if self.env is None and self.agent is None:
            responses = Responses.build([o.prompt_token_ids for o in outputs], [o.token_ids for o in outputs],
                                        [params] * len(outputs), [o.logprobs for o in outputs])
            if self.routing_check:
                responses.routing = [o.routing for o in outputs]
            texts, metrics = self.decode(outputs), {}
        else:
            responses = episode_responses(episodes, params)
            texts = [e.reward_info.get("answer", "") for e in episodes]
            metrics = {**episode_metrics(episodes), "perf/prefix_cache_hit_tokens": cached}
            given = [e.reward_info.get("reward") for e in episodes] if self.agent is not None else None
        metrics["generated_tokens"] = self.generated_tokens() - start_tokens
        return responses, texts, metrics, given

    def decode(self, outputs) -> list[str]:
        return [self.setup.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outputs]

    def score(self, rows, texts: list[str], lengths: list[int], n: int, data: str = "train",
              given: list | None = None) -> torch.Tensor:
        """Rewards of completions texts[i] of rows[i // n]; lengths[i] is its response length in tokens;
        given[i], where not None, is the reward an external agent gave (the reward function is not asked)."""
        asked = [i for i in range(len(texts)) if given is None or given[i] is None]
        rewards = list(given) if given is not None else [None] * len(texts)
        scored = score_batch(self.setup.reward_fn, [
            (prompt_text(rows[i // n]), texts[i], {**reward_kwargs(rows[i // n]), "response_length": lengths[i]})
            for i in asked]) if asked else []
        for i, value in zip(asked, scored):
            rewards[i] = value
        for i, value in enumerate(rewards):
            problem = reward_problem(value)
            if problem is not None:
                source = self.setup.train_rows if data == "train" else self.setup.test_rows
                row = next((j for j, r in enumerate(source) if r is rows[i // n]), "?")
                where = "prompt row" if data == "train" else "held-out row"
                raise NonFiniteError(f"reward of sample {i} ({where} {row}) is {problem}; the reward function "
                                     f"({self.cfg.train.reward}) must return a finite float")
        return torch.tensor([float(value) for value in rewards], dtype=torch.float32)

    def verifies(self, step: int) -> bool:
        """Whether this step recomputes the old log-probs and reports their diff to the rollout's."""
        t = self.cfg.train
        return t.old_logprob == "verify" or (t.old_logprob == "every_n" and (step - 1) % t.old_logprob_every == 0)

    def step(self, step: int) -> dict:
        with self.timer("step"):
            if self.cfg.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with at_step(step):
                metrics = self.train_step(step)
        metrics.update(self.timer.metrics())
        metrics["perf/rollout_tokens_per_s"] = metrics.pop("generated_tokens") / max(metrics["timing_s/gen"], 1e-9)
        metrics.update(memory_metrics(self.cfg.device))
        return metrics

    def sample_batch(self, step: int) -> tuple[Responses, torch.Tensor, dict]:
        """The step's responses, their rewards and the rollout's metrics. With train.filter_groups (DAPO's
        dynamic sampling) groups whose rewards are all equal (no advantage, no gradient) are dropped and
        more prompts rolled out, up to train.max_gen_batches rollouts, until prompts_per_step groups are
        kept; short of that the step trains on the groups it kept (on the last rollout's, if none)."""
        t, n = self.cfg.train, self.cfg.rollout.n
        parts, kept_groups, rounds, generated = [], 0, [], 0
        while True:
            rows = self.sampler.next_batch(t.prompts_per_step)
            responses, texts, metrics, given = self.rollout(rows, step, first_id=len(rounds) * len(rows) * n)
            lengths = responses.mask.sum(1)  # policy tokens only: env tokens are outside the mask
            with self.timer("reward"):
                rewards = self.score(rows, texts, lengths.tolist(), n, given=given)
            grouped = rewards.view(-1, n)
            spread = (grouped != grouped[:, :1]).any(1)
            # groups whose rewards are all equal: GRPO gives them no advantage, so no gradient
            metrics["critic/uniform_groups_frac"] = 1.0 - float(spread.float().mean())
            rounds.append(metrics)
            if not t.filter_groups:
                return responses, rewards, metrics
            keep = spread.nonzero().flatten().tolist()
            keep = keep[:t.prompts_per_step - kept_groups]
            generated += len(rows)
            if keep:
                rows_kept = [g * n + j for g in keep for j in range(n)]
                parts.append((responses.select(rows_kept), rewards[rows_kept]))
                kept_groups += len(keep)
            if kept_groups == t.prompts_per_step or len(rounds) == t.max_gen_batches:
                break
        if not parts:  # nothing to learn from in any rollout: train on the last one, as without filtering
            parts = [(responses, rewards)]
        metrics = {key: sum(m[key] for m in rounds) / (1 if key in SUMMED else len(rounds)) for key in rounds[0]}
        responses, rewards = Responses.join([r for r, _ in parts]), torch.cat([w for _, w in parts])
        metrics.update({"train/num_gen_batches": len(rounds), "train/num_groups": len(rewards) // n,
                        "train/kept_groups_frac": kept_groups / generated})
        return responses, rewards, metrics

    def train_step(self, step: int) -> dict:
        """Rollout, reward, forward and backward, update, weight sync; timings are the caller's."""
        t = self.cfg.train
        responses, rewards, rollout_metrics = self.sample_batch(step)
        lengths = responses.mask.sum(1)  # policy tokens only: env tokens are outside the mask
        first_nan(responses.rollout_logprobs, "the engine's log-prob",
                  "the engine's weights or logits hold a NaN: check the checkpoint (model.path)")
        advantages = group_advantages(rewards, self.cfg.rollout.n, t.norm_adv_by_std)
        verify = self.verifies(step)
        valid_tokens = float(responses.mask.sum())
        share = self.world.trainer_share(len(responses.prompt_ids), self.cfg.rollout.n)
        local = self.train_forward_backward(responses.select(share), advantages[share], valid_tokens, verify)
        logprobs, entropy, pg, routing = self.gathered(share, local, responses)
        device = self.policy.device if self.policy is not None else torch.device("cpu")
        mask, rollout_logprobs = responses.mask.to(device), responses.rollout_logprobs.to(device)
        logprobs, entropy = logprobs.to(device), entropy.to(device)
        # before actor.step, on every rank alike: a NaN must not reach the weights
        first_nan(logprobs, "the trainer's log-prob", "the policy's weights or logits hold a NaN; the weights were "
                  "left unchanged: check the weights it started from (model.path or the last step_N)")
        if "actor/pg_loss" in pg and not math.isfinite(pg["actor/pg_loss"]):
            raise NonFiniteError(f"the policy loss is {pg['actor/pg_loss']}{loss_cause(logprobs, mask)}")
        routing = {} if routing is None else routing_agreement(responses.routing, routing)
        with self.timer("old_logprob" if verify else "update"):
            old = logprobs if verify else rollout_logprobs
            metrics = rollout_diff(rollout_logprobs, old, mask) if verify else {}
        with self.timer("update"):
            _, keep, corrections = rollout_correction(old, rollout_logprobs, mask, t.rollout_is,
                                                      t.rollout_is_threshold, t.rollout_rs, t.rollout_rs_threshold)
            # the losses were token-means over every valid token; MIS leaves fewer in the mean
            scale = valid_tokens / max(float(keep.sum()), 1.0)
            grad_norm = self.actor.step(grad_scale=scale) if self.actor is not None else 0.0
            pg = {key: value * scale for key, value in pg.items()}
        with self.timer("sync"), self.engine_held():
            sync_weights(self.engine, self.actor, self.world, self.names)
        metrics.update(corrections)
        metrics.update(routing)
        metrics.update(pg)
        metrics.update(rollout_metrics)
        metrics.update({
            "critic/score/mean": rewards.mean().item(),
            "critic/advantages/mean": advantages.mean().item(),
            "response_length/mean": lengths.float().mean().item(),
            "actor/entropy": (entropy.detach()[mask].mean().item() if responses.mask.any() else 0.0),
            "actor/grad_norm": grad_norm,
        })
        return metrics

    def train_forward_backward(self, mine: Responses, advantages: torch.Tensor, valid_tokens: float,
                               verify: bool) -> tuple:
        """This rank's rows: forward and backward (gradients left for actor.step); (log-probs, entropies,
        loss stats, routing) or None on a rank that does not train."""
        if self.actor is None:
            return None
        t, device = self.cfg.train, self.policy.device
        mask, rollout_logprobs = mine.mask.to(device), mine.rollout_logprobs.to(device)
        advantages_on = advantages.to(device)

        def loss_fn(rows, logprobs):
            # a verified step's old log-probs are this forward's own values (detached): no second forward
            old = logprobs.detach() if verify else rollout_logprobs[rows]
            weights, keep, _ = rollout_correction(old, rollout_logprobs[rows], mask[rows], t.rollout_is,
                                                  t.rollout_is_threshold, t.rollout_rs, t.rollout_rs_threshold)
            loss, stats = policy_loss(logprobs, old, advantages_on[rows], keep, t.clip_ratio, weights,
                                      count=valid_tokens)
            if t.indexer_loss:  # this forward's indexer loss, a mean over its queries: its share of the step's
                aux = self.policy.indexer_loss() * (float(mask[rows].sum()) / valid_tokens)
                loss = loss + t.indexer_loss * aux
                stats = {**stats, "actor/indexer_loss": float(aux.detach())}
            return loss, stats

        episodes = self.env is not None or self.agent is not None
        forward = partial(masked_logprobs, self.actor) if episodes else self.actor.logprobs
        self.actor.routing = [] if mine.routing is not None else None
        logprobs, entropy, pg = self.actor.backward(mine, loss_fn, t.micro_batch_tokens, forward, self.timer,
                                                    "old_logprob" if verify else "update")
        routing, self.actor.routing = self.actor.routing, None
        return logprobs, entropy, pg, routing

    def gathered(self, share: list[int], local, responses: Responses):
        """Every trainer rank's rows put back in the batch's order: log-probs and entropies [B, T], the
        loss stats summed over the ranks, the trainer's routing per sequence (or None)."""
        if self.world.size == 1:
            return local
        if local is not None:  # host copies: what crosses ranks as objects is device-free
            lp, entropy, pg, routing = local
            local = (lp.cpu(), entropy.cpu(), pg, None if routing is None else [x.cpu() for x in routing])
        logprobs = torch.zeros(responses.mask.shape)
        entropies = torch.zeros(responses.mask.shape)
        routing, pg = ([None] * len(responses.prompt_ids) if responses.routing is not None else None), {}
        for rows, part in self.world.gather((share, local)):
            if part is None:
                continue
            logprobs[rows], entropies[rows] = part[0], part[1]
            for key, value in part[2].items():
                pg[key] = pg.get(key, 0.0) + value
            if routing is not None:
                for i, x in zip(rows, part[3]):
                    routing[i] = x
        return logprobs, entropies, pg, routing

    def validate(self, step: int) -> dict:
        """val/score: the mean reward of one sample per held-out row, under the weights this step trained (step 0:
        the weights the run starts from)."""
        r, t, rows = self.cfg.rollout, self.cfg.train, self.setup.test_rows
        start = time.perf_counter()
        temperature = r.temperature if t.val_temperature is None else t.val_temperature
        params = sampling_params(self.cfg, self.params(step).seed, temperature=temperature)
        with self.engine_held():
            outputs = self.generate(rows, params, [-1 - i for i in range(len(rows))], 1, "evaluation")
            # the next rollout must find the prefix cache as the weight sync left it: empty
            if self.engine is not None:
                self.engine.block_manager.reset_prefix_cache()
        with at_step(step):
            rewards = self.score(rows, self.decode(outputs), [len(o.token_ids) for o in outputs], 1, "val")
        length = sum(len(o.token_ids) for o in outputs) / len(outputs)
        return {"val/score": rewards.mean().item(), "val/response_length/mean": length,
                "timing_s/val": time.perf_counter() - start}

    def engine_held(self):
        """The engine to this thread alone: with an agent, once its requests in flight finish (train/agent.py)."""
        return self.agent.held() if self.agent is not None else nullcontext()

    def validates(self, step: int) -> bool:
        every = self.cfg.train.val_every
        return bool(every and self.setup.test_rows) and (step % every == 0 or step == self.cfg.train.steps)

    def wandb_settings(self) -> dict | None:
        """wandb.init arguments, or None when logger.wandb is off. A resumed run continues its W&B run
        (the id lives in run_dir/wandb_id.txt); W&B drops the steps it already has, with a warning."""
        lg = self.cfg.logger
        if not lg.wandb:
            return None
        id_file = self.run_dir / "wandb_id.txt"
        if not (self.start and id_file.is_file()):
            id_file.write_text(uuid.uuid4().hex[:16])
        group = lg.name or Path(self.cfg.out).resolve().name
        return {"project": lg.project, "name": f"{group}-{self.spec.mode}", "group": group,
                "id": id_file.read_text(), "resume": "allow", "dir": str(self.run_dir),
                "config": {**self.cfg.to_dict(), "spec_hash": self.spec.hash()}}

    @contextmanager
    def closing(self):
        """The agent's server stops when the run ends, however it ends."""
        try:
            yield
        finally:
            if self.agent is not None:
                self.agent.close()

    def run(self, progress: bool = True) -> list[dict]:
        """The steps from the one after the checkpoint to train.steps; each step's metrics (on rank 0
        the run's, on the others the same but for the timings)."""
        first = self.world.first
        progress = progress and first
        history = []
        if first:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_yaml(self.cfg, self.run_dir / "config.yaml")
            specs = {"hash": self.spec.hash(), "spec": self.spec.to_dict()}
            if self.trainer_spec is not self.spec:
                specs.update(trainer_hash=self.trainer_spec.hash(), trainer_spec=self.trainer_spec.to_dict())
            (self.run_dir / "spec.json").write_text(json.dumps(specs, indent=2))
            sides = ("(engine and trainer)" if self.trainer_spec is self.spec else
                     f"(engine; the trainer's {self.trainer_spec.hash()}, trainer_quant {self.cfg.trainer_quant})")
            tqdm.write(f"[{self.spec.mode}] ExecutionSpec {self.spec.hash()} {sides}")
            checkpoint.remove_leftovers(self.run_dir)
            # a fresh run keeps no row, not even a step-0 validation its killed first try logged
            kept = checkpoint.rewind_metrics(self.run_dir, self.start or -1)
            history = [{k: v for k, v in r.items() if k != "step"} for r in kept if r.get("step") != 0]
        t = self.cfg.train
        logger = MetricsLogger(self.run_dir, console=progress, purge_step=self.start + 1 if self.start else None,
                               wandb=self.wandb_settings(), console_every=t.log_every) if first else nullcontext()
        with logger, self.closing():
            if t.val_before_train and self.start == 0 and self.setup.test_rows:
                metrics = self.validate(0)  # the weights the run starts from; in metrics.jsonl, not in history
                if first:
                    logger.log(0, metrics)
            for step in tqdm(range(self.start + 1, t.steps + 1), desc=self.spec.mode, disable=not progress, leave=False,
                             initial=self.start, total=t.steps):
                metrics = self.step(step)
                if self.validates(step):
                    metrics.update(self.validate(step))
                if first:
                    logger.log(step, metrics)
                history.append(metrics)
                if step == t.steps or (t.save_every and step % t.save_every == 0):
                    self.save(step)
        return history


# rollout metrics that add up over a step's rollouts (the others are averaged: each rollout has as many samples)
SUMMED = ("generated_tokens", "perf/prefix_cache_hit_tokens")


@contextmanager
def at_step(step: int):
    """A NonFiniteError raised inside names the step."""
    try:
        yield
    except NonFiniteError as e:
        raise NonFiniteError(f"step {step}: {e}") from None


def first_nan(values: torch.Tensor, what: str, cause: str) -> None:
    """NonFiniteError naming the first NaN of values [B, T]: one device sync, more only to name it."""
    if torch.isnan(values).any():
        sample, token = (int(i) for i in torch.isnan(values).nonzero()[0])
        raise NonFiniteError(f"{what} of sample {sample} (token {token}) is nan: {cause}")


def loss_cause(logprobs: torch.Tensor, mask: torch.Tensor) -> str:
    """Why a loss is not finite when no reward or log-prob is NaN: a -inf log-prob (a sampled token
    the trainer's top-k / top-p mask drops, possible in baseline mode) makes a ratio exp(-inf + inf)."""
    dropped = (torch.isinf(logprobs) & mask).nonzero()
    if len(dropped):
        sample, token = (int(i) for i in dropped[0])
        return (f": the trainer's log-prob of sample {sample} (token {token}) is -inf, its top-k / top-p mask "
                "drops a token the engine sampled; sample with rollout.top_k 0 and rollout.top_p 1, or in the "
                "consistent mode")
    return ": the rewards and log-probs are finite; lower train.lr"


def memory_metrics(device: str) -> dict[str, float]:
    """perf/peak_memory_gib: CUDA memory allocated at the step's peak (the step resets the counter);
    on the CPU perf/max_rss_gib: the process's peak resident set so far (Linux reports KiB), never reset."""
    if device == "cuda":
        return {"perf/peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
    return {"perf/max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
