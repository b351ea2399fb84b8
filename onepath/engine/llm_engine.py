"""LLMEngine: requests in, completions with per-token log-probs out (continuous batching).

Every sampled token comes with its log-probability under the exact distribution it was sampled
from (after temperature, top-k and top-p), so the trainer can recompute the same number.
"""
from __future__ import annotations

import contextlib
import gc
import sys
import time
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from onepath.engine.block_manager import BlockManager
from onepath.engine import memory
from onepath.engine.model_runner import ModelRunner, Sampled
from onepath.engine.model_runner import graph_batch_sizes as graph_batch_sizes_for
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import Scheduler, SchedulerConfig
from onepath.engine.sequence import Sequence
from onepath.models.dense import DenseDecoder
from onepath.models.kv_cache import BLOCK_SIZE
from onepath.ops.linear_quant import refresh_quantized


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    error: str | None = None
    text: str = ""
    routing: torch.Tensor | None = None  # MoE experts [prompt + completion - 1, layers, k] (record_routing)


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    seconds: float = 0.0
    preemptions: int = 0
    cached_tokens: int = 0  # tokens whose K/V came from the prefix cache instead of a forward pass
    graph_steps: int = 0    # decode steps replayed from a captured CUDA graph
    eager_steps: int = 0
    ahead_steps: int = 0    # launched before the previous step's tokens reached the host (async scheduling)


# The full-collection threshold inside young_collections_only: never reached (it counts young collections).
NO_FULL_COLLECTIONS = 1 << 30


@contextlib.contextmanager
def young_collections_only():
    """Inside the block Python's collector runs its young collections only: the full-collection threshold
    is out of reach, and the caller's thresholds come back at exit, so the next full collection, outside,
    sees everything made inside. Nothing is frozen, so blocks nest and a caller's own gc.freeze() stays as it
    was. Why: a full collection inside generate stalls the host while the GPU idles (the measurements, and why
    an earlier form that froze objects never acted: docs/gpu-performance.md, host pauses)."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], NO_FULL_COLLECTIONS)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


GPU_MEMORY_UTILIZATION = 0.9  # share of the GPU's memory the KV cache may fill when num_blocks is None
CPU_NUM_BLOCKS = 1024         # KV-cache blocks on the CPU when num_blocks is None


class LLMEngine:
    def __init__(self, model: DenseDecoder, *, num_blocks: int | None = None, block_size: int = BLOCK_SIZE,
                 scheduler: SchedulerConfig | None = None, eos_token_ids: tuple[int, ...] | None = None,
                 tokenizer=None, enable_prefix_caching: bool | None = None,
                 gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
                 cuda_graphs: bool | None = None, graph_batch_sizes: list[int] | None = None,
                 record_routing: bool = False, async_scheduling: bool = True):
        """num_blocks: KV-cache blocks; None sizes the cache from gpu_memory_utilization on CUDA (1024 on
        CPU). cuda_graphs: decode steps replay captured graphs (None: on when the model is on CUDA and
        capturable, and routing is not recorded) at
        graph_batch_sizes (default 1, 2, 4, 8 and multiples of 16 up to max_num_seqs). record_routing: each
        output carries the MoE routers' choices at every position its forwards computed (RequestOutput.routing).
        async_scheduling: schedule and launch each decode step before the previous one's tokens reach the
        host (the same tokens and log-probs: a row's bits do not depend on its batch). enable_prefix_caching:
        None is on, except for a model with recurrent state (a hybrid: refused there, see below)."""
        self.model, self.tokenizer = model, tokenizer
        # q/k/v and gate/up read one stacked weight each, with no copy per step (a captured graph reads it)
        model.share_projection_storage()
        self.scheduler_config = replace(scheduler or SchedulerConfig(),
                                        chunk_align=model.ops.kv_tile)
        config = self.scheduler_config
        if hasattr(model, "rope_cos") and config.max_model_len > model.rope_cos.shape[0]:
            raise ValueError(f"max_model_len {config.max_model_len} > the model's "
                             f"{model.rope_cos.shape[0]} RoPE positions: lower max_model_len")
        # a hybrid's Mamba layers (DeepSeek-V4's rings) keep a state per sequence beside the KV cache, one slot per
        # running sequence
        state_slots = config.max_num_seqs if model.has_recurrent_state else 0
        if state_slots and enable_prefix_caching:
            why = getattr(model, "prefix_caching_refused",
                          "a cached prefix holds the attention layers' K/V but not the Mamba layers' state after it")
            raise ValueError(f"prefix caching is not supported for {model.config.model_type}: {why}; pass "
                             "enable_prefix_caching=False (the default for this model)")
        enable_prefix_caching = not state_slots if enable_prefix_caching is None else enable_prefix_caching
        on_cuda = model.device.type == "cuda"
        capturable = getattr(model, "capturable", True)
        if cuda_graphs and not capturable:
            raise ValueError(f"{type(model).__name__} cannot be captured in a CUDA graph (it reads sizes on the "
                             "host inside its forward): pass cuda_graphs=False or leave it None")
        # recorded routing is read on the host after each forward: eager steps
        cuda_graphs = on_cuda and capturable and not record_routing if cuda_graphs is None else cuda_graphs
        if num_blocks is None:
            num_blocks = (memory.kv_blocks_for(model, config, block_size, gpu_memory_utilization, state_slots)
                          if on_cuda else CPU_NUM_BLOCKS)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, state_slots)
        if graph_batch_sizes is not None and (not graph_batch_sizes or min(graph_batch_sizes) < 1):
            raise ValueError(f"graph_batch_sizes {graph_batch_sizes} must be batch sizes >= 1, e.g. [1, 2, 4, 8, 16, "
                             "32]; a decode step of more sequences than the largest runs eagerly")
        sizes = (graph_batch_sizes or graph_batch_sizes_for(config.max_num_seqs)) if cuda_graphs else None
        self.runner = ModelRunner(model, num_blocks, block_size, max_model_len=config.max_model_len,
                                  graph_batch_sizes=sizes, record_routing=record_routing, state_slots=state_slots)
        self.memory = memory.report(model, self.runner.cache, gpu_memory_utilization if on_cuda else None)
        self.eos_token_ids = model.config.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
        self.next_request_id = 0
        self.weight_version = 0  # moves at every weight update: what a server tags its responses with
        self.stats = EngineStats()
        self.async_scheduling = async_scheduling
        self.pending: tuple[list, Sampled] | None = None  # the launched step whose tokens are not on the host yet
        # A list here (benchmarks set one) gets (seconds, replayed a graph) for each step generate() runs.
        self.step_times: list[tuple[float, bool]] | None = None

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: int | None = None,
                    sample_id: int | None = None) -> int:
        """Queue one request. A bad request raises ValueError naming its problem; nothing else is touched.
        sample_id: what its sampling noise is keyed by besides the seed and position (default request_id)."""
        if request_id is None:
            request_id = self.next_request_id
        self.next_request_id = max(self.next_request_id, request_id + 1)
        token_ids = self.encode(prompt, request_id)
        vocab = self.model.config.vocab_size
        bad = [t for t in token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"request {request_id}: token id {bad[0]} is outside the vocabulary [0, {vocab}): "
                             "encode prompts with the model's tokenizer")
        self.scheduler.add(Sequence(request_id, [int(t) for t in token_ids], params, self.eos_token_ids, sample_id))
        return request_id

    def encode(self, prompt, request_id) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {request_id} is text but the engine has no tokenizer: pass token ids")
            if not prompt:
                raise ValueError(f"request {request_id} has an empty prompt: give at least one token")
            return self.tokenizer.encode(prompt).ids
        return list(prompt)

    def step(self) -> list[Sequence]:
        """Schedule and launch one step; return the sequences that finished. With async scheduling a
        decode step is scheduled and launched while the previous step's tokens are still on their way
        to the host (placeholders on the host side, fed from the device): the host's scheduling and
        bookkeeping overlap the GPU's forward instead of leaving it idle between steps."""
        finished = []
        if self.pending is not None and not self.scheduler.can_decode_ahead():
            finished += self.complete()
        scheduled = self.scheduler.schedule()
        sampled = self.runner.run(scheduled, self.pending[1] if self.pending else None) if scheduled else None
        if self.pending is not None:
            self.stats.ahead_steps += bool(scheduled)
            finished += self.complete()
        if not scheduled:
            return finished
        self.scheduler.advance(scheduled)
        self.stats.steps += 1
        if self.runner.replayed_graph:
            self.stats.graph_steps += 1
        else:
            self.stats.eager_steps += 1
        self.stats.generated_tokens += len(sampled.seqs)
        self.stats.prefill_tokens += sum(s.num_tokens for s in scheduled) - len(sampled.seqs)
        self.pending = scheduled, sampled
        if not self.async_scheduling:
            finished += self.complete()
        return finished

    def complete(self) -> list[Sequence]:
        scheduled, sampled = self.pending
        self.pending = None
        return self.scheduler.complete(scheduled, sampled.result())

    def has_unfinished(self) -> bool:
        return not self.scheduler.is_finished() or self.pending is not None

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams],
                 request_ids: list[int] | None = None, progress: str | None = None) -> list[RequestOutput]:
        """Run requests to completion; outputs come back in input order. A request that is bad
        (empty, too long, unknown token id) gets an output with `error` set; the others still finish.
        progress: a label; a bar of the tokens run so far (prompt and sampled), their rate and the time
        left, on stderr."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        request_ids = request_ids or [self.next_request_id + i for i in range(len(prompts))]
        outputs: dict[int, RequestOutput] = {}
        for prompt, p, rid in zip(prompts, params, request_ids):
            try:
                self.add_request(prompt, p, rid)
            except ValueError as e:
                ids = prompt if isinstance(prompt, list) else []
                outputs[rid] = RequestOutput(rid, list(ids), [], [], "error", str(e))
        bar = self.progress_bar(progress, [rid for rid in request_ids if rid not in outputs])
        start = time.perf_counter()
        preemptions, cached = self.scheduler.num_preemptions, self.block_manager.num_cached_tokens_hit
        with young_collections_only():
            while self.has_unfinished():
                began = time.perf_counter() if self.step_times is not None else None
                done = self.stats.prefill_tokens + self.stats.generated_tokens
                for seq in self.step():
                    outputs[seq.request_id] = self.output(seq)
                if began is not None:
                    self.step_times.append((time.perf_counter() - began, self.runner.replayed_graph))
                if bar is not None:
                    bar.update(self.stats.prefill_tokens + self.stats.generated_tokens - done)
        if bar is not None:
            bar.close()
        self.stats.seconds += time.perf_counter() - start
        self.stats.preemptions += self.scheduler.num_preemptions - preemptions
        self.stats.cached_tokens += self.block_manager.num_cached_tokens_hit - cached
        if self.model.device.type == "cuda":
            self.memory["peak_gib"] = torch.cuda.max_memory_allocated(self.model.device) / memory.GIB
        return [outputs[rid] for rid in request_ids]

    def progress_bar(self, label: str | None, request_ids: list[int]) -> tqdm | None:
        """A bar over the most tokens these queued requests may run: the prompt, then each sampled token but
        the last (EOS may stop them sooner; a prefix-cache hit skips prompt tokens)."""
        if label is None:
            return None
        live, limit = self.scheduler.live, self.scheduler_config.max_model_len
        total = sum(min(live[r].num_tokens + live[r].params.max_tokens, limit) - 1 for r in request_ids)
        # shown after 2 s only (a short call prints nothing); in a log file a redraw every half minute
        return tqdm(total=total, desc=label, unit="tok", leave=False, delay=2,
                    mininterval=0.5 if sys.stderr.isatty() else 30)

    def output(self, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.completion_token_ids) if self.tokenizer is not None else ""
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.completion_token_ids, list(seq.logprobs),
                             seq.finish_reason, seq.error, text, seq.routing_by_position())

    @torch.no_grad()
    def update_weights(self, named_tensors) -> None:
        """Copy new weights into the engine's own parameter storage (in place: nothing that holds a
        reference to the old tensors, a captured graph included, goes stale). The prefix cache is
        dropped: its K/V were computed with the old weights."""
        params = dict(self.model.named_parameters())
        named_tensors = dict(named_tensors)
        unknown = [name for name in named_tensors if name not in params]
        if unknown:
            raise KeyError(f"weights {unknown} are not parameters of the engine's model")
        for name, tensor in named_tensors.items():
            params[name].copy_(tensor)
        self.weights_changed()

    def weights_changed(self) -> None:
        """Weights were written into the engine's storage by someone else (a broadcast): drop what was
        computed from the old ones: the prefix cache, and the quantised weight copies are rewritten in
        their own storage (captured graphs read them). RoPE tables are not weight-derived. The weight
        version moves on."""
        self.block_manager.reset_prefix_cache()
        refresh_quantized(self.model)
        self.weight_version += 1
