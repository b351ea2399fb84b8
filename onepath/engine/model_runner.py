"""ModelRunner: turns a scheduled step into one forward pass over the paged KV cache, then samples.

CUDA graphs (decode): a step whose sequences all decode one token runs a graph captured at the
smallest captured batch size >= its size; other steps (prefill, chunks, mixed) run eagerly. The
graph holds the model and the LM head; sampling runs eagerly on its logits. A request moves
between the two paths with its batch, so they must give the same bits, and they do because every
consistent kernel's row result is independent of the row count (tests/engine/test_cuda_graphs_gpu.py):
a graph is the eager forward at a padded batch. Padding rows decode token 0 at position 0 into a
scratch block that the block manager never hands out, so they touch no sequence's K/V, and with per-sequence
state (a hybrid's, DeepSeek-V4's rings) into the cache's scratch slot, which the scheduler never hands out.

Inside a graph nothing depends on the live batch: inputs sit in static buffers (ids, positions,
slots, block tables as wide as max_model_len; a hybrid's state slots), the attention's key bound is
max_model_len, the recurrent ops read each row's position and state slot on the device
(ops/spans.SeqSpans.decode), and the ops skip their host-side input checks while capturing (the engine
checked ids and lengths on entry).
"""
from __future__ import annotations

from array import array

import torch

from onepath.engine.sampling_params import greedy_rows, sampling_tensors
from onepath.engine.scheduler import ScheduledSeq
from onepath.engine.sequence import PLACEHOLDER, Sequence
from onepath.models.batch import ForwardBatch, SeqChunk
from onepath.models.dense import DenseDecoder
from onepath.models.moe import RoutingRecorder
from onepath.models.kv_cache import KVCache
from onepath.ops.attention import AttentionMetadata
from onepath.ops.host import to_device
from onepath.ops.sampling import position_key


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Captured decode forwards (model + LM head) for a ladder of batch sizes, sharing one memory pool."""

    def __init__(self, model: DenseDecoder, cache: KVCache, scratch_block: int, max_model_len: int,
                 batch_sizes: list[int], capture: bool = True):
        """capture=False runs the padded static-buffer forward eagerly instead of replaying (tests on CPU)."""
        self.model, self.cache = model, cache
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch = self.batch_sizes[-1]
        self.width = -(-max_model_len // self.block_size)
        self.scratch_slot = scratch_block * self.block_size
        self.scratch_block = scratch_block
        device = model.device
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.query_seq = torch.arange(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((n, self.width), scratch_block, dtype=torch.long, device=device)
        # the cache's state slot for padding rows, past the scheduler's (None: no per-sequence state)
        self.scratch_state = cache.scratch_slot
        self.state_slots = None if self.scratch_state is None else \
            torch.full((n,), self.scratch_state, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self.capture()

    def batch(self, size: int) -> ForwardBatch:
        # context_lens only bounds the attention's split buffer: every context is <= max_model_len
        attn = AttentionMetadata(positions=self.positions[:size], query_seq=self.query_seq[:size],
                                 cu_seqlens=list(range(size + 1)), context_lens=[self.max_model_len] * size,
                                 block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
                                 block_size=self.block_size)
        return ForwardBatch(self.input_ids[:size], attn, None if self.state_slots is None else self.state_slots[:size])

    def forward(self, size: int) -> torch.Tensor:
        return self.model.compute_logits(self.model(self.batch(size), self.cache))

    @torch.no_grad()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.batch_sizes):  # largest first: the smaller graphs reuse its pool
            # one eager run first, on a side stream: kernels compile (tile configs follow M) outside the capture
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.forward(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(size)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    def run(self, chunks: list[SeqChunk], feed: "Feed | None" = None) -> torch.Tensor:
        """Logits [len(chunks), vocab] of one decode token per chunk."""
        size = self.stage(chunks)
        if feed is not None:
            feed.into(self.input_ids)
        if size not in self.graphs:
            return self.forward(size)[:len(chunks)]
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:len(chunks)]

    def stage(self, chunks: list[SeqChunk]) -> int:
        """Copy one decode token per chunk into the static buffers, padded to the smallest captured batch
        size that holds them (returned): one pinned host buffer, one copy."""
        n = len(chunks)
        size = next(b for b in self.batch_sizes if b >= n)
        bs, pad = self.block_size, size - n
        # Table columns past a row's own blocks are never read (the kernel loads the entries of its
        # keys only), so only the live width is copied; padding rows point at the scratch block.
        width = max(len(c.block_table) for c in chunks)
        host = array("q", [c.token_ids[0] for c in chunks])
        host.extend(array("q", [0]) * pad)
        host.fromlist([c.start for c in chunks])
        host.extend(array("q", [0]) * pad)
        host.fromlist([c.block_table[c.start // bs] * bs + c.start % bs for c in chunks])
        host.extend(array("q", [self.scratch_slot]) * pad)
        scratch_row = array("q", [self.scratch_block]) * width
        for c in chunks:
            host.fromlist(c.block_table)
            host.extend(scratch_row[:width - len(c.block_table)])
        host.extend(scratch_row * pad)
        if self.state_slots is not None:
            host.fromlist([c.state_slot for c in chunks])
            host.extend(array("q", [self.scratch_state]) * pad)
        staged = to_device(torch.frombuffer(host, dtype=torch.long), torch.long, self.input_ids.device)
        self.input_ids[:size].copy_(staged[:size])
        self.positions[:size].copy_(staged[size:2 * size])
        self.slot_mapping[:size].copy_(staged[2 * size:3 * size])
        tables = 3 * size + size * width
        self.block_tables[:size, :width].copy_(staged[3 * size:tables].view(size, width))
        if self.state_slots is not None:
            self.state_slots[:size].copy_(staged[tables:])
        return size


class Sampled:
    """A launched step's sampled tokens and log-probs, on the device until result() (one copy, one wait)."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor):
        self.seqs, self.tokens = seqs, tokens
        self.rows = {s.request_id: i for i, s in enumerate(seqs)}
        pair = torch.stack([tokens.double(), logprobs.double()])  # float64 holds every token id exactly
        if pair.is_cuda:
            self.host = torch.empty(pair.shape, dtype=pair.dtype, pin_memory=True)
            self.host.copy_(pair, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host, self.done = pair, None

    def result(self) -> dict[int, tuple[int, float]]:
        if self.done is not None:
            self.done.synchronize()
        tokens, logprobs = self.host.tolist()
        return {s.request_id: (int(t), lp) for s, t, lp in zip(self.seqs, tokens, logprobs)}


class Feed:
    """Input rows whose token is a previous step's sampled token still on the device (async scheduling)."""

    def __init__(self, rows: list[int], source: list[int], pending: Sampled):
        device = pending.tokens.device
        self.rows = to_device(rows, torch.long, device)
        self.values = pending.tokens.index_select(0, to_device(source, torch.long, device)).long()

    @classmethod
    def of(cls, scheduled: list[ScheduledSeq], first_rows, pending: Sampled | None) -> "Feed | None":
        """The rows (first_rows[i]: scheduled[i]'s first input row) that feed a placeholder."""
        if pending is None:
            return None
        hits = []
        for i, s in enumerate(scheduled):
            if s.seq.token_ids[s.start] == PLACEHOLDER:
                hits.append((int(first_rows[i]), pending.rows[s.seq.request_id]))
            elif PLACEHOLDER in s.seq.token_ids[s.start:s.start + s.num_tokens]:
                raise RuntimeError(f"request {s.seq.request_id}: a placeholder inside a chunk; a step scheduled "
                                   "ahead of its inputs must be decode only (Scheduler.can_decode_ahead)")
        if not hits:
            return None
        return cls([r for r, _ in hits], [i for _, i in hits], pending)

    def into(self, input_ids: torch.Tensor) -> None:
        input_ids.index_copy_(0, self.rows, self.values)


class ModelRunner:
    def __init__(self, model: DenseDecoder, num_blocks: int, block_size: int, *, max_model_len: int | None = None,
                 graph_batch_sizes: list[int] | None = None, record_routing: bool = False, state_slots: int = 0):
        """record_routing: keep every MoE router's choices on each sequence (Sequence.routing), by position.
        state_slots: the scheduler's per-sequence state slots (a model with has_recurrent_state; 0: none)."""
        self.model, self.ops = model, model.ops
        recorder = RoutingRecorder(model) if record_routing else None
        self.recorder = recorder if recorder is not None and recorder.routers else None  # a dense model: nothing
        if self.recorder is not None and graph_batch_sizes:
            raise ValueError("record_routing reads each forward's router choices on the host: turn cuda_graphs off")
        self.block_size = block_size
        # one block past the block manager's, where the padding rows of captured graphs write (a cache with
        # state slots holds their scratch slot past the scheduler's itself)
        self.cache = model.make_cache(num_blocks + 1, block_size, state_slots)
        self.graphs = None
        if graph_batch_sizes:
            if model.device.type != "cuda":
                raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {model.device}: "
                                 "turn cuda_graphs off")
            self.graphs = DecodeGraphs(model, self.cache, num_blocks, max_model_len, graph_batch_sizes)
        self.replayed_graph = False  # how the last step ran

    @staticmethod
    def chunks(scheduled: list[ScheduledSeq]) -> list[SeqChunk]:
        return [SeqChunk(s.seq.token_ids[s.start:s.start + s.num_tokens], s.start, s.seq.block_table,
                         s.seq.state_slot) for s in scheduled]

    @staticmethod
    def sample_keys(seqs: list[Sequence]) -> list[int]:
        """Each sequence's key for the token it samples now (at position num_tokens)."""
        return [position_key(s.request_key, s.num_tokens) for s in seqs]

    @torch.no_grad()
    def run(self, scheduled: list[ScheduledSeq], pending: Sampled | None = None) -> Sampled:
        """Launch the step's forward and sampling; nothing waits for the device. `pending`: the previous
        step, whose sampled tokens this decode-only step feeds from the device (their host copies are
        placeholders still)."""
        chunks = self.chunks(scheduled)
        if self.graphs is not None and 0 < len(scheduled) <= self.graphs.max_batch \
                and all(s.num_tokens == 1 and s.samples for s in scheduled):
            self.replayed_graph = True
            feed = Feed.of(scheduled, range(len(scheduled)), pending)
            return self.sample([s.seq for s in scheduled], self.graphs.run(chunks, feed))
        self.replayed_graph = False
        batch = ForwardBatch.build(chunks, self.block_size, self.model.device)
        feed = Feed.of(scheduled, batch.attn.cu_seqlens, pending)
        if feed is not None:
            feed.into(batch.input_ids)
        if self.recorder is None:
            hidden = self.model(batch, self.cache)
        else:
            with self.recorder:
                hidden = self.model(batch, self.cache)
            choices = self.recorder.take()
            for s, a in zip(scheduled, map(int, batch.attn.cu_seqlens)):
                s.seq.routing[s.start] = choices[a:a + s.num_tokens]  # a recompute after preemption overwrites
        rows = [batch.attn.cu_seqlens[i + 1] - 1 for i, s in enumerate(scheduled) if s.samples]
        seqs = [s.seq for s in scheduled if s.samples]
        if not seqs:
            return Sampled([], batch.input_ids[:0], batch.input_ids[:0].float())
        return self.sample(seqs, self.model.compute_logits(hidden[to_device(rows, torch.long, hidden.device)]))

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> Sampled:
        """Draw each sequence's next token and its log-probability under the distribution it was drawn
        from: softmax(logits / temperature) restricted to top-k / top-p and renormalised."""
        params = [s.params for s in seqs]
        temperature, top_k, top_p = sampling_tensors(params, logits.device)
        filtered = any(p.top_k or p.top_p < 1.0 for p in params)  # else no mask (and no sync)
        keep = self.ops.sampling_mask(logits, temperature, top_k, top_p) if filtered else None
        tokens, logprobs = self.ops.sample_with_logprobs(logits, temperature, self.sample_keys(seqs), keep,
                                                         greedy_rows(params, logits.device))
        return Sampled(seqs, tokens, logprobs)
