"""bench/kernels_fp8.py's --ws-variant names (the timing is GPU-only); bench/gemm_power.py and bench/ncu_gemm.py
without a GPU."""
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kernels_fp8 import _geomean, named_variants
from onepath.ops.cuda.linear_fp8 import WS_CONFIG

ROOT = Path(__file__).resolve().parents[2]


def test_variant_names_map_to_the_bench_configs_in_order():
    configs = named_variants([str(WS_CONFIG), "ws128x256s4+persistent"])
    assert configs[0] == WS_CONFIG
    assert (configs[1].block_n, configs[1].num_stages, configs[1].wait1) == (256, 4, False)


def test_an_unknown_variant_is_named_with_the_known_ones():
    with pytest.raises(SystemExit, match=r"\['ws128x256s9'\]: not among .*ws128x128s5\+persistent\+wait1"):
        named_variants(["ws128x256s4+persistent", "ws128x256s9"])


def test_geomean():
    assert _geomean([]) is None
    assert _geomean([2.0, 8.0]) == pytest.approx(4.0)


@pytest.mark.parametrize("script", ["bench/gemm_power.py", "bench/ncu_gemm.py"])
def test_gemm_benches_without_cuda_say_so_and_exit_0(script):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the bench would run")
    run = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "no CUDA device" in run.stdout, run.stdout + run.stderr
