"""BlockManager: paged KV-cache bookkeeping. Fixed-size blocks, a free list, one block table per sequence."""
from __future__ import annotations

from collections import deque

from onepath.engine.sequence import Sequence


class BlockManager:

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks {num_blocks} must be >= 1: give the KV cache more memory")
        if block_size < 1:
            raise ValueError(f"block_size {block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # a FIFO free list: the same requests in the same order get the same block ids
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self.free_block_ids):
            raise RuntimeError(f"request {seq.request_id} needs {needed} more KV blocks for {num_new_tokens} new tokens "
                               f"but {len(self.free_block_ids)} are free: check can_allocate first")
        for _ in range(needed):
            block_id = self.free_block_ids.popleft()
            self.used_block_ids.add(block_id)
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        # tail blocks go back first, as in vLLM: a later prefix cache evicts a sequence's tail before its head
        for block_id in reversed(seq.block_table):
            self.used_block_ids.remove(block_id)
            self.free_block_ids.append(block_id)
        seq.block_table.clear()

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
