"""DeepSeek-V4's cache layout: the pages hold only compressed entries (ceil(block_size / m) rows a block), the rings
a running sequence's window and open compressor windows; what the byte counts say is what is allocated; a
DeepSeek-V4-Flash-shaped model's FP8 K = V bytes per token are at most 0.57 of BF16 (the recipe's figure); a forward
over a cached prefix without rings is refused by name."""
import pytest
import torch

from onepath.bench.deepseek_v4 import cache_bytes, flash_config
from onepath.models.batch import ForwardBatch, SeqChunk
from onepath.models.deepseek_v4_cache import DeepseekV4Cache, rows_per_block
from onepath.numerics.quant import FP8Tensor
from onepath.numerics.spec import FP8_INDEX, FP8_KV
from tests.tiny_deepseek_v4 import onepath_model, sequences, transformers_model


def allocated(cache: DeepseekV4Cache) -> int:
    tensors = [t for layer in cache.layers for t in (layer.kv, layer.entries, layer.state, layer.index_entries,
                                                     layer.index_state) if t is not None]
    parts = [p for t in tensors for p in ((t.codes, t.scales) if isinstance(t, FP8Tensor) else (t,))]
    return sum(p.numel() * p.element_size() for p in parts)


@pytest.mark.parametrize("kv, index_kv", [(None, None), (FP8_KV, None), (None, FP8_INDEX), (FP8_KV, FP8_INDEX)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_byte_counts_are_what_the_cache_allocates(kv, index_kv, block_size):
    config = flash_config(num_hidden_layers=4, compress_rates={"compressed_sparse_attention": 4,
                                                               "heavily_compressed_attention": 8})
    blocks, slots = 3, 2
    cache = DeepseekV4Cache(config, blocks, block_size, torch.bfloat16, kv=kv, num_slots=slots, index_kv=index_kv)
    # one scratch block of pages and one scratch ring slot past those asked for (a decode step's unused writes)
    want = (DeepseekV4Cache.bytes_per_token(config, torch.bfloat16, kv, block_size, index_kv) * block_size
            * (blocks + 1) + DeepseekV4Cache.bytes_per_slot(config, torch.bfloat16, kv, index_kv) * (slots + 1))
    assert allocated(cache) == want
    entries = cache.layers[3].entries  # a CSA layer: one row per window closing in a block
    assert (entries.codes if kv else entries).shape[:2] == (blocks + 1, rows_per_block(4, block_size))
    keys = cache.layers[3].index_entries  # the indexer's keys: by its own rule where it scores in FP8
    assert (keys.rule if isinstance(keys, FP8Tensor) else None) == (index_kv or kv)
    assert allocated(DeepseekV4Cache(config, blocks, block_size, torch.bfloat16, kv=kv, index_kv=index_kv)) < want


def test_flash_shaped_fp8_kv_bytes_per_token_are_at_most_0_57_of_bf16():
    """The K = V rows (entries in pages, the window in rings) at the bench's 3150-token context: FP8 <= 0.57 of
    BF16. The compressor inputs stay in the model's dtype (their ratio is 1), so everything together is above it
    at this context and falls towards the pages' ratio as the context grows."""
    got = cache_bytes(flash_config())
    ratio = got["fp8_over_bf16"]
    assert ratio["kv_per_token"] <= 0.57 and ratio["paged_per_token"] <= 0.57
    assert ratio["state_per_sequence"] == 1.0
    longer = cache_bytes(flash_config(), context=1 << 20)["fp8_over_bf16"]["total_per_token"]
    assert ratio["paged_per_token"] < longer < ratio["total_per_token"]
    # the pages: a CSA layer's entries and indexer keys (1/4 of a token each), an HCA layer's one row a block
    bf16 = got["bf16"]["paged_per_token"]
    assert bf16 == 20 * (512 + 128) * 2 / 4 + 23 * 512 * 2 / 16


def test_a_cached_prefix_without_rings_is_refused_by_name():
    hf = transformers_model({})
    model = onepath_model(hf)
    seq = sequences(hf.config.vocab_size, (20,))[0]
    batch = ForwardBatch.build([SeqChunk(seq[10:], 10, [0, 1])], 16)
    with pytest.raises(ValueError, match="sequence 0 starts at position 10 without a state slot"):
        model(batch, model.make_cache(2, 16))
