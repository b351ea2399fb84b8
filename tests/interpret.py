"""Runs a test file's Triton kernel checks in a subprocess under TRITON_INTERPRET=1 (it must be set
before triton is imported) and returns the JSON they print on the last line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def interpreted_results(script: str, what: str) -> dict:
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, script], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreted {what} checks crashed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Hopper's opt-in shared memory per block (227 KiB); a config over it fails at launch on the H200.
SM90_SHARED_BYTES = 232448


def compile_sm90(kernel, sig: dict, consts: dict, aligned, config):
    """`kernel` compiled for sm_90 by the Triton wheel's own ptxas (no GPU needed): (ptx, shared bytes).
    sig: argument -> Triton type; consts: constexpr argument -> value; aligned: arguments divisible by 16;
    config: the TileConfig (warps, stages). Skips where the NVIDIA backend is missing or the kernels are
    interpreted."""
    pytest.importorskip("triton.backends.nvidia")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernel is an interpreted function, not compilable")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {**sig, **{n: "constexpr" for n in consts}}
    src = ASTSource(kernel, {n: sig[n] for n in names}, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    return compiled.asm["ptx"], compiled.metadata.shared
