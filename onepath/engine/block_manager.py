"""BlockManager: paged KV-cache bookkeeping. Fixed-size blocks with reference counts, a free list,
one block table per sequence, and an automatic prefix cache over full blocks.

Prefix cache (as in vLLM / nano-vllm): a full block whose K/V are written is registered under the
hash of (its parent block's hash, its token ids), so the hash names the whole token prefix up to
the block's end. A new sequence shares the longest run of registered blocks matching its prefix
(reference count + 1) and starts computing after them. A block whose count drops to 0 joins the
free list but keeps its hash until a new allocation takes it (least recently freed first).
Only full blocks are shared and a sequence writes only at positions >= num_computed_tokens, past
its shared blocks, so a shared block is never written: no copy-on-write.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from onepath.engine.sequence import Sequence


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    # hashlib, not hash(): the same prefix must get the same key in every process
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks {num_blocks} must be >= 1: give the KV cache more memory")
        if block_size < 1:
            raise ValueError(f"block_size {block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # a FIFO free list: the same requests in the same order get the same block ids; freed cached
        # blocks go to the end, so allocation evicts the least recently freed first
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.hash_to_block_id: dict[bytes, int] = {}
        self.num_cached_tokens_hit = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: unreferenced, cached (evictable) or not."""
        return len(self.free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block_id)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: tuple[int, ...] = ()) -> int:
        total = self.num_blocks_for(seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens)
        return max(0, total - len(seq.block_table) - len(cached))

    def holds_next_slot(self, seq: Sequence) -> bool:
        """Whether the slot of seq's next computed token is in a block seq holds (a decode token then
        needs no allocation: most steps of most sequences)."""
        return seq.num_computed_tokens < len(seq.block_table) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: tuple[int, ...] = ()) -> bool:
        # sharing a cached block that is free takes it off the free list too
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)
        return self.blocks_needed(seq, num_new_tokens, cached) + revived <= len(self.free_block_ids)

    def cached_prefix(self, seq: Sequence) -> tuple[int, ...]:
        """Block ids of the longest run of cached full blocks matching the start of a sequence that
        holds no blocks. The last token is never covered: the model must run on it to sample."""
        if not self.enable_prefix_caching or seq.block_table:
            return ()
        blocks = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.hash_to_block_id.get(self.block_hash(seq, i))
            if block_id is None:
                break
            blocks.append(block_id)
        return tuple(blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: tuple[int, ...] = ()) -> None:
        """Give seq blocks for num_new_tokens more tokens. `cached` (from cached_prefix, for a sequence
        holding no blocks) is shared first and counts as computed."""
        if cached and (seq.block_table or seq.num_computed_tokens):
            raise RuntimeError(f"request {seq.request_id} already holds {len(seq.block_table)} blocks: only a "
                               "sequence without blocks can share cached ones")
        needed = self.blocks_needed(seq, num_new_tokens, cached)
        if not needed and not cached:
            return  # a decode token inside the last block: most steps of most sequences
        if not self.can_allocate(seq, num_new_tokens, cached):
            raise RuntimeError(f"request {seq.request_id} needs {needed} more KV blocks for {num_new_tokens} new "
                               f"tokens but {len(self.free_block_ids)} are free: check can_allocate first")
        if cached:
            for block_id in cached:
                if self.ref_counts[block_id] == 0:
                    del self.free_block_ids[block_id]
                    self.used_block_ids.add(block_id)
                self.ref_counts[block_id] += 1
            seq.block_table.extend(cached)
            seq.num_computed_tokens = len(cached) * self.block_size
            self.num_cached_tokens_hit += seq.num_computed_tokens
        for _ in range(needed):
            block_id, _ = self.free_block_ids.popitem(last=False)
            self.evict(block_id)
            self.ref_counts[block_id] = 1
            self.used_block_ids.add(block_id)
            seq.block_table.append(block_id)

    def evict(self, block_id: int) -> None:
        h = self.block_hashes[block_id]
        if h is not None:
            self.block_hashes[block_id] = None
            del self.hash_to_block_id[h]

    def cache_full_blocks(self, seq: Sequence, start: int) -> None:
        """Register the blocks that became full while seq's computed tokens grew from start to
        num_computed_tokens. Call only once their K/V are written."""
        if not self.enable_prefix_caching:
            return
        for i in range(start // self.block_size, seq.num_computed_tokens // self.block_size):
            h = self.block_hash(seq, i)
            block_id = seq.block_table[i]
            # a twin computed in the same step keeps the first registration; this block stays private
            if h not in self.hash_to_block_id:
                self.block_hashes[block_id] = h
                self.hash_to_block_id[h] = block_id

    def block_hash(self, seq: Sequence, i: int) -> bytes:
        # memoised on the sequence: tokens are only appended, so a full block's hash never changes
        bs = self.block_size
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if j else b""
            seq.block_hashes.append(hash_block(parent, seq.token_ids[j * bs:(j + 1) * bs]))
        return seq.block_hashes[i]

    def free(self, seq: Sequence) -> None:
        # tail blocks go back first, as in vLLM: the prefix cache evicts a sequence's tail before its head
        for block_id in reversed(seq.block_table):
            if self.ref_counts[block_id] < 1:
                raise KeyError(f"block {block_id} of request {seq.request_id} is already free: a double free")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids[block_id] = None
        seq.block_table.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (their K/V belong to the old weights after a weight update)."""
        if self.enable_prefix_caching and self.used_block_ids:
            raise RuntimeError(f"cannot reset the prefix cache while {len(self.used_block_ids)} KV blocks are held "
                               "by running requests (their K/V would mix old and new weights): finish or abort "
                               "them first")
        for block_id in self.hash_to_block_id.values():
            self.block_hashes[block_id] = None
        self.hash_to_block_id.clear()

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
