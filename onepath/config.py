"""RunConfig: one run's settings, in sections, from YAML plus `--section.key value` overrides."""
from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import yaml

from onepath.engine.llm_engine import CPU_NUM_BLOCKS, GPU_MEMORY_UTILIZATION
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, NemotronHConfig, pattern_layers
from onepath.models.kv_cache import BLOCK_SIZE
from onepath.numerics.spec import ExecutionSpec

MODES = ("consistent", "baseline", "both")
EMBEDDED_TASKS = ("arithmetic", "word_problems", "code")  # onepath/tasks/<name>.py
OLD_LOGPROB = ("verify", "every_n", "skip")
CORRECTION_LEVELS = ("token", "sequence")
ENVIRONMENTS = ("calculator", "code", "tools")
AGENTS = ("http",)  # rollout.agent: an external agent drives the episodes over the HTTP API (onepath/serve)
TOOL_FORMATS = ("auto", "hermes", "llama3", "deepseek")  # onepath/chat/tool_calls.py
ROLLOUT_LAYOUTS = ("single", "dp", "ep", "tp")
LAUNCHERS = ("torchrun", "ray")
TRAINER_LAYOUTS = ("single", "fsdp", "ep")
SAMPLING = {f.name: f.default for f in fields(SamplingParams)}  # the engine's defaults, defined there once
# the embedded model's architectures (a checkpoint's config.json may also name qwen2_moe)
EMBEDDED_MODEL_TYPES = SUPPORTED_MODEL_TYPES + ("qwen3_moe", "nemotron_h")


class _Section:
    __slots__ = ()
    NAME: ClassVar[str]

    def _coerce(self):
        for f in fields(self):
            value = getattr(self, f.name)
            setattr(self, f.name, _convert(f"{self.NAME}.{f.name}", value, _hints(type(self))[f.name]))

    def _require(self, key: str, ok: bool, rule: str, why: str = ""):
        if not ok:
            where = f"{self.NAME}.{key}" if self.NAME else key
            raise ValueError(f"{where} = {_show(getattr(self, key))} {rule}" + (f": {why}" if why else ""))

    def _positive(self, *keys: str):
        for key in keys:
            self._require(key, getattr(self, key) >= 1, "must be >= 1")

    def _finite_positive(self, *keys: str):
        for key in keys:
            value = getattr(self, key)
            self._require(key, math.isfinite(value) and value > 0, "must be a finite number > 0")


@dataclass(slots=True)
class ModelSection(_Section):
    NAME: ClassVar[str] = "model"
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None   # null = hidden_size / num_attention_heads (Qwen3-0.6B: 128 with hidden 1024)
    model_type: str = "qwen3"
    max_position_embeddings: int = 64
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    # mixture of experts (model_type qwen3_moe): experts per sparse layer, chosen per token, their width
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # the hybrid (model_type nemotron_h): a letter per layer, the layer count its length (M Mamba-2, * attention,
    # - relu2 MLP, E MoE with the experts above); Mamba-2 heads as attention's, B and C per key-value group
    hybrid_override_pattern: str = "M*EM-"
    ssm_state_size: int = 16
    path: str | None = None  # a Hugging Face checkpoint dir; its config.json then decides the architecture

    def __post_init__(self):
        self._coerce()
        self._positive("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "max_position_embeddings")
        self._finite_positive("rope_theta")
        self._require("model_type", self.model_type in EMBEDDED_MODEL_TYPES, "is not supported",
                      f"use one of {', '.join(EMBEDDED_MODEL_TYPES)}")
        self._require("num_key_value_heads", self.num_attention_heads % self.num_key_value_heads == 0,
                      f"does not divide model.num_attention_heads = {self.num_attention_heads}",
                      "grouped-query attention needs whole groups")
        if self.head_dim is None:
            self._require("hidden_size", self.hidden_size % self.num_attention_heads == 0,
                          f"is not a multiple of model.num_attention_heads = {self.num_attention_heads}",
                          "each head gets hidden_size / num_attention_heads dimensions; or set model.head_dim")
        else:
            self._require("head_dim", self.head_dim >= 2 and self.head_dim % 2 == 0, "must be an even number >= 2",
                          "rotary embedding rotates pairs of dimensions")
        if self.model_type == "nemotron_h":
            self._require("hybrid_override_pattern", bool(self.hybrid_override_pattern) and
                          set(self.hybrid_override_pattern) <= set("M*-E"), "is not a layer pattern",
                          "one letter per layer: M (Mamba-2), * (attention), - (MLP), E (MoE)")
            self._positive("ssm_state_size")
        if self.model_type == "qwen3_moe" or (self.model_type == "nemotron_h" and "E" in self.hybrid_override_pattern):
            moe = f"must be >= 1 for model.model_type = {self.model_type}"
            self._require("num_experts", self.num_experts >= 1, moe, "set the experts of each sparse layer")
            self._require("moe_intermediate_size", self.moe_intermediate_size >= 1, moe, "set each expert's MLP width")
            self._require("num_experts_per_tok", 1 <= self.num_experts_per_tok <= self.num_experts,
                          f"must be in [1, model.num_experts = {self.num_experts}]", "each token picks distinct experts")
        self._require("path", self.path is None or self.path != "", "is empty",
                      "give a checkpoint directory, or null for the embedded tiny model")

    def hybrid_config(self, vocab_size: int, bos: int, eos: int, pad: int) -> NemotronHConfig:
        """The embedded hybrid (model_type nemotron_h) of this section, for a tokenizer's vocabulary and ids."""
        head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        return NemotronHConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            layers_block_type=pattern_layers(self.hybrid_override_pattern),
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=head_dim, mamba_num_heads=self.num_attention_heads, mamba_head_dim=head_dim,
            n_groups=self.num_key_value_heads, ssm_state_size=self.ssm_state_size,
            chunk_size=16, n_routed_experts=max(self.num_experts, 1), num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=max(self.moe_intermediate_size, 1), norm_topk_prob=self.norm_topk_prob,
            moe_shared_expert_intermediate_size=self.intermediate_size, tie_word_embeddings=False,
            max_position_embeddings=self.max_position_embeddings, bos_token_id=bos, eos_token_id=eos,
            pad_token_id=pad)

    def architecture(self, vocab_size: int = 1, **token_ids) -> ModelConfig:
        """The embedded model's ModelConfig from these keys (the vocabulary and special ids are the task's)."""
        if self.model_type == "nemotron_h":
            return self.hybrid_config(vocab_size, *(token_ids.get(f"{k}_token_id") for k in ("bos", "eos", "pad")))
        return ModelConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, model_type=self.model_type,
            max_position_embeddings=self.max_position_embeddings, rope_theta=self.rope_theta,
            tie_word_embeddings=self.tie_word_embeddings, num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
            norm_topk_prob=self.norm_topk_prob, **token_ids)

@dataclass(slots=True)
class DataSection(_Section):
    NAME: ClassVar[str] = "data"
    # the embedded task, when train_path is null: arithmetic | word_problems (both read n_train, n_test,
    # max_operand, seed) | code (n_train + n_test of its 124 problems, seed). With the embedded model its
    # tokenizer is the task's, for a data file too.
    # max_operand: arithmetic's operands are in [0, N]; the amounts a word problem states in [1, N] (N >= 2)
    task: str = "arithmetic"
    train_path: str | None = None
    val_path: str | None = None
    n_train: int = 3000
    n_test: int = 200
    max_operand: int = 49
    seed: int = 0
    # auto: the checkpoint's template (tokenizer_config.json or chat_template.jinja; the embedded model has
    # none) | none: a chat list's contents joined as they are | PATH: a .jinja file or a tokenizer_config.json
    chat_template: str = "auto"
    chat_template_kwargs: dict | None = None  # extra template variables, e.g. {enable_thinking: false}

    def __post_init__(self):
        self._coerce()
        self._require("chat_template", self.chat_template != "", "is empty",
                      "give auto, none, or a template file (.jinja, or a tokenizer_config.json)")
        self._require("chat_template_kwargs", self.chat_template_kwargs is None or all(
            isinstance(k, str) and k.isidentifier() for k in self.chat_template_kwargs),
            "must map names to values", "e.g. {enable_thinking: false}: each key is a template variable")
        self._require("task", self.task in EMBEDDED_TASKS, "is not an embedded task",
                      f"use one of {', '.join(EMBEDDED_TASKS)}")
        if self.train_path is None:
            self._require("val_path", self.val_path is None, "is set but data.train_path is not",
                          "the embedded task makes its own test split; set data.train_path too, or drop val_path")
        self._require("train_path", self.train_path != "", "is empty", "give a data file, or null")
        self._require("val_path", self.val_path != "", "is empty", "give a data file, or null")
        self._positive("n_train", "max_operand")
        self._require("n_test", self.n_test >= 0, "must be >= 0", "0 skips evaluation")


@dataclass(slots=True)
class WarmStartSection(_Section):
    NAME: ClassVar[str] = "warm_start"
    EMBEDDED_STEPS: ClassVar[int] = 450
    # supervised steps on the dataset's answers before RL. null = auto, which RunConfig resolves:
    # EMBEDDED_STEPS for the embedded model, 0 with model.path (a checkpoint is not fine-tuned
    # unless asked); an explicit N is obeyed, 0 disables
    steps: int | None = None
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    # 0: the warm start samples the training rows the RL draws from. N: the last N training rows are the
    # warm start's alone and the RL never draws them (a supervised set apart from the RL prompts, as
    # separate SFT and RL data sets are; the split holds with steps 0 too, for runs from a saved warm start)
    own_rows: int = 0

    def __post_init__(self):
        self._coerce()
        self._require("steps", self.steps is None or self.steps >= 0, "must be >= 0",
                      "0 disables the warm start, null = on for the embedded model only")
        self._require("own_rows", self.own_rows >= 0, "must be >= 0",
                      "0 shares the training rows, N keeps the last N rows for the warm start")
        self._positive("batch_size")
        self._finite_positive("lr")


@dataclass(slots=True)
class RolloutSection(_Section):
    NAME: ClassVar[str] = "rollout"
    n: int = 8
    temperature: float = SAMPLING["temperature"]  # 0 = greedy (onepath generate; training samples at > 0)
    top_k: int = SAMPLING["top_k"]   # 0 = off
    top_p: float = SAMPLING["top_p"]  # 1.0 = off
    max_tokens: int = 8
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    block_size: int = BLOCK_SIZE
    num_blocks: int | None = CPU_NUM_BLOCKS  # null: sized from gpu_memory_utilization on CUDA (1024 on CPU)
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION  # share of the GPU's memory the engine may fill when num_blocks is null
    cuda_graphs: bool | None = None      # decode steps replay CUDA graphs; null = on when device is cuda
    max_model_len: int = 64
    prefill_chunk_size: int | None = None
    seed: int = 0
    env: str | None = None        # null: single-turn | calculator | code | tools: multi-turn episodes
    max_turns: int = 3            # policy turns per episode when env is set
    # env tools: the tools (calculator, or path/to/file.py:NAME, a function or a list of them) and the format the
    # model writes calls in (auto: the one the chat template teaches)
    tools: str | None = None
    tool_format: str = "auto"
    # agent http: an external agent runs the episodes against the engine over the OpenAI API, served at
    # agent_host:agent_port (0: a free port, printed) while the trainer waits up to agent_timeout_s a step
    agent: str | None = None
    agent_host: str = "127.0.0.1"
    agent_port: int = 8000
    agent_timeout_s: float = 600.0

    def __post_init__(self):
        self._coerce()
        self._require("agent", self.agent is None or self.agent in AGENTS, "is not an agent mode",
                      "use http (an external agent over the OpenAI API), or null for the trainer's own rollout")
        self._require("env", self.env is None or self.agent is None, f"is set with rollout.agent = {self.agent}",
                      "the agent is the environment: drop rollout.env")
        self._require("agent_port", 0 <= self.agent_port <= 65535, "must be a port in [0, 65535]", "0 picks a free one")
        self._finite_positive("agent_timeout_s")
        self._require("env", self.env is None or self.env in ENVIRONMENTS, "is not an environment",
                      f"use one of {', '.join(ENVIRONMENTS)}, or null for single-turn rollouts")
        self._require("max_turns", self.max_turns >= 1, "must be >= 1", "1 is one policy turn per episode")
        self._require("tools", (self.tools is not None) == (self.env == "tools"),
                      "is set without rollout.env = tools" if self.tools is not None else
                      "is null but rollout.env = tools", "name the toolbox (calculator, or path/to/file.py:NAME) "
                      "with rollout.env tools, and only then")
        self._require("tool_format", self.tool_format in TOOL_FORMATS, "is not a tool-call format",
                      f"use one of {', '.join(TOOL_FORMATS)}")
        self._require("n", self.n >= 1, "must be >= 1", "the group size is the number of samples per prompt")
        self._require("temperature", math.isfinite(self.temperature) and self.temperature >= 0,
                      "must be a finite number >= 0", "0 decodes greedily")
        self._require("top_k", self.top_k >= 0, "must be >= 0", "0 turns top-k off")
        self._require("top_p", 0 < self.top_p <= 1, "must be in (0, 1]", "1.0 turns top-p off")
        self._positive("max_tokens", "max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len")
        self._require("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "must be in (0, 1]",
                      "the share of the GPU's memory the engine may fill, e.g. 0.9")
        self._require("max_tokens", self.max_tokens < self.max_model_len,
                      f"must be < rollout.max_model_len = {self.max_model_len}",
                      "a sequence holds its prompt (at least one token) and its response")
        self._require("num_blocks", self.num_blocks is None or self.num_blocks * self.block_size >= self.max_model_len,
                      f"* rollout.block_size = {self.block_size} is below rollout.max_model_len = "
                      f"{self.max_model_len}", "the KV cache must hold one whole sequence; raise num_blocks")
        if self.prefill_chunk_size is None:
            self._require("max_num_batched_tokens", self.max_num_batched_tokens >= self.max_model_len,
                          f"must be >= rollout.max_model_len = {self.max_model_len}",
                          "without chunked prefill a whole prompt runs in one step; "
                          "raise it or set rollout.prefill_chunk_size")
        else:
            self._positive("prefill_chunk_size")


@dataclass(slots=True)
class TrainSection(_Section):
    NAME: ClassVar[str] = "train"
    steps: int = 20
    prompts_per_step: int = 256
    lr: float = 5e-4
    lr_warmup_steps: int = 5      # linear warm-up of the learning rate over the first N updates
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    clip_ratio: float = 0.2
    max_grad_norm: float = 1.0
    norm_adv_by_std: bool = True
    old_logprob: str = "verify"   # verify: recompute and diff every step | every_n | skip: old = rollout log-probs
    old_logprob_every: int = 10   # every_n: verify steps 1, 1 + N, 1 + 2N, ...
    rollout_is: str | None = None         # TIS: null | token | sequence
    rollout_is_threshold: float = 2.0     # TIS weight min(pi_old / pi_rollout, threshold)
    rollout_rs: str | None = None         # MIS: null | token | sequence
    rollout_rs_threshold: float = 2.0     # MIS masks ratios outside [1 / threshold, threshold]
    reward: str = "exact_answer"  # a name in onepath.train.rewards.REWARDS, or "file.py:function"
    overlong_buffer: int = 0      # DAPO soft overlong penalty over the last N tokens of rollout.max_tokens; 0 = off
    overlong_penalty_factor: float = 1.0
    seed: int = 0
    val_every: int = 5            # score the held-out split every N steps and at the last; 0 = off
    val_before_train: bool = False  # also score it once before the first update, logged as step 0 (verl's name)
    val_temperature: float | None = None  # null = rollout.temperature; 0 = greedy
    log_every: int = 1
    save_every: int = 0           # checkpoint run_dir/step_N (weights + trainer state) every N steps; 0 = last only
    keep_last: int = 2            # step_N checkpoints kept; older ones are deleted
    recompute: bool = False       # activation recomputation: each decoder layer's forward runs again in backward
    micro_batch_tokens: int | None = None  # forward + backward per micro-batch of whole sequences; null/0 = one
    master_dtype: str | None = None  # float32: AdamW steps FP32 copies of BF16 weights; null = the model's dtype
    # DAPO dynamic sampling: groups whose rewards are all equal are dropped and more prompts sampled until the
    # step has prompts_per_step groups, in at most max_gen_batches rollouts per step
    filter_groups: bool = False
    max_gen_batches: int = 4
    # DeepSeek-V4: > 0 trains the lightning indexer (frozen at 0) by its KL loss to the attention's choice of
    # entries (Decoder.indexer_loss) times this weight, added to the policy loss
    indexer_loss: float = 0.0

    def __post_init__(self):
        self._coerce()
        self._require("steps", self.steps >= 0, "must be >= 0")
        self._require("save_every", self.save_every >= 0, "must be >= 0", "0 saves the final step only")
        self._require("keep_last", self.keep_last >= 1, "must be >= 1", "a run keeps at least its latest checkpoint")
        self._require("lr_warmup_steps", self.lr_warmup_steps >= 0, "must be >= 0", "0 turns warm-up off")
        self._positive("prompts_per_step", "log_every")
        self._finite_positive("lr", "clip_ratio", "max_grad_norm")
        self._require("weight_decay", math.isfinite(self.weight_decay) and self.weight_decay >= 0, "must be >= 0")
        self._require("betas", all(0 <= b < 1 for b in self.betas), "must both be in [0, 1)",
                      "Adam's moment decay rates, e.g. [0.9, 0.999]")
        self._require("overlong_buffer", self.overlong_buffer >= 0, "must be >= 0", "0 turns the penalty off")
        self._require("master_dtype", self.master_dtype in (None, "float32", "bfloat16"), "is not supported",
                      "use float32 (FP32 master weights), bfloat16, or null for the model's own dtype")
        self._require("reward", self.reward != "", "is empty",
                      "give a reward name such as exact_answer, or path/to/file.py:function")
        self._require("old_logprob", self.old_logprob in OLD_LOGPROB, "is not a policy",
                      f"use one of {', '.join(OLD_LOGPROB)}")
        self._positive("old_logprob_every")
        for key in ("rollout_is", "rollout_rs"):
            level = getattr(self, key)
            self._require(key, level is None or level in CORRECTION_LEVELS, "is not a level",
                          f"use one of {', '.join(CORRECTION_LEVELS)}, or null for off")
            self._require(key, level is None or self.old_logprob == "verify",
                          f"needs train.old_logprob = 'verify', not {self.old_logprob!r}",
                          "the correction weighs pi_old / pi_rollout, which is 1 whenever old log-probs are the "
                          "rollout's")
            threshold = f"{key}_threshold"
            self._require(threshold, math.isfinite(getattr(self, threshold)) and getattr(self, threshold) >= 1,
                          "must be a finite number >= 1", "the on-policy ratio 1 must pass untouched")
        self._require("val_every", self.val_every >= 0, "must be >= 0", "0 turns evaluation off")
        self._require("micro_batch_tokens", self.micro_batch_tokens is None or self.micro_batch_tokens >= 0,
                      "must be >= 0", "a token budget per backward; 0 or null runs the whole step in one")
        if self.micro_batch_tokens == 0:
            self.micro_batch_tokens = None  # one spelling of "off", so a resumed run's config hash agrees
        if self.val_temperature is not None:
            self._require("val_temperature", math.isfinite(self.val_temperature) and self.val_temperature >= 0,
                          "must be a finite number >= 0", "0 decodes greedily")
        self._positive("max_gen_batches")
        self._require("indexer_loss", math.isfinite(self.indexer_loss) and self.indexer_loss >= 0,
                      "must be a finite number >= 0", "0 keeps a DeepSeek-V4 indexer frozen")


@dataclass(slots=True)
class LoggerSection(_Section):
    NAME: ClassVar[str] = "logger"
    wandb: bool = False           # log every step's metrics to Weights & Biases too (pip install wandb)
    project: str = "onepath"
    name: str | None = None       # null = the --out directory's name; the mode is appended

    def __post_init__(self):
        self._coerce()
        self._require("project", self.project != "", "is empty", "give a W&B project name")
        self._require("name", self.name != "", "is empty", "give a run name, or null for the --out directory's name")


@dataclass(slots=True)
class ParallelSection(_Section):
    """How the processes share the work; on one process every layout is single. rollout: single (the
    first rollout rank's engine samples every prompt) | dp (an engine replica per rank, each on its share
    of the prompts) | ep (an engine per rank, experts split over every rank) | tp (engines tensor-parallel
    over `tp` ranks each, the groups data-parallel). trainer: single (rank 0 trains) | fsdp (each rank owns
    1/N of every parameter and its AdamW state) | ep (experts split over every rank, the rest replicated).
    rollout_processes: 0 colocates both sides on every process; R > 0 gives the last R processes the
    engines and the others the trainer (disaggregated). launcher: torchrun (the processes torchrun starts)
    or ray (`onepath train` starts `processes` Ray actors, on the cluster at ray_address)."""
    NAME: ClassVar[str] = "parallel"
    rollout: str = "single"
    trainer: str = "single"
    tp: int | None = None            # rollout tp: ranks per engine; null = every rollout process
    rollout_processes: int = 0
    launcher: str = "torchrun"
    processes: int | None = None     # launcher ray: how many (null: 2); torchrun: its --nproc-per-node x --nnodes
    ray_address: str | None = None   # null starts a Ray instance on this machine; "auto" joins the running cluster

    def __post_init__(self):
        self._coerce()
        self._require("rollout", self.rollout in ROLLOUT_LAYOUTS, "is not a rollout layout",
                      f"use one of {', '.join(ROLLOUT_LAYOUTS)}")
        self._require("trainer", self.trainer in TRAINER_LAYOUTS, "is not a trainer layout",
                      f"use one of {', '.join(TRAINER_LAYOUTS)}")
        self._require("launcher", self.launcher in LAUNCHERS, "is not a launcher", f"use one of {', '.join(LAUNCHERS)}")
        if self.tp is not None:
            self._require("tp", self.tp >= 1, "must be >= 1")
            self._require("tp", self.rollout == "tp" or self.tp == 1, f"applies to parallel.rollout tp, not "
                          f"{self.rollout!r}", "set parallel.rollout tp, or drop parallel.tp")
        self._require("rollout_processes", self.rollout_processes >= 0, "must be >= 0",
                      "0 colocates the engines and the trainer on every process")
        if self.rollout_processes:
            self._require("rollout_processes", "ep" not in (self.rollout, self.trainer),
                          f"splits the processes, but a layout is ep (rollout {self.rollout}, trainer "
                          f"{self.trainer})", "expert parallelism runs over every process: use 0, or dp/tp and fsdp")
        if self.processes is not None:
            self._require("processes", self.processes >= 1, "must be >= 1")
            self._require("processes", self.launcher == "ray", "applies to parallel.launcher ray",
                          "torchrun's --nproc-per-node (x --nnodes) sets the processes")
        if self.ray_address is not None:
            self._require("ray_address", self.launcher == "ray", "applies to parallel.launcher ray",
                          "set parallel.launcher ray, or drop parallel.ray_address")


SECTIONS: dict[str, type[_Section]] = {
    "model": ModelSection, "data": DataSection, "warm_start": WarmStartSection,
    "rollout": RolloutSection, "train": TrainSection, "logger": LoggerSection, "parallel": ParallelSection,
}


@dataclass(slots=True)
class RunConfig(_Section):
    NAME: ClassVar[str] = ""
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    warm_start: WarmStartSection = field(default_factory=WarmStartSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    train: TrainSection = field(default_factory=TrainSection)
    logger: LoggerSection = field(default_factory=LoggerSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    mode: str = "consistent"
    device: str = "cpu"
    quant: str | None = None
    # the trainer's formats in a baseline run, where they may differ from the rollout's `quant` (the fast
    # path users run: FP8 rollout, an unquantised trainer): presets joined by '+', or "none"; null = quant.
    # A consistent run computes both sides under one spec and refuses it.
    trainer_quant: str | None = None
    out: str = "runs/demo"

    def __post_init__(self):
        for name, cls in SECTIONS.items():
            self._require(name, isinstance(getattr(self, name), cls), f"must be a {cls.__name__}")
        if self.warm_start.steps is None:
            self.warm_start.steps = 0 if self.model.path else WarmStartSection.EMBEDDED_STEPS
        self.mode = _convert("mode", self.mode, str)
        self.out = _convert("out", self.out, str)
        self.device = _convert("device", self.device, str)
        self._require("device", self.device in ("cpu", "cuda"), "is not a device", "use cpu or cuda")
        self._require("mode", self.mode in MODES, "is not a mode", f"use one of {', '.join(MODES)}")
        self._require("out", self.out != "", "is empty", "give the run directory, e.g. runs/demo")
        if self.quant is not None:
            self.quant = _convert("quant", self.quant, str)
            ExecutionSpec.default("consistent", self.device, quant=self.quant)  # names the bad preset
        if self.trainer_quant is not None:
            self.trainer_quant = _convert("trainer_quant", self.trainer_quant, str)
            self._require("trainer_quant", self.mode != "consistent", "applies to baseline runs only",
                          "a consistent run computes the rollout and the trainer under one spec (quant); "
                          "use --mode baseline or both, or drop trainer_quant")
            if self.trainer_quant != "none":
                ExecutionSpec.default("baseline", self.device, quant=self.trainer_quant)
        if self.train.overlong_buffer > self.rollout.max_tokens:
            raise ValueError(f"train.overlong_buffer = {self.train.overlong_buffer} > rollout.max_tokens = "
                             f"{self.rollout.max_tokens}: the penalty window must fit in the response length")
        if self.rollout.agent is not None:
            self._require("mode", self.mode != "both", f"is refused with rollout.agent = {self.rollout.agent}",
                          "an agent drives one trainer at a time: run --mode consistent and --mode baseline as two runs")
            layouts = (self.parallel.rollout, self.parallel.trainer)
            if layouts != ("single", "single"):
                raise ValueError(f"rollout.agent = {self.rollout.agent} serves one engine: set parallel.rollout and "
                                 f"parallel.trainer single (they are {layouts[0]}, {layouts[1]})")
        if self.train.filter_groups and self.parallel.trainer == "ep":
            raise ValueError("train.filter_groups with parallel.trainer = 'ep': the kept groups may leave a rank "
                             "without rows, and every ep rank must run each step's forward; use fsdp or single")
        ep = [side for side in ("rollout", "trainer") if getattr(self.parallel, side) == "ep"]
        if ep and self.model.path is None and self.model.model_type != "qwen3_moe":
            raise ValueError(f"parallel.{ep[0]} = 'ep' splits the experts, but model.model_type = "
                             f"{self.model.model_type!r} is dense: use dp/fsdp, or a qwen3_moe model")
        if self.model.path is None and self.rollout.max_model_len > self.model.max_position_embeddings:
            raise ValueError(
                f"rollout.max_model_len = {self.rollout.max_model_len} > model.max_position_embeddings = "
                f"{self.model.max_position_embeddings}: the model has no positions past that; "
                "lower rollout.max_model_len or raise model.max_position_embeddings")

    def to_dict(self) -> dict:
        out = {name: {f.name: _plain(getattr(getattr(self, name), f.name)) for f in fields(cls)}
               for name, cls in SECTIONS.items()}
        out = {**out, "mode": self.mode, "device": self.device, "quant": self.quant, "out": self.out}
        if self.trainer_quant is not None:  # only when set: the config hash of every other run stays as it was
            out["trainer_quant"] = self.trainer_quant
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> RunConfig:
        if not isinstance(raw, dict):
            raise ValueError(f"a run config is a mapping of sections, got {type(raw).__name__}")
        top = _top_keys()
        unknown = [k for k in raw if k not in top]
        if unknown:
            raise ValueError(f"unknown config key {unknown[0]!r}: valid keys are {', '.join(top)}")
        kwargs = {}
        for name, value in raw.items():
            if name not in SECTIONS:
                kwargs[name] = value
                continue
            value = {} if value is None else value
            if not isinstance(value, dict):
                raise ValueError(f"{name} must be a mapping of {name}.* keys, got {_show(value)}")
            for key in value:
                _section_field(name, key)
            kwargs[name] = SECTIONS[name](**value)
        return cls(**kwargs)


def trainer_spec(cfg: RunConfig, spec: ExecutionSpec) -> ExecutionSpec:
    """The trainer's spec beside the rollout's `spec`: the same but in a baseline run with trainer_quant set."""
    if spec.mode != "baseline" or cfg.trainer_quant is None:
        return spec
    quant = None if cfg.trainer_quant == "none" else cfg.trainer_quant
    return ExecutionSpec.default("baseline", cfg.device, quant=quant)


def engine_settings(cfg: RunConfig) -> dict:
    """LLMEngine's keyword arguments from cfg.rollout: KV cache, scheduler, CUDA graphs (the trainer,
    `onepath generate` and the benchmarks build their engines from this alone)."""
    r = cfg.rollout
    return dict(num_blocks=r.num_blocks, block_size=r.block_size,
                scheduler=SchedulerConfig(r.max_num_seqs, r.max_num_batched_tokens, r.max_model_len,
                                          r.prefill_chunk_size),
                gpu_memory_utilization=r.gpu_memory_utilization, cuda_graphs=r.cuda_graphs)


def sampling_params(cfg: RunConfig, seed: int, **overrides) -> SamplingParams:
    """The rollout's sampling settings from cfg.rollout; overrides (temperature, stop_token_ids, ...) win."""
    r = cfg.rollout
    settings = dict(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_tokens=r.max_tokens, seed=seed)
    return SamplingParams(**{**settings, **overrides})


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """The config file (partial is fine: missing keys keep their defaults), then CLI overrides
    `--section.key value`, `--section.key=value`, `--mode both`, applied in order."""
    raw = _read_yaml(Path(path)) if path is not None else {}
    for key, token in _override_pairs(overrides):
        if "." in key:
            section, name = key.split(".", 1)
            hint = _hints(_section_field(section, name))[name]
            current = raw.get(section) or {}
            if isinstance(current, dict):  # anything else is reported by from_dict
                raw[section] = {**current, name: _parse_token(token, hint)}
        elif key in SECTIONS:
            raise ValueError(f"--{key} is a section: set one of its keys, e.g. --{key}.{fields(SECTIONS[key])[0].name}")
        elif key in _top_keys():
            raw[key] = _parse_token(token, str)
        else:
            raise ValueError(f"unknown option --{key}: valid keys are "
                             f"{', '.join(k + '.*' if k in SECTIONS else k for k in _top_keys())}")
    return RunConfig.from_dict(raw)


def dump_yaml(cfg: RunConfig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.dump(cfg.to_dict(), Dumper=_Dumper, sort_keys=False))
    return path


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(  # sections as blocks, lists such as betas on one line
    list, lambda dumper, value: dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=True))


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path} does not exist: give a YAML file such as "
                                "onepath/configs/demo.yaml, or no --config for the defaults") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise ValueError(f"{where}: invalid YAML: {problem}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a run config is a mapping of sections (model:, data:, ...), "
                         f"got a {type(raw).__name__}")
    return raw


def _override_pairs(tokens: list[str]) -> list[tuple[str, str]]:
    pairs, i = [], 0
    tokens = list(tokens)
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token == "--":
            raise ValueError(f"unexpected argument {token!r}: overrides look like --train.lr 1e-5 or --rollout.n=4")
        if "=" in token:
            key, value = token[2:].split("=", 1)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            key, value = token[2:], tokens[i + 1]
            i += 2
        else:
            raise ValueError(f"{token} needs a value, e.g. {token} VALUE or {token}=VALUE")
        pairs.append((key.replace("-", "_"), value))
    return pairs


def _parse_token(token: str, hint):
    if _base(hint) is str:
        # A string field keeps the token as typed: "1.10" or "007" are names, not numbers.
        return None if token in ("null", "~") and _optional(hint) else token
    return yaml.safe_load(token)


def _top_keys() -> list[str]:
    return [f.name for f in fields(RunConfig)]


def _section_field(section: str, key: str) -> type[_Section]:
    if section not in SECTIONS:
        raise ValueError(f"unknown config section {section!r}: valid sections are {', '.join(SECTIONS)}")
    cls = SECTIONS[section]
    names = [f.name for f in fields(cls)]
    if key not in names:
        raise ValueError(f"unknown key {section}.{key}: valid keys of {section} are {', '.join(names)}")
    return cls


_HINTS: dict[type, dict] = {}


def _hints(cls: type) -> dict:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _optional(hint) -> bool:
    return isinstance(hint, types.UnionType) and type(None) in hint.__args__


def _base(hint):
    if _optional(hint):
        return next(a for a in hint.__args__ if a is not type(None))
    return hint


def _convert(name: str, value, hint):
    if value is None and _optional(hint):
        return None
    base = _base(hint)
    if typing.get_origin(base) is tuple:
        args = typing.get_args(base)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ValueError(f"{name} = {_show(value)} must be a list of {len(args)} numbers, e.g. [0.9, 0.999]")
        return tuple(_convert(f"{name}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if base is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{name} = {_show(value)} must be true or false")
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = _number(value)
        if number is not None and number.is_integer():
            return int(number)
        raise ValueError(f"{name} = {_show(value)} must be an integer")
    if base is float:
        number = _number(value)
        if number is not None:
            return number
        raise ValueError(f"{name} = {_show(value)} must be a number, e.g. 1e-5")
    if base is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{name} = {_show(value)} must be a string: quote it in YAML")
    if base is dict:
        if isinstance(value, dict):
            return value
        raise ValueError(f"{name} = {_show(value)} must be a mapping, e.g. {{enable_thinking: false}}")
    raise TypeError(f"{name}: no conversion for type {hint}")


def _number(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads 1e-5 (no dot) as a string
        except ValueError:
            return None
    return None


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def _show(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)
