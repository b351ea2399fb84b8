"""Scheduler: continuous batching with chunked prefill and preemption by recompute (vLLM v1 style).

A hybrid model's running sequences also hold a recurrent state slot each (models/state_cache.py): taken at
admission, given back when a sequence is preempted (its recompute starts at position 0, with a fresh state),
reaches its length limit or finishes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from onepath.engine.block_manager import BlockManager
from onepath.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int
    # fixed when scheduled: postprocess moves num_computed_tokens and appends the sampled token
    start: int = field(init=False)
    samples: bool = field(init=False)

    def __post_init__(self):
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_tokens == self.seq.num_tokens

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.num_tokens)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 512
    prefill_chunk_size: int | None = None
    chunk_align: int = 1   # a prefill chunk that stops short of the end stops at a multiple of this (the KV tile)

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs {self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens {self.max_num_batched_tokens} must be >= 1")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len {self.max_model_len} must be >= 2: one prompt token and one generated")
        if self.chunk_align < 1:
            raise ValueError(f"chunk_align {self.chunk_align} must be >= 1 (1 = no alignment)")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size {self.prefill_chunk_size} must be >= 1, or None to prefill "
                             "whole prompts")


class Scheduler:

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, state_slots: int = 0):
        """state_slots: recurrent state slots (a hybrid model's; 0: none), at least max_num_seqs."""
        if state_slots and state_slots < config.max_num_seqs:
            raise ValueError(f"{state_slots} recurrent state slots for max_num_seqs {config.max_num_seqs}: give "
                             "every running sequence one")
        self.config = config
        self.block_manager = block_manager
        self.free_slots = list(range(state_slots))[::-1]
        self.uses_slots = state_slots > 0
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()  # in admission order: the last one is the next victim
        self.draining: list[Sequence] = []  # at their length limit, their last token not yet on the host
        self.live: dict[int, Sequence] = {}
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.draining

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.live:
            raise ValueError(f"request {seq.request_id} is already scheduled: request ids must be unique")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"request {seq.request_id} is {seq.status.name} with {seq.num_computed_tokens} computed "
                             "tokens: add only fresh sequences")
        max_len = self.config.max_model_len
        if seq.num_tokens >= max_len:
            raise ValueError(f"prompt length {seq.num_tokens} >= max_model_len {max_len} for request "
                             f"{seq.request_id}: raise max_model_len or truncate the prompt")
        # the last token is sampled, never computed: the cache holds at most max length - 1 tokens
        max_kv = min(seq.num_tokens + seq.params.max_tokens, max_len) - 1
        bm = self.block_manager
        if bm.num_blocks_for(max_kv) > bm.num_blocks:
            raise ValueError(f"request {seq.request_id} may need KV for {max_kv} tokens (prompt {seq.num_tokens}, "
                             f"max_tokens {seq.params.max_tokens}, max_model_len {max_len}) but the cache holds "
                             f"{bm.num_blocks * bm.block_size} ({bm.num_blocks} blocks of {bm.block_size}): "
                             "give the cache more blocks, or lower max_tokens or max_model_len")
        self.live[seq.request_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        for seq in list(self.running):
            # victims come off the end of running, so the first preempted one ends the pass
            if budget == 0 or seq.status is not SequenceStatus.RUNNING:
                break
            if seq.num_uncomputed_tokens == 1 and self.block_manager.holds_next_slot(seq):
                # a decode token whose slot is in a block the sequence holds: nothing to chunk or allocate
                scheduled.append(ScheduledSeq(seq, 1))
                budget -= 1
                continue
            num_tokens = self.chunk(seq, budget)
            while not self.block_manager.can_allocate(seq, num_tokens):
                victim = self.running.pop()
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                scheduled.append(self.take(seq, num_tokens))
                budget -= num_tokens
        # after a preemption the cache is full: admitting now would only evict again (vLLM does the same)
        if preempted and scheduled:
            return scheduled
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # fresh or preempted: K/V of a prefix may already be in the cache, computed by another request
            cached = self.block_manager.cached_prefix(seq)
            num_tokens = self.chunk(seq, budget, len(cached) * self.block_manager.block_size)
            if not self.block_manager.can_allocate(seq, num_tokens, cached):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if self.uses_slots:
                seq.state_slot = self.free_slots.pop()
            self.running.append(seq)
            scheduled.append(self.take(seq, num_tokens, cached))
            budget -= num_tokens
        return scheduled

    def chunk(self, seq: Sequence, budget: int, num_cached_tokens: int = 0) -> int:
        num_tokens = min(seq.num_uncomputed_tokens - num_cached_tokens, budget)
        if self.config.prefill_chunk_size is not None:
            num_tokens = min(num_tokens, self.config.prefill_chunk_size)
        start = seq.num_computed_tokens + num_cached_tokens
        end = start + num_tokens
        aligned = end - end % self.config.chunk_align
        # cut short chunks at a KV-tile boundary so the next chunk's queries start a tile; never stall
        if end < seq.num_tokens and start < aligned < end:
            num_tokens = aligned - start
        return num_tokens

    def take(self, seq: Sequence, num_tokens: int, cached: tuple[int, ...] = ()) -> ScheduledSeq:
        self.block_manager.allocate(seq, num_tokens, cached)
        return ScheduledSeq(seq, num_tokens)

    def preempt(self, seq: Sequence) -> None:
        # recompute: generated tokens stay in token_ids and are prefilled again with the prompt
        self.block_manager.free(seq)
        self.release_slot(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def can_decode_ahead(self) -> bool:
        """Whether the next schedule() is decode only, with no admission and no preemption, so that it may
        run while the last step's tokens are still placeholders: every running sequence decodes one token,
        nothing waits to be admitted, and the free blocks cover every sequence that needs a new one."""
        if not self.running or (self.waiting and len(self.running) < self.config.max_num_seqs):
            return False
        needing = 0  # one pass over the batch: this runs on every step
        for seq in self.running:
            if seq.num_uncomputed_tokens != 1:
                return False
            needing += not self.block_manager.holds_next_slot(seq)
        return needing <= self.block_manager.num_free_blocks

    def postprocess(self, scheduled: list[ScheduledSeq], sampled: dict[int, tuple[int, float]]) -> list[Sequence]:
        """A step whose sampled tokens are on the host already: advance, then complete."""
        self.advance(scheduled)
        return self.complete(scheduled, sampled)

    def advance(self, scheduled: list[ScheduledSeq]) -> None:
        """The step is launched: its tokens count as computed, and each sampling sequence appends a
        placeholder for the token it samples (complete() writes it), so the next decode step can be
        scheduled before this one's tokens reach the host. A sequence at its length limit leaves
        `running` now (it may not take another step) and finishes in complete()."""
        for s in scheduled:
            seq = s.seq
            if seq.is_finished:  # aborted between schedule and advance
                continue
            seq.num_computed_tokens += s.num_tokens
            self.block_manager.cache_full_blocks(seq, s.start)  # queued before any step that reads them
            if s.samples:
                seq.append_token(PLACEHOLDER, float("nan"))
                if self.at_length_limit(seq):
                    self.running.remove(seq)
                    self.draining.append(seq)
                    self.release_slot(seq)  # it computes nothing more

    def complete(self, scheduled: list[ScheduledSeq], sampled: dict[int, tuple[int, float]]) -> list[Sequence]:
        """Write the step's sampled tokens over their placeholders; finish the sequences that stop."""
        finished = []
        for s in scheduled:
            seq = s.seq
            if not s.samples or seq.is_finished:
                continue
            if seq.request_id not in sampled:
                raise KeyError(f"no sampled token for request {seq.request_id}, whose chunk reached its last token: "
                               "sample one token for every ScheduledSeq with samples=True")
            seq.set_last_token(*sampled[seq.request_id])
            reason = self.stop_reason(seq)
            if reason is not None:
                (self.draining if seq in self.draining else self.running).remove(seq)
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def at_length_limit(self, seq: Sequence) -> bool:
        return seq.num_completion_tokens >= seq.params.max_tokens or seq.num_tokens >= self.config.max_model_len

    def stop_reason(self, seq: Sequence) -> str | None:
        token_id = seq.last_token_id
        if not seq.params.ignore_eos and token_id in seq.eos_token_ids:
            return "stop"
        if token_id in seq.params.stop_token_ids:
            return "stop"
        if self.at_length_limit(seq):
            return "length"
        return None

    def abort(self, request_id: int, error: str | None = None) -> None:
        seq = self.live.get(request_id)
        if seq is None:  # already finished or never added: aborting races with finishing
            return
        queue = self.waiting if seq.status is SequenceStatus.WAITING else \
            self.draining if seq in self.draining else self.running
        queue.remove(seq)
        seq.error = error
        self.finish(seq, "abort" if error is None else "error")

    def release_slot(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None

    def finish(self, seq: Sequence, reason: str) -> None:
        self.block_manager.free(seq)
        self.release_slot(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.live[seq.request_id]
