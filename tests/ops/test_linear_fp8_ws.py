"""onepath/ops/cuda/linear_fp8_ws.py's warp-specialized block-FP8 GEMM builds for the H200 without a GPU:
the config linear_fp8 ships (WS_CONFIG) and every config onepath/bench/kernels_fp8.py times (the split "n" decode
configs too), compiled for sm_90
(ptxas included) from the launcher's own arguments as the JIT would specialize them (CPU tensors stand
in: same dtypes, alignments and TMA descriptors).

Asserted on the PTX and SASS, what the design needs and a build can lose without failing:
  - the Triton kernel's MMA: fp8 wgmma m64nNk32 (e4m3, FP32; N 128 for split "m", half the tile's columns
    for split "n"), chains of four k32 steps of which the first starts from zero (a fresh partial per
    128-wide K block), no mma.sync; FMA promotion
  - warp specialization: setmaxnreg to the consumer and producer budgets, TMA loads completing on
    mbarriers (cp.async.bulk.tensor ... mbarrier::complete_tx), three a stage (A, W and A's scales, which
    the consumers read from shared memory), TMA stores of the output
  - ptxas kept the pipeline: one WARPGROUP.ARRIVE per four-step chain (it puts one before every wgmma
    when it serializes them), `WARPGROUP.DEPBAR.LE gsb0, 0x1` in the wait1 variants; no spills
  - within Hopper's 227 KiB of shared memory
  - pingpong: per wgmma chain one wait for the consumer's turn and one arrive passing it on (the same
    build without pingpong has 2 x chains fewer of each), the arrive before the chain's
    WARPGROUP.DEPBAR ("issued") or after it ("done")
Negative control: linear_fp8's Triton (not warp-specialized) kernel's build fails those checks.
The bits rest on tests/ops/test_linear_fp8_gpu.py and the GPU bench (torch.equal against the Triton
kernel): Gluon is not interpreted.
"""
from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

from tests.interpret import SM90_SHARED_BYTES, compile_sm90

pytest.importorskip("triton.backends.nvidia")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("TRITON_INTERPRET is set: Gluon kernels are compiled, not interpreted", allow_module_level=True)

CHAINS = "fp8 wgmma m64nNk32 (the config's N) in chains of four, the first from zero"
WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(\S+)\s.*\},\s*%rd\d+,\s*%rd\d+,\s*([^,]+),")


def _compile_like_jit(kernel, args, kwargs):
    """`kernel` compiled for sm_90 with the signature, constexprs and divisibility the JIT derives from args."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def _build(v, m=256, n=512, k=1024, out_dtype=torch.bfloat16, bias=False):
    from onepath.numerics.quant import quantize
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT
    from onepath.ops.cuda.linear_fp8_ws import _fp8_gemm_ws_kernel, launch_args, output

    gen = torch.Generator().manual_seed(0)
    qa = quantize(torch.randn(m, k, generator=gen), FP8_ACT)
    qw = quantize(torch.randn(n, k, generator=gen) * 0.05, FP8_WEIGHT)
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    _, args, consts = launch_args(qa, qw, b, output(m, n, out_dtype, "cpu"), v)
    return _compile_like_jit(_fp8_gemm_ws_kernel, args, dict(consts, num_warps=4))


def _chains(ptx: str) -> list[tuple[str, ...]]:
    """The wgmma instructions in order, grouped in fours: (shape.types, then per k32 step whether it adds
    to the accumulator: "0" starts from zero, "1" accumulates; a predicate not set to a constant stays its name)."""
    constant = {p: "0" if v == "0" else "1" for p, v in re.findall(r"mov\.pred\s+(%p\d+),\s*(-?\d+);", ptx)}
    steps = [(shape, constant.get(scale, scale)) for shape, scale in WGMMA.findall(ptx)]
    return [(steps[i][0], *(scale for _, scale in steps[i:i + 4])) for i in range(0, len(steps), 4)]


def _setmaxnreg(ptx: str, regs: int | None) -> bool:
    return regs is not None and re.search(rf"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+{regs};", ptx) is not None


def _turn_passes(sass: str) -> tuple[int, int]:
    """The plain mbarrier arrives between a wgmma chain's WARPGROUP.ARRIVE and its WARPGROUP.DEPBAR (its wait),
    and those right after the DEPBAR."""
    ops = re.findall(r"WARPGROUP\.ARRIVE|WARPGROUP\.DEPBAR|SYNCS\.ARRIVE\.TRANS64\.A1T0", sass)
    marks = "".join(op[10] if op.startswith("WARPGROUP") else "S" for op in ops)  # A, D or S
    return tuple(sum(map(len, re.findall(rf"(?<={mark})S+", marks))) for mark in "AD")


def _pingpong_problems(v, ptx: str, sass: str, alone) -> list[str]:
    """The turn's mbarrier ops against `alone`, the same build without pingpong."""
    turns = 2 * (v.block_n // v.mma_n)  # both consumers, every chain of a K block
    checks = {
        "a turn wait per chain": ptx.count("mbarrier.try_wait") == alone.asm["ptx"].count("mbarrier.try_wait") + turns,
        "a turn arrive per chain":
            ptx.count("mbarrier.arrive.shared") == alone.asm["ptx"].count("mbarrier.arrive.shared") + turns,
        f"the turn passed once the chain is {v.pingpong}": _turn_passes(sass)[v.pingpong == "done"]
        == _turn_passes(alone.asm["sass"])[v.pingpong == "done"] + turns,
    }
    return [name for name, ok in checks.items() if not ok]


def _problems(v, ptx: str, sass: str, shared: int) -> list[str]:
    wait1 = getattr(v, "wait1", False)
    chains = _chains(ptx)
    mma_n = getattr(v, "mma_n", v.block_n)  # a Triton tile: one warpgroup's wgmma spans the tile
    checks = {
        CHAINS: chains and len(WGMMA.findall(ptx)) % 4 == 0
        and all(c == (f"m64n{mma_n}k32.f32.e4m3.e4m3", "0", "1", "1", "1") for c in chains),
        "no mma.sync": "mma.sync" not in ptx,
        "FMA promotion": "fma.rn.f32" in ptx,
        "setmaxnreg to the consumer budget": _setmaxnreg(ptx, getattr(v, "consumer_regs", None)),
        "setmaxnreg to the producer budget": _setmaxnreg(ptx, getattr(v, "producer_regs", None)),
        "TMA loads on mbarriers": "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx,
        # a stage holds the block's A scales too, which the consumers read from it (not from global memory)
        "three TMA loads a stage: A, W, A scales":
            ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes") == 3,
        "A scales read from shared memory": "ld.shared.b32" in ptx,
        "TMA stores": "cp.async.bulk.tensor.2d.global.shared::cta" in ptx,
        "one WARPGROUP.ARRIVE per wgmma chain": 0 < 4 * sass.count("WARPGROUP.ARRIVE") == sass.count("GMMA."),
        "no spills": not re.search(r"\b(STL|LDL)\b", sass),
        "shared memory fits": shared <= SM90_SHARED_BYTES,
    }
    if wait1:
        checks["wgmma.wait_group 1 kept by ptxas"] = "wgmma.wait_group.sync.aligned 1;" in ptx \
            and "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass
    return [name for name, ok in checks.items() if not ok]


def _build_problems(v, **shape) -> list[str]:
    """_problems of v's build for `shape` (_build's keywords); with pingpong, its turn's against the same build
    without pingpong."""
    compiled = _build(v, **shape)
    ptx, sass = compiled.asm["ptx"], compiled.asm["sass"]
    problems = _problems(v, ptx, sass, compiled.metadata.shared)
    if v.pingpong:
        problems += _pingpong_problems(v, ptx, sass, _build(dataclasses.replace(v, pingpong=""), **shape))
    return problems


def _variants():
    """The shipped config first, then the bench's sweeps (the training one holds it too: built once)."""
    from onepath.bench.kernels_fp8 import decode_variants, variants
    from onepath.ops.cuda.linear_fp8 import WS_CONFIG
    return list(dict.fromkeys([WS_CONFIG, *variants(), *decode_variants()]))


@pytest.mark.parametrize("v", _variants(), ids=str)
def test_variant_builds_for_sm90_warp_specialized_with_the_triton_kernels_wgmma(v):
    """The build the bench times at training shapes (bf16 out, N and K multiples of 16, no bias)."""
    problems = _build_problems(v)
    assert not problems, f"{v}: {problems}"


@pytest.mark.parametrize("v", [_variants()[0], *(v for v in _variants()[1:] if v.persistent and (
    v.num_stages == 3 or v.split == "n" or v.pingpong))], ids=str)
def test_variant_builds_for_awkward_shapes_fp32_out_and_bias(v):
    """The other epilogue (FP32 out: two 64-column TMA stores a 128-column partial), the bias, N and K off
    multiples of 16: for the shipped config, the persistent 3-stage ones, the split "n" and pingpong ones."""
    problems = _build_problems(v, m=37, n=200, k=1000, out_dtype=torch.float32, bias=True)
    assert not problems, f"{v}: {problems}"


def test_negative_control_the_triton_kernel_fails_the_warp_specialization_checks():
    """The checks can fail: linear_fp8's Triton kernel has the same wgmma chains and FMAs but no
    setmaxnreg partitions and no TMA; its build must be flagged."""
    from onepath.ops.cuda.linear_fp8 import TILES_FP8, _linear_fp8_kernel

    config = TILES_FP8[0]
    sig = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sw_ptr": "*fp32", "bias_ptr": "*bf16",
           "out_ptr": "*bf16", **{n: "i32" for n in ("M", "N", "K", "NUM_PROGRAMS", "stride_am", "stride_sam",
                                                     "stride_wn", "stride_swn", "stride_om")}}
    consts = dict(W_BLOCK_N=128, HAS_BIAS=False, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=128,
                  GROUP_M=config.group_m)
    ptx, shared = compile_sm90(_linear_fp8_kernel, sig, consts,
                               ("a_ptr", "w_ptr", "out_ptr", "K", "stride_am", "stride_wn", "stride_om"), config)
    problems = _problems(config, ptx, "", shared)
    assert CHAINS not in problems, "the Triton kernel's MMA is the reference the Gluon builds are held to"
    assert {"setmaxnreg to the consumer budget", "TMA loads on mbarriers", "TMA stores",
            "three TMA loads a stage: A, W, A scales", "A scales read from shared memory"} <= set(problems), problems


def test_negative_control_the_pingpong_checks_tell_the_turn_passes_apart():
    """The turn checks can fail: the "done" build held to "issued" (arrive after the wgmma wait, not before)
    and the build without pingpong held to it (no turn ops) are flagged."""
    from onepath.ops.cuda.linear_fp8_ws import WSConfig

    issued, done = WSConfig(256, 4, pingpong="issued"), WSConfig(256, 4, pingpong="done")
    alone = _build(WSConfig(256, 4))
    built = _build(done)
    assert _pingpong_problems(issued, built.asm["ptx"], built.asm["sass"], alone) == \
        ["the turn passed once the chain is issued"]
    assert len(_pingpong_problems(issued, alone.asm["ptx"], alone.asm["sass"], alone)) == 3


@pytest.mark.parametrize("block_n", [64, 128, 256])
def test_split_n_tiles_64_rows_and_the_consumers_take_half_the_columns_each(block_n, monkeypatch):
    """Split "n": A's TMA box is 64 rows, W's block_n rows; one program per 64 x block_n tile (persistent:
    at most one per SM); each consumer's chain is m64n(block_n / 2)k32, inside one 128-row weight scale block."""
    from onepath.numerics.quant import quantize
    from onepath.numerics.spec import FP8_ACT, FP8_WEIGHT
    from onepath.ops.cuda import linear_fp8_ws as linear_fp8_ws
    from onepath.ops.cuda.linear_fp8_ws import WSConfig, launch_args, output

    monkeypatch.setattr(linear_fp8_ws, "sm_count", lambda device: 132)  # an H200
    gen = torch.Generator().manual_seed(0)
    m, n, k = 130, 4096, 256
    qa = quantize(torch.randn(m, k, generator=gen), FP8_ACT)
    qw = quantize(torch.randn(n, k, generator=gen) * 0.05, FP8_WEIGHT)
    for persistent, programs in ((False, 3 * n // block_n), (True, min(132, 3 * n // block_n))):
        v = WSConfig(block_n, 4, persistent=persistent, split="n")
        grid, args, consts = launch_args(qa, qw, None, output(m, n, torch.bfloat16, "cpu"), v)
        assert v.block_m == 64 and v.mma_n == block_n // 2 and qw.block[0] % v.mma_n == 0
        assert args[0].block_shape == [64, 128] and args[1].block_shape == [block_n, 128], v
        assert consts["SPLIT_N"] and consts["MMA_N"] == block_n // 2
        assert grid == (programs,), (v, grid)


def test_config_check_names_what_is_wrong():
    """Split "m" keeps its two shapes; split "n" takes n32/n64/n128 chains; the ring must fit Hopper's 227 KiB
    (split "n" with BLOCK_N 128: 8 stages fit, 9 do not); a layout that is neither is refused; pingpong is
    split "m" without wait1, its turn passed once "issued" or "done"."""
    from onepath.ops.cuda.linear_fp8_ws import WSConfig

    for v in (WSConfig(128, 8, split="n"), WSConfig(256, 4, split="n"), WSConfig(64, 12, split="n"),
              WSConfig(256, 4, wait1=True, split="n")):
        v.check()
        assert v.shared_bytes() <= SM90_SHARED_BYTES
    for v, words in ((WSConfig(64, 4), "block_n 64"), (WSConfig(512, 2, split="n"), "block_n 512"),
                     (WSConfig(128, 9, split="n"), "shared memory"), (WSConfig(256, 5, split="n"), "shared memory"),
                     (WSConfig(256, 4, wait1=True), "wait1"), (WSConfig(128, 4, split="k"), "split 'k'"),
                     (WSConfig(256, 4, pingpong="yes"), "'issued' or 'done'"),
                     (WSConfig(128, 8, split="n", pingpong="issued"), "split 'm'"),
                     (WSConfig(128, 4, wait1=True, pingpong="done"), "without wait1")):
        with pytest.raises(ValueError, match=words):
            v.check()
    assert str(WSConfig(128, 8, split="n")) == "ws64x128s8+splitn+persistent"
    assert str(WSConfig(256, 4)) == "ws128x256s4+persistent"
    assert str(WSConfig(256, 4, pingpong="done")) == "ws128x256s4+persistent+pingpong-done"
    assert WSConfig(256, 4, pingpong="issued").shared_bytes() <= SM90_SHARED_BYTES
