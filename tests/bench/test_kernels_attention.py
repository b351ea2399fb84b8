"""bench/kernels_attention.py's variant settings: what --variants accepts and refuses (the timing is GPU-only)."""
import pytest

from onepath.bench.kernels_attention import parse_variant


def test_variants_map_to_paged_attention_keywords():
    assert parse_variant("default") == ("default", {})
    assert parse_variant("q_rows=16,num_warps=1,kv_tile=64") == (
        "q_rows=16,num_warps=1,kv_tile=64", {"block_m": 16, "num_warps": 1, "kv_tile": 64})
    assert parse_variant("decode_program=0")[1] == {"decode_program": False}
    assert parse_variant("table_asm=0,num_stages=3")[1] == {"table_asm": False, "num_stages": 3}


@pytest.mark.parametrize("text", ["rows=16", "q_rows=sixteen", "q_rows", "kv_tile=64,warps=2"])
def test_a_bad_variant_names_the_item_and_the_accepted_names(text):
    with pytest.raises(SystemExit, match="is not NAME=INT with NAME one of q_rows, kv_tile"):
        parse_variant(text)
