"""DeepSeek-V4's cache and where a forward finds each row in it.

Two kinds of storage, per layer:

    kv             ring: the last `sliding_window` K = V rows of each running sequence (what its window reads)
    state          ring: the compressor inputs (kv_proj | gate_proj) of the windows still open: 2m rows (CSA: an
                   entry pools the previous window too) or m (HCA)
    index_state    ring: the indexer compressor's inputs (CSA), 2m rows
    entries        pages: compressed entry w of a CSA / HCA layer, in the token block of its closing position
                   (w+1)m - 1, ceil(block_size / m) rows a block
    index_entries  pages: the lightning indexer's compressed keys (CSA), as entries

The rings sit in the engine's state slots (one per running sequence, models/state_cache.py's slots); the pages
use the engine's block tables, so a sequence's blocks hold its entries and nothing else: the bytes a token costs
are the entries it closes (block_size / m of a block's rows), and a sequence's window and open windows cost a
fixed ring. kv, entries and index_entries are FP8 when the spec quantises the KV cache (attention.kv, one scale
per row); index_entries are FP8 by the indexer's own rule when it scores in FP8 (indexer.kv, the fp8_indexer
preset: e4m3 codes and a power-of-two FP32 scale per row, read as stored); the states stay in the model's dtype.

A forward stages its own rows (ops.cache_stage: the rows as the cache would store them, FP8 round trip included),
reads every row it needs through ops.cache_read (this forward's positions from the stage, earlier ones from the
ring, entries from the pages), and then copies each sequence's last rows into its ring. A position reads the
same bits from the stage as from the ring or the pages, so prefill, chunked prefill, decode and the trainer
(whole sequences, no ring) compute on the same bits. The engine gives every running sequence a slot (as a
hybrid's), so prefix caching is off for this model: a cached prefix would lack the rings after it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onepath.models.deepseek_v4_config import CSA, SLIDING, DeepseekV4Config
from onepath.models.kv_cache import BLOCK_SIZE
from onepath.numerics.quant import FP8Tensor
from onepath.numerics.spec import QuantSpec
from onepath.ops.attention import AttentionMetadata
from onepath.ops.cache_rows import paged
from onepath.ops.host import to_device

SCALE_BYTES = 4  # an FP8 row's one FP32 scale
QUANTISABLE = ("kv", "entries", "index_entries")
PAGED = ("entries", "index_entries")


@dataclass(slots=True)
class LayerCache:
    kv: torch.Tensor | FP8Tensor | None = None
    entries: torch.Tensor | FP8Tensor | None = None
    state: torch.Tensor | None = None
    index_entries: torch.Tensor | FP8Tensor | None = None
    index_state: torch.Tensor | None = None


def rows_per_block(rate: int, block_size: int) -> int:
    """Entry rows a token block holds: one per closing position in it, ceil(block_size / rate)."""
    return -(-block_size // rate)


def layout(config: DeepseekV4Config, layer: int) -> dict[str, tuple[int, int]]:
    """Each of layer `layer`'s tensors (LayerCache's names): (width, rows): the ring's rows per slot, or for the
    pages the compress rate whose entries they hold."""
    kind, d, di = config.layer_types[layer], config.head_dim, config.index_head_dim
    if kind == SLIDING:
        return {"kv": (d, config.sliding_window)}
    m = config.compress_rates[kind]
    out = {"kv": (d, config.sliding_window), "entries": (d, m)}
    if kind == CSA:
        out.update(state=(4 * d, 2 * m), index_entries=(di, m), index_state=(4 * di, 2 * m))
    else:
        out.update(state=(2 * d, m))
    return out


def rule(name: str, kv: QuantSpec | None, index_kv: QuantSpec | None) -> QuantSpec | None:
    """The rule tensor `name` is stored by: the indexer's keys by index_kv where set (the indexer scores in FP8),
    the other quantisable tensors by kv."""
    if name == "index_entries" and index_kv is not None:
        return index_kv
    return kv if name in QUANTISABLE else None


class DeepseekV4Cache:
    def __init__(self, config: DeepseekV4Config, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", kv: QuantSpec | None = None, num_slots: int = 0,
                 index_kv: QuantSpec | None = None):
        """num_slots: the running sequences' rings (the engine's state slots); 0 for a forward of whole sequences
        (the trainer's), which reads its own rows only. One block of pages (`scratch_block`) and one ring slot
        (`scratch_slot`) past those take the writes a decode step makes for rows that close no window and for
        padding rows: a decode step writes every row, its shapes fixed by the batch. kv: the spec's attention.kv;
        index_kv: its indexer.kv."""
        def tensor(name, width, rows):
            quant = rule(name, kv, index_kv)
            if name in PAGED:
                return paged(num_blocks + 1, rows_per_block(rows, block_size), width, dtype, quant, device)
            return paged(num_slots + 1, rows, width, dtype, quant, device) if num_slots else None

        self.layers = [LayerCache(**{name: tensor(name, *shape) for name, shape in layout(config, i).items()})
                       for i in range(config.num_hidden_layers)]
        self.num_blocks, self.block_size, self.num_slots = num_blocks, block_size, num_slots
        self.scratch_block, self.scratch_slot = num_blocks, num_slots if num_slots else None

    @staticmethod
    def row_bytes(name: str, width: int, dtype: torch.dtype, kv: QuantSpec | None,
                  index_kv: QuantSpec | None = None) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return width + SCALE_BYTES if rule(name, kv, index_kv) is not None else width * size

    @classmethod
    def bytes_per_token(cls, config: DeepseekV4Config, dtype: torch.dtype, kv: QuantSpec | None = None,
                        block_size: int = BLOCK_SIZE, index_kv: QuantSpec | None = None) -> float:
        """The pages' bytes of one token (a block's entry rows over its tokens), scales included."""
        total = 0
        for i in range(config.num_hidden_layers):
            for name, (width, rate) in layout(config, i).items():
                if name in PAGED:
                    total += rows_per_block(rate, block_size) * cls.row_bytes(name, width, dtype, kv, index_kv)
        return total / block_size

    @classmethod
    def bytes_per_slot(cls, config: DeepseekV4Config, dtype: torch.dtype, kv: QuantSpec | None = None,
                       index_kv: QuantSpec | None = None) -> int:
        """One running sequence's rings over all layers: its window's K = V rows and its open windows' inputs (the
        cache holds one slot more, the scratch slot)."""
        return sum(rows * cls.row_bytes(name, width, dtype, kv, index_kv) for i in range(config.num_hidden_layers)
                   for name, (width, rows) in layout(config, i).items() if name not in PAGED)


class Locator:
    """Where a forward finds a position of a token's own sequence: its row in this forward (the stage, and the
    gradient's target), else its slot in the sequence's ring; an entry's slot in the pages. Built once per forward;
    its derived index tensors are kept for the layers that share them. A prefill or a chunk finds its rows from the
    host's batch metadata (no device sync); a decode step (one query per sequence) from the device's positions and
    state slots alone, every row computed and written whatever it closes, so its shapes follow the batch size and a
    CUDA graph can hold it."""

    def __init__(self, meta: AttentionMetadata, state_slots: list[int] | torch.Tensor | None = None,
                 scratch_block: int = 0):
        self.meta, self.scratch_block = meta, scratch_block
        device = meta.positions.device
        starts = [ctx - meta.query_len(b) for b, ctx in enumerate(meta.context_lens)]
        if state_slots is None and any(starts):
            first = next(b for b, s in enumerate(starts) if s)
            raise ValueError(f"sequence {first} starts at position {starts[first]} without a state slot: a "
                             "DeepSeek-V4 forward over a cached prefix reads its window and open windows from the "
                             "sequence's rings; give each sequence a slot (SeqChunk.state_slot, the engine does) or "
                             "run whole sequences from position 0")
        self.decode = all(meta.query_len(b) == 1 for b in range(meta.num_seqs))  # one query per sequence
        if self.decode:
            self.first_row = torch.arange(meta.positions.shape[0], device=device)
            self.first_pos = meta.positions
        else:
            self.first_row = to_device(meta.cu_seqlens[:-1], torch.long, device)[meta.query_seq]
            self.first_pos = to_device(starts, torch.long, device)[meta.query_seq]
        if state_slots is not None and not isinstance(state_slots, torch.Tensor):
            state_slots = to_device(state_slots, torch.long, device)
        self.ring_of = None if state_slots is None else state_slots[meta.query_seq]
        self.starts = starts
        self.derived: dict = {}

    def fresh(self, rows: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """This forward's rows [R, L] holding positions [R, L] of tokens `rows`' sequences, -1 where invalid or
        before this forward."""
        here = valid & (positions >= self.first_pos[rows, None])
        return torch.where(here, self.first_row[rows, None] + positions - self.first_pos[rows, None], -1)

    def ring(self, rows: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, size: int):
        """(ring slots, this forward's rows) [R, L] of positions [R, L] (valid [R, L]) of tokens `rows`' sequences
        in rings of `size` rows a slot: each position from exactly one of them, -1 in the other (both where
        invalid)."""
        fresh = self.fresh(rows, positions, valid)
        if self.ring_of is None:
            return torch.full_like(fresh, -1), fresh
        slots = self.ring_of[rows, None] * size + positions.clamp(min=0) % size
        return torch.where(valid & (fresh < 0), slots, -1), fresh

    def ring_writes(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ring slots, this forward's rows) [N]: each sequence's last `size` positions (those of this forward),
        to copy into its ring after the reads; none without state slots."""
        key = ("ring_writes", size)
        if key in self.derived:
            return self.derived[key]
        meta, device = self.meta, self.meta.positions.device
        if self.decode and self.ring_of is not None:
            self.derived[key] = (self.ring_of * size + meta.positions % size, self.first_row)
            return self.derived[key]
        slots, rows = [], []
        for b, start in enumerate(self.starts):
            if self.ring_of is None:
                break
            end = meta.context_lens[b]
            for p in range(max(start, end - size), end):
                slots.append(p % size)
                rows.append(meta.cu_seqlens[b] + p - start)
        rows = to_device(rows, torch.long, device)
        offsets = to_device(slots, torch.long, device)
        self.derived[key] = (offsets if self.ring_of is None else self.ring_of[rows] * size + offsets, rows)
        return self.derived[key]

    def entries(self, rows: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, rate: int):
        """(page slots, this forward's rows) [R, L] of entries `index` [R, L] (valid [R, L]) of tokens `rows`'
        sequences: entry w sits in the block of its closing position c = (w + 1) rate - 1, row (c % bs) // rate;
        its row here is c's when c is in this forward."""
        meta, bs = self.meta, self.meta.block_size
        closing = (index.clamp(min=0) + 1) * rate - 1
        tables = meta.block_tables[meta.query_seq[rows]]
        blocks = tables.gather(1, (closing // bs).clamp(max=tables.shape[1] - 1))
        slots = torch.where(valid, blocks * rows_per_block(rate, bs) + closing % bs // rate, -1)
        return slots, self.fresh(rows, closing, valid)

    def closing(self, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, closes): the rows of this forward whose token closes a window of `rate` tokens ((position + 1) %
        rate == 0), closes all True: found from the host's metadata (no device sync); in a decode step every row,
        closes on the device."""
        key = ("closing", rate)
        if key not in self.derived:
            meta, rows = self.meta, []
            if self.decode:
                self.derived[key] = (self.first_row, (meta.positions + 1) % rate == 0)
                return self.derived[key]
            for b, start in enumerate(self.starts):
                first = -(-(start + 1) // rate) * rate - 1
                rows += [meta.cu_seqlens[b] + p - start for p in range(first, meta.context_lens[b], rate)]
            rows = to_device(rows, torch.long, meta.positions.device)
            self.derived[key] = (rows, torch.ones_like(rows, dtype=torch.bool))
        return self.derived[key]

    def entry_writes(self, rows: torch.Tensor, closes: torch.Tensor, rate: int) -> torch.Tensor:
        """Page slots [R] for the entries rows [R] compute: each closing row's own entry, the scratch block's
        first row for the others (a decode step's rows that close nothing)."""
        index = (self.meta.positions[rows] + 1) // rate - 1
        slots, _ = self.entries(rows, index[:, None], closes[:, None], rate)
        return torch.where(closes, slots[:, 0], self.scratch_block * rows_per_block(rate, self.meta.block_size))

    def cached(self, key, make):
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]
