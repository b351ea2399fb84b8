"""onepath/bench/kernels_fp8.py's --ws-variant names (the timing is GPU-only)."""
import pytest

from onepath.bench.kernels_fp8 import geomean, named_variants
from onepath.ops.cuda.linear_fp8 import WS_CONFIG


def test_variant_names_map_to_the_bench_configs_in_order():
    configs = named_variants([str(WS_CONFIG), "ws128x256s4+persistent"])
    assert configs[0] == WS_CONFIG
    assert (configs[1].block_n, configs[1].num_stages, configs[1].wait1) == (256, 4, False)


def test_an_unknown_variant_is_named_with_the_known_ones():
    with pytest.raises(SystemExit, match=r"\['ws128x256s9'\]: not a variant .*ws128x128s5\+persistent\+wait1"):
        named_variants(["ws128x256s4+persistent", "ws128x256s9"])


def test_geomean():
    assert geomean([]) is None
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
