"""Runs a test file's Triton kernel checks in a subprocess under TRITON_INTERPRET=1 (it must be set
before triton is imported) and returns the JSON they print on the last line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onepath.ops.cuda import sm90


def interpreted_checks(script: str, what: str, checks: list[str]):
    """The pytest side of an interpreted test file: a module-scoped fixture running the file's checks
    once in the interpreter subprocess, and a test per check. Use as
    `interpreted, test_x_interpreted = interpreted_checks(__file__, "x", CHECKS)`."""
    @pytest.fixture(scope="module")
    def interpreted():
        return interpreted_results(script, what)

    @pytest.mark.parametrize("check", checks)
    def test(interpreted, check):
        assert interpreted[check]["ok"], f"{check}: {interpreted[check]['detail']}"

    return interpreted, test


def check_recorder():
    """(results, record): record(name, ok, detail) folds every outcome of a named check into results[name]
    ({"ok", "detail"}: the first failure's detail is kept), the JSON print_checks emits."""
    results = {}

    def record(name, ok, detail=""):
        prev = results.get(name, {"ok": True, "detail": ""})
        results[name] = {"ok": prev["ok"] and bool(ok), "detail": prev["detail"] or ("" if ok else detail)}

    return results, record


def print_checks(run_checks) -> None:
    """The interpreter subprocess's side (`python FILE` with TRITON_INTERPRET=1): the checks' JSON, last line."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    print(json.dumps(run_checks()))


def kernel_case_tools(gen):
    """(rand, close, embedded) for a kernel's checks, drawing from `gen`: rand(*shape, dtype, scale) a random
    tensor; close(a, b, **tol) -> (ok, why) by torch.testing.assert_close; embedded(probe, m, make) a random
    batch of m rows (from make(n)) with probe's rows at a random position -> (batch, position)."""
    import torch

    def rand(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def close(a, b, **tol):
        try:
            torch.testing.assert_close(a, b, **tol)
            return True, ""
        except AssertionError as e:
            return False, str(e).splitlines()[-1]

    def embedded(probe, m, make):
        batch = make(m + probe.shape[0] - 1)
        pos = int(torch.randint(m, (1,), generator=gen))
        batch[pos:pos + probe.shape[0]] = probe
        return batch, pos

    return rand, close, embedded


def patch_libdevice_log1p():
    """The interpreter has no libdevice: give the sampler's log1p numpy's (the GPU's is libdevice's)."""
    import types

    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    from onepath.ops.cuda import sampling

    def log1p(x):
        return tl.tensor(TensorHandle(np.log1p(x.handle.data), x.handle.dtype.scalar), x.type)

    sampling.libdevice = types.SimpleNamespace(log1p=log1p)


def patch_fp8_rounding():
    """Install torch's round-to-nearest-even FP32 -> float8e4nv conversion in the interpreter (Triton 3.6's rounds
    half up, Hopper's cvt.rn.satfinite to nearest even); returns the interpreter's own, for a negative control."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def convert_rne(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.float8e4nv:
            wide = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return wide.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(np.shape(data))
        return convert(data, src, dst, rounding_mode)

    interpreter._convert_float = convert_rne
    return convert


def same_fp8(a, b) -> bool:
    """Two FP8Tensors with the same codes and scales, bit for bit."""
    import torch
    return (a.codes.shape == b.codes.shape and a.scales.shape == b.scales.shape
            and torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
            and torch.equal(a.scales.view(torch.int32), b.scales.view(torch.int32)))


def fp8_spread(gen, *shape, dtype=None):
    """randn with one power-of-two magnitude per 128-group: the groups' scales far apart."""
    import torch
    k = shape[-1]
    mag = torch.randint(-30, 30, (*shape[:-1], -(-k // 128)), generator=gen).repeat_interleave(128, -1)[..., :k]
    return (torch.randn(*shape, generator=gen) * torch.exp2(mag.float())).to(dtype or torch.float32)


def interpreted_results(script: str, what: str) -> dict:
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, script], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreted {what} checks crashed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


SM90_SHARED_BYTES = sm90.SHARED_BYTES


def compile_sm90(kernel, sig: dict, consts: dict, aligned, config):
    """`kernel` compiled for sm_90 by the Triton wheel's own ptxas (no GPU needed): (ptx, shared bytes).
    sig: argument -> Triton type; consts: constexpr argument -> value; aligned: arguments divisible by 16;
    config: the TileConfig (warps, stages). Skips where the NVIDIA backend is missing or the kernels are
    interpreted."""
    compiled = build_sm90(kernel, sig, consts, aligned, config)
    return compiled.asm["ptx"], compiled.metadata.shared


def build_sm90(kernel, sig: dict, consts: dict, aligned, config):
    """compile_sm90's build itself (onepath/ops/cuda/sm90.py), every stage's text in its .asm (ttgir, ptx, ...);
    config's enable_fp_fusion, where it has one, as its launch passes it."""
    pytest.importorskip("triton.backends.nvidia")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernel is an interpreted function, not compilable")
    return sm90.build(kernel, sig, consts, aligned, config.num_warps, config.num_stages,
                      getattr(config, "enable_fp_fusion", True))


def patch_bf16_rounding() -> None:
    """Triton 3.6's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even): round as the GPU does."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def convert_rtne(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            wide = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(np.shape(data))
        return convert(data, src, dst, rounding_mode)

    interpreter._convert_float = convert_rtne


def patch_cpu_exp():
    """Give the interpreter's tl.exp the consistent CPU path's exp (pinned_unary(torch.exp)) on FP32: with it, a
    kernel that follows a CPU recipe step for step gives its bits, so a test sees every other step's rounding
    (the GPU's exp is its own). Returns the interpreter's own, numpy's, for a control."""
    import numpy as np
    import torch
    from triton.runtime import interpreter

    from onepath.ops.pinned import pinned_unary

    own = interpreter.InterpreterBuilder.create_exp

    def create_exp(self, arg):
        if arg.data.dtype != np.float32:
            return own(self, arg)
        wide = torch.from_numpy(np.ascontiguousarray(arg.data))
        return interpreter.TensorHandle(pinned_unary(torch.exp, wide).numpy().reshape(np.shape(arg.data)),
                                        arg.dtype.scalar)

    interpreter.InterpreterBuilder.create_exp = create_exp
    return own


MMA_K = 16  # the K depth of one Hopper MMA instruction on 16-bit inputs (wgmma and mma.sync)


def patch_gemm_interpreter() -> None:
    """Make the interpreter's 16/32-bit dot the MMA chain a row sees on Hopper, and round to bf16 as the GPU.
    The interpreter's dot is numpy's: it reads bf16 as raw uint16 (Triton 3.6), and OpenBLAS's sgemm gives
    a row different bits by its position in the block (FMA or not by micro-tile). This row-independent
    model replaces it: exact products in fp64, each 16-deep K step (one MMA instruction's) rounded once
    to fp32 and added to the accumulator in order, so a dot's bits do not depend on how many steps one
    tl.dot takes. Call it in the interpreted subprocess, before the kernels run."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def f64(h):
        if h.dtype.scalar == tl.bfloat16:
            return interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32) \
                .reshape(h.data.shape).astype(np.float64)
        return h.data.astype(np.float64)

    def create_dot(self, a, b, d, *rest):
        a64, b64, acc = f64(a), f64(b), d.data
        for k in range(0, a64.shape[-1], MMA_K):
            acc = acc + np.matmul(a64[..., k:k + MMA_K], b64[..., k:k + MMA_K, :]).astype(np.float32)
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot
    patch_bf16_rounding()


def patch_fp8_gemm_interpreter() -> None:
    """Make Triton's CPU interpreter compute the block-FP8 GEMM as Hopper does where it matters to bits:
    a dot's partial summed exactly (float64, then rounded once to FP32: e4m3 products are exact), tl.fma
    as one rounding (onepath.ops.linear_quant.fma), and FP32 -> bf16 / e4m3 casts rounding to nearest
    even as torch's do (the interpreter truncates to bf16 and rounds e4m3 half up; see
    tests/ops/test_quant_interpret.py). Call it in the interpreted subprocess, before the kernels run."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    def f64(h):
        if h.dtype.scalar.primitive_bitwidth == 8:  # fp8 codes are exact in fp16
            return interpreter._convert_float(h.data, h.dtype.scalar, tl.float16, None).view(np.float16) \
                .reshape(h.data.shape).astype(np.float64)
        return h.data.astype(np.float64)

    def create_dot(self, a, b, d, *rest):
        block = np.matmul(f64(a), f64(b)).astype(np.float32)
        return interpreter.TensorHandle(block + d.data, d.dtype.scalar)

    def create_fma(self, x, y, z):
        from onepath.ops.linear_quant import fma
        out = fma(*(torch.from_numpy(np.ascontiguousarray(t.data, dtype=np.float32)) for t in (x, y, z)))
        return interpreter.TensorHandle(out.numpy(), z.dtype.scalar)

    convert_float = interpreter._convert_float

    def rne_convert_float(data, src, dst, rounding_mode):
        wide = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)) if src == tl.float32 else None
        if wide is not None and dst == tl.bfloat16:
            return wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        if wide is not None and dst == tl.float8e4nv:
            return wide.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(np.shape(data))
        return convert_float(data, src, dst, rounding_mode)

    interpreter.InterpreterBuilder.create_dot = create_dot
    interpreter.InterpreterBuilder.create_fma = create_fma
    interpreter._convert_float = rne_convert_float
