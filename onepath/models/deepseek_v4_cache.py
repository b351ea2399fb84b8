"""DeepSeek-V4's paged cache and where a forward finds each row in it.

Every tensor is paged by token slot with the block tables the engine already keeps ([blocks, block_size, 1,
row]), so a sequence needs no second allocation and the prefix cache can share its blocks:

    kv             every token's K = V row (the sliding window reads the last `sliding_window` of them)
    entries        compressed entry w of a CSA / HCA layer, at the slot of its window's last token (w+1)m - 1
    state          each token's compressor input (kv_proj | gate_proj), read when a window closes
    index_entries  the lightning indexer's compressed keys (CSA), at the same slots as entries
    index_state    the indexer compressor's input (CSA)

kv, entries and index_entries are FP8 when the spec quantises the KV cache (attention.kv, one scale per
row); the states stay in the model's dtype. A forward writes its tokens' rows, then every window that
closes in it is pooled from rows read back through the cache, then every query reads its window and its
compressed entries through the cache: the same reads, and so the same bits, whether a row was written in
this forward or an earlier one (prefill, chunked prefill, decode, the trainer's private cache).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onepath.models.deepseek_v4_config import CSA, SLIDING, DeepseekV4Config
from onepath.numerics.quant import FP8Tensor
from onepath.numerics.spec import QuantSpec
from onepath.ops.attention import AttentionMetadata
from onepath.ops.host import to_device

SCALE_BYTES = 4  # an FP8 row's one FP32 scale


@dataclass(slots=True)
class LayerCache:
    kv: torch.Tensor | FP8Tensor
    entries: torch.Tensor | FP8Tensor | None = None
    state: torch.Tensor | None = None
    index_entries: torch.Tensor | FP8Tensor | None = None
    index_state: torch.Tensor | None = None


def row_widths(config: DeepseekV4Config, layer: int) -> dict[str, int]:
    """The width of each of layer `layer`'s cache tensors (their names as LayerCache's)."""
    kind, d, di = config.layer_types[layer], config.head_dim, config.index_head_dim
    if kind == SLIDING:
        return {"kv": d}
    widths = {"kv": d, "entries": d, "state": 2 * (2 if kind == CSA else 1) * d}
    if kind == CSA:
        widths.update(index_entries=di, index_state=4 * di)
    return widths


QUANTISABLE = ("kv", "entries", "index_entries")


class DeepseekV4Cache:
    def __init__(self, config: DeepseekV4Config, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", kv: QuantSpec | None = None):
        def paged(width: int, quantised: bool):
            shape = (num_blocks, block_size, 1, width)
            # zeros, not empty: unread slots are masked, but 0 * NaN would still poison a masked sum
            if not quantised:
                return torch.zeros(shape, dtype=dtype, device=device)
            return FP8Tensor(torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
                             torch.zeros(*shape[:-1], 1, dtype=torch.float32, device=device), (1, width), kv)

        self.layers = [LayerCache(**{name: paged(width, kv is not None and name in QUANTISABLE)
                                     for name, width in row_widths(config, i).items()})
                       for i in range(config.num_hidden_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_token(config: DeepseekV4Config, dtype: torch.dtype, kv: QuantSpec | None = None) -> int:
        """Every layer's rows of one token slot, scales included."""
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        for i in range(config.num_hidden_layers):
            for name, width in row_widths(config, i).items():
                total += width + SCALE_BYTES if kv is not None and name in QUANTISABLE else width * size
        return total


class Locator:
    """Where a forward finds a position of a token's own sequence: its cache slot (block table) and, when the
    token that holds it is in this forward, its row (for the gradient). Built once per forward; its derived
    index tensors are kept for the layers that share them."""

    def __init__(self, meta: AttentionMetadata):
        self.meta = meta
        device = meta.positions.device
        starts = [ctx - meta.query_len(b) for b, ctx in enumerate(meta.context_lens)]
        self.first_row = to_device(meta.cu_seqlens[:-1], torch.long, device)[meta.query_seq]
        self.first_pos = to_device(starts, torch.long, device)[meta.query_seq]
        self.starts = starts
        self.derived: dict = {}

    def locate(self, rows: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor):
        """For tokens `rows` [R] and positions [R, L] of their sequences (valid [R, L]): the slots [R, L] and
        this forward's rows [R, L], -1 where invalid (rows: also where the position is an earlier forward's)."""
        meta, bs = self.meta, self.meta.block_size
        tables = meta.block_tables[meta.query_seq[rows]]
        p = positions.clamp(min=0)
        blocks = tables.gather(1, (p // bs).clamp(max=tables.shape[1] - 1))
        slots = torch.where(valid, blocks * bs + p % bs, -1)
        here = valid & (positions >= self.first_pos[rows, None])
        fresh = torch.where(here, self.first_row[rows, None] + positions - self.first_pos[rows, None], -1)
        return slots, fresh

    def closing(self, rate: int) -> torch.Tensor:
        """The rows of this forward whose token closes a window of `rate` tokens ((position + 1) % rate == 0),
        found from the host's metadata (no device sync)."""
        key = ("closing", rate)
        if key not in self.derived:
            meta, rows = self.meta, []
            for b, start in enumerate(self.starts):
                first = -(-(start + 1) // rate) * rate - 1
                rows += [meta.cu_seqlens[b] + p - start for p in range(first, meta.context_lens[b], rate)]
            self.derived[key] = to_device(rows, torch.long, meta.positions.device)
        return self.derived[key]

    def cached(self, key, make):
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]
