"""ForwardBatch: what one forward pass sees, the same for the engine and the trainer.

Tokens of all sequences are flattened; each sequence brings its new tokens, the position of the
first one, and its block table in the paged KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onepath.ops.attention import AttentionMetadata
from onepath.ops.host import to_device


@dataclass(slots=True)
class SeqChunk:
    token_ids: list[int]     # the tokens computed in this pass
    start: int               # position of token_ids[0]
    block_table: list[int]
    state_slot: int | None = None  # a hybrid model's recurrent state slot (models/state_cache.py)


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    attn: AttentionMetadata
    # each sequence's recurrent state slot (hybrid models; a device tensor in a captured decode step); None: 0, 1, ...
    state_slots: list[int] | torch.Tensor | None = None

    @property
    def positions(self) -> torch.Tensor:
        return self.attn.positions

    @classmethod
    def build(cls, chunks: list[SeqChunk], block_size: int, device: str | torch.device = "cpu") -> "ForwardBatch":
        ids, positions, query_seq, slots, cu, ctx = [], [], [], [], [0], []
        for b, c in enumerate(chunks):
            n = len(c.token_ids)
            end = c.start + n
            if -(-end // block_size) > len(c.block_table):
                raise ValueError(f"sequence {b} needs {-(-end // block_size)} KV blocks, its table has {len(c.block_table)}")
            ids += c.token_ids
            positions += range(c.start, end)
            query_seq += [b] * n
            slots += [c.block_table[p // block_size] * block_size + p % block_size for p in range(c.start, end)]
            cu.append(cu[-1] + n)
            ctx.append(end)
        width = max((len(c.block_table) for c in chunks), default=1) or 1
        tables = torch.zeros((len(chunks), width), dtype=torch.long)
        for b, c in enumerate(chunks):
            tables[b, :len(c.block_table)] = torch.tensor(c.block_table, dtype=torch.long)
        as_tensor = lambda values: to_device(values, torch.long, device)
        attn = AttentionMetadata(positions=as_tensor(positions), query_seq=as_tensor(query_seq), cu_seqlens=cu,
                                 context_lens=ctx, block_tables=as_tensor(tables),
                                 slot_mapping=as_tensor(slots), block_size=block_size)
        slots = [c.state_slot for c in chunks]
        return cls(as_tensor(ids), attn, None if None in slots else slots)

    @classmethod
    def for_sequences(cls, sequences: list[list[int]], block_size: int,
                      device: str | torch.device = "cpu") -> tuple["ForwardBatch", int]:
        """Whole sequences from position 0 over a private cache (the trainer's forward).
        Returns the batch and the number of cache blocks it needs."""
        chunks, next_block = [], 0
        for tokens in sequences:
            n_blocks = -(-len(tokens) // block_size)
            chunks.append(SeqChunk(list(tokens), 0, list(range(next_block, next_block + n_blocks))))
            next_block += n_blocks
        return cls.build(chunks, block_size, device), next_block

    @classmethod
    def for_completions(cls, prompts: list[list[int]], completions: list[list[int]],
                        block_size: int, device: str | torch.device = "cpu") -> tuple["ForwardBatch", int, list[int]]:
        """Each prompt + completion[:-1] from position 0 (the last token is sampled, never fed), and the
        rows whose hidden states predict each completion token, in order."""
        batch, num_blocks = cls.for_sequences([p + c[:-1] for p, c in zip(prompts, completions)], block_size, device)
        rows = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            first = batch.attn.cu_seqlens[i] + len(p) - 1
            rows += range(first, first + len(c))
        return batch, num_blocks, rows
