"""The Triton paged attention kernel's logic on CPU (TRITON_INTERPRET=1, tiny shapes): close to a float64
causal reference; a probe's bits alone == inside a batch; prefill == chunked prefill == decode token by
token; the in-register and split-KV launches agree; sliding window; an FP8 KV cache reads as the cache of
its dequantised values (check_fp8_kv). Each check runs in a subprocess
because TRITON_INTERPRET must be set before triton is imported. The helpers build paged batches for
tests/ops/test_attention_gpu.py too."""
import copy
import math
from functools import partial
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from onepath.numerics.quant import FP8Tensor
from onepath.numerics.spec import FP8_KV
from onepath.ops.attention import write_kv

HEADS, KV_HEADS, HEAD_DIM, BLOCK, KV_TILE, KV_SPLIT = 4, 2, 16, 16, 16, 32
ROOT = Path(__file__).resolve().parents[2]


# ---- helpers (shared with the GPU test) ----

class PagedCache:
    """K/V caches filled with NaN, so a read of any slot the kernel must not touch poisons the output.
    Sequences get blocks drawn at random from a shuffled pool: tables are non-contiguous.
    kv (a QuantSpec, FP8_KV): K and V are FP8Tensors, written through ops.attention.write_kv."""

    def __init__(self, num_blocks, num_kv_heads, head_dim, dtype, device, gen, block_size=BLOCK, kv=None):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)

        def nan_cache():
            if kv is None:
                return torch.full(shape, math.nan, dtype=dtype, device=device)
            return FP8Tensor(torch.full(shape, math.nan, device=device).to(torch.float8_e4m3fn),
                             torch.full((*shape[:3], 1), math.nan, device=device), (1, head_dim), kv)

        self.k, self.v = nan_cache(), nan_cache()
        self.block_size, self.device, self.kv = block_size, torch.device(device), kv
        self.free = torch.randperm(num_blocks, generator=gen).tolist()

    def dequantized(self, dtype):
        """A plain cache of `dtype` holding this FP8 cache's dequantised values, same block tables."""
        plain = copy.copy(self)
        plain.k, plain.v, plain.kv = self.k.dequantize(dtype), self.v.dequantize(dtype), None
        return plain

    def table(self, length):
        n = -(-length // self.block_size)
        table, self.free = self.free[:n], self.free[n:]
        return table

    def write(self, table, start, k, v):
        j = torch.arange(start, start + k.shape[0])
        slots = (torch.tensor(table)[j // self.block_size] * self.block_size + j % self.block_size).to(self.device)
        write_kv(self.k, self.v, k.to(self.device), v.to(self.device), slots, self.kv)


def step(attn, cache, chunks, scale, **kw):
    """One launch over chunks (q [n, H, D], start, table): the chunk's queries sit at positions
    start..start+n-1 of their sequence, whose K/V 0..start+n-1 are in the cache. Returns each chunk's output."""
    device = cache.device
    positions = torch.cat([torch.arange(s, s + q.shape[0]) for q, s, _ in chunks]).to(device)
    query_seq = torch.cat([torch.full((q.shape[0],), i) for i, (q, _, _) in enumerate(chunks)]).to(device)
    width = max(len(t) for _, _, t in chunks)
    tables = torch.tensor([t + [0] * (width - len(t)) for _, _, t in chunks], dtype=torch.int32, device=device)
    q = torch.cat([q for q, _, _ in chunks]).to(device)
    out = attn(q, cache.k, cache.v, positions, query_seq, tables, scale, **kw)
    return list(out.split([q.shape[0] for q, _, _ in chunks]))


def phases(attn, q, k, v, sizes, cache, scale, **kw):
    """One sequence through successive steps of the given query lengths over one cache, writing each
    step's K/V before its launch (as the engine does)."""
    table = cache.table(q.shape[0])
    outs, pos = [], 0
    for size in sizes:
        cache.write(table, pos, k[pos:pos + size], v[pos:pos + size])
        outs += step(attn, cache, [(q[pos:pos + size], pos, table)], scale, **kw)
        pos += size
    assert pos == q.shape[0]
    return torch.cat(outs)


def chunked(n, size):
    return [size] * (n // size) + ([n % size] if n % size else [])


def causal_reference(q, k, v, scale, window=None):
    """Causal GQA attention of one whole sequence in float64."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    i, j = torch.arange(q.shape[0])[:, None], torch.arange(q.shape[0])[None, :]
    allowed = (j <= i) & ((j > i - window) if window else True)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~allowed.to(q.device), -math.inf), -1), v)


# ---- checks, run in the interpreter subprocess ----

SCALE = HEAD_DIM ** -0.5


def _seq(n, gen, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    return (torch.randn(n, heads, head_dim, generator=gen), torch.randn(n, kv_heads, head_dim, generator=gen),
            torch.randn(n, kv_heads, head_dim, generator=gen))


def _attn(**fixed):
    """paged_attention with the 64-row program unless `fixed` says otherwise: on the GPU the decode program
    has its bits, in the interpreter not (check_decode_program)."""
    from onepath.ops.cuda.attention import paged_attention
    fixed = {"decode_program": False, **fixed}
    return lambda *a, **kw: paged_attention(*a, kv_tile=KV_TILE, kv_split=KV_SPLIT, **fixed, **kw)


def _attn_rows(rows, **fixed):
    return _attn(block_m=rows, **fixed)


def _fill(seqs, gen, kv=None):
    """seqs: (q, k, v, start); tokens start.. are this step's chunk over the cached prefix.
    Returns the cache holding every sequence's K/V and the chunks (q, start, table)."""
    kv_heads, head_dim = seqs[0][1].shape[1:]
    cache = PagedCache(sum(-(-q.shape[0] // BLOCK) for q, *_ in seqs) + 5, kv_heads, head_dim, torch.float32,
                       "cpu", gen, kv=kv)
    chunks = []
    for q, k, v, start in seqs:
        table = cache.table(q.shape[0])
        cache.write(table, 0, k, v)
        chunks.append((q[start:], start, table))
    return cache, chunks


def _batch(attn, seqs, gen, window=None):
    cache, chunks = _fill(seqs, gen)
    return step(attn, cache, chunks, seqs[0][0].shape[2] ** -0.5, sliding_window=window)


def _fp8_batch(attn, seqs, gen, dtype, window=None):
    """Each chunk's output over an FP8 cache (FP8_KV) and over the cache of dtype holding its dequantised values."""
    cache, chunks = _fill(seqs, gen, FP8_KV)
    chunks = [(q.to(dtype), start, table) for q, start, table in chunks]
    return (step(attn, cache, chunks, SCALE, sliding_window=window),
            step(attn, cache.dequantized(dtype), chunks, SCALE, sliding_window=window))


def check_reference():
    """Also MHA, a group of 3 (padded to 4) and head_dim 24 (padded to 32)."""
    gen = torch.Generator().manual_seed(0)
    for shape, window in (((HEADS, KV_HEADS, HEAD_DIM), None), ((HEADS, KV_HEADS, HEAD_DIM), 5),
                          ((2, 2, 16), None), ((6, 2, 24), 11)):
        seqs = [(*_seq(n, gen, *shape), 0) for n in (1, 17, 40, 33)]
        for split in (False, True):
            outs = _batch(_attn(split_kv=split), seqs, gen, window)
            for (q, k, v, _), out in zip(seqs, outs):
                ref = causal_reference(q, k, v, shape[2] ** -0.5, window)
                torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def check_batch_invariance(rows=None):
    _attn = partial(_attn_rows, rows)
    gen = torch.Generator().manual_seed(1)
    for trial in range(4):
        window = (None, 7)[trial % 2]
        n = int(torch.randint(1, 41, (1,), generator=gen))
        probe = (*_seq(n, gen), int(torch.randint(0, n, (1,), generator=gen)))
        alone = {split: _batch(_attn(split_kv=split), [probe], gen, window)[0] for split in (False, True)}
        assert torch.equal(alone[False], alone[True]), "in-register and split-KV launches differ"
        others = []
        for _ in range(int(torch.randint(2, 7, (1,), generator=gen))):
            m = int(torch.randint(1, 41, (1,), generator=gen))
            start = m - 1 if torch.rand(1, generator=gen) < 0.5 else int(torch.randint(0, m, (1,), generator=gen))
            others.append((*_seq(m, gen), start))
        at = int(torch.randint(0, len(others) + 1, (1,), generator=gen))
        batch = others[:at] + [probe] + others[at:]
        for split in (False, True):
            assert torch.equal(_batch(_attn(split_kv=split), batch, gen, window)[at], alone[False]), (trial, split)


def check_phases(rows=None):
    _attn = partial(_attn_rows, rows)
    gen = torch.Generator().manual_seed(2)
    for window in (None, 9):
        q, k, v = _seq(40, gen)
        runs = {}
        # decode token by token runs the split-KV launch (as an engine decode step would), the decode
        # after a prefix the in-register one; prefill and chunks run both.
        for name, sizes, splits in (("prefill", [40], (False, True)), ("chunk7", chunked(40, 7), (False, True)),
                                    ("chunk16", chunked(40, 16), (False, True)), ("decode", [1] * 40, (True,)),
                                    ("prefix+decode", [23] + [1] * 17, (False,))):
            for split in splits:
                cache = PagedCache(8, KV_HEADS, HEAD_DIM, torch.float32, "cpu", gen)
                runs[name, split] = phases(_attn(split_kv=split), q, k, v, sizes, cache, SCALE, sliding_window=window)
        first = runs["prefill", False]
        torch.testing.assert_close(first.double(), causal_reference(q, k, v, SCALE, window), atol=1e-5, rtol=1e-5)
        for key, out in runs.items():
            assert torch.equal(out, first), (window, key)


def check_decode_program():
    """The 16-row one-warp decode program keeps every phase's bits equal among its runs (both launches),
    and it is refused where it would not give the default program's bits. That it gives the 64-row
    program's bits is a property of Hopper's MMA layouts, proved on the H200 by
    tests/ops/test_attention_gpu.py: the interpreter's dots are numpy matmuls, whose summation order
    follows the operand shapes."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = _seq(40, gen)
    cache = lambda: PagedCache(8, KV_HEADS, HEAD_DIM, torch.float32, "cpu", gen)
    first = phases(_attn(decode_program=True), q, k, v, [40], cache(), SCALE)
    torch.testing.assert_close(first.double(), causal_reference(q, k, v, SCALE), atol=1e-5, rtol=1e-5)
    for sizes in ([40], chunked(40, 7), [1] * 40, [23] + [1] * 17):
        for split in (False, True):
            for program in ((None, True) if sizes == [1] * 40 else (True,)):
                out = phases(_attn(decode_program=program, split_kv=split), q, k, v, sizes, cache(), SCALE)
                assert torch.equal(out, first), (sizes[:2], split, program)
    # over an FP8 cache too (its tiles pass the operand barrier on the GPU; the interpreter runs none)
    fp8_cache = lambda: PagedCache(8, KV_HEADS, HEAD_DIM, torch.float32, "cpu", gen, kv=FP8_KV)
    fp8_first = phases(_attn(decode_program=True), q, k, v, [40], fp8_cache(), SCALE)
    for split in (False, True):
        for program in (None, True):
            out = phases(_attn(decode_program=program, split_kv=split), q, k, v, [1] * 40, fp8_cache(), SCALE)
            assert torch.equal(out, fp8_first), ("fp8", split, program)
    for kw in (dict(block_m=16), dict(num_warps=8)):
        try:
            phases(_attn(decode_program=True, **kw), q, k, v, [1] * 3, cache(), SCALE)
        except ValueError as e:
            assert "decode program" in str(e)
        else:
            raise AssertionError(f"decode_program=True with {kw} was not refused")


def check_programs_spanning_tiles():
    """q_block larger than kv_tile (a program's positions span two tiles, the rows whose last tile comes
    earlier meeting only masked keys in the later one) gives the default program's bits in every phase,
    with and without a window, in both launches, alone and in a batch, also over an FP8 cache; GQA
    (group 2) and MHA. The interpreter's dot is made row-independent (tests/interpret.py), as a row's MMA
    chain is on Hopper, so the check sees the kernel's masking and merging, not numpy's blocking. Control:
    a q_block that does not divide kv_split is refused."""
    from tests.interpret import patch_gemm_interpreter
    patch_gemm_interpreter()
    gen = torch.Generator().manual_seed(7)
    for shape, kv in (((HEADS, KV_HEADS, HEAD_DIM), None), ((2, 2, 16), None), ((HEADS, KV_HEADS, HEAD_DIM), FP8_KV)):
        q, k, v = _seq(40, gen, *shape)
        cache = lambda: PagedCache(8, shape[1], shape[2], torch.float32, "cpu", gen, kv=kv)
        for window in (None, 9):
            first = phases(_attn(), q, k, v, [40], cache(), SCALE, sliding_window=window)
            for sizes in ([40], chunked(40, 7), chunked(40, 16), [23] + [1] * 17):
                for split in (False, True):
                    out = phases(_attn(q_block=2 * KV_TILE, split_kv=split), q, k, v, sizes, cache(), SCALE,
                                 sliding_window=window)
                    assert torch.equal(out, first), (shape, kv, window, sizes[:2], split)
    probe = (*_seq(37, gen), 20)
    others = [(*_seq(m, gen), start) for m, start in ((5, 4), (24, 0), (18, 17))]
    alone = _batch(_attn(), [probe], gen)[0]
    inside = _batch(_attn(q_block=2 * KV_TILE), others[:2] + [probe] + others[2:], gen)
    assert torch.equal(inside[2], alone)
    try:
        _batch(_attn(q_block=4 * KV_TILE), [probe], gen)
    except ValueError as e:
        assert "q_block" in str(e)
    else:
        raise AssertionError("q_block 64 with kv_split 32 was not refused")


def check_batch_invariance_16_rows():
    """The spec's attention.q_rows = 16 (tl.dot with M = 16): the same guarantees."""
    check_batch_invariance(16)


def check_phases_16_rows():
    check_phases(16)


def check_control():
    """The reduction tree shows in the bits (another kv_tile or kv_split gives other bits), so the
    equalities above are not trivially true."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = _seq(40, gen)
    from onepath.ops.cuda.attention import paged_attention
    outs = []
    for tile, split in ((16, 32), (32, 32), (16, 16)):
        attn = lambda *a, **kw: paged_attention(*a, kv_tile=tile, kv_split=split, **kw)
        outs.append(_batch(attn, [(q, k, v, 0)], gen)[0])
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def check_fp8_kv():
    """The kernel reading an FP8 cache == the kernel reading a cache of q's dtype that holds the dequantised
    values, bit for bit (both launches, with and without a window), alone and inside a batch; and the
    quantisation shows: != the unquantised cache, yet close to it. FP32 queries only: the interpreter's
    BF16 dots are not IEEE (tests/engine/test_kv_fp8.py runs BF16 on the GPU)."""
    gen = torch.Generator().manual_seed(4)
    dtype = torch.float32
    for window in (None, 7):
        probe = (*_seq(37, gen), 20)
        others = [(*_seq(m, gen), start) for m, start in ((5, 4), (24, 0), (18, 17))]
        for split in (False, True):
            attn = _attn(split_kv=split)
            (alone,), (alone_plain,) = _fp8_batch(attn, [probe], gen, dtype, window)
            assert torch.equal(alone, alone_plain), (dtype, split)
            inside, inside_plain = _fp8_batch(attn, others[:2] + [probe] + others[2:], gen, dtype, window)
            assert torch.equal(inside[2], alone), (dtype, split)
            assert all(torch.equal(a, b) for a, b in zip(inside, inside_plain)), (dtype, split)
        (unquantised,) = _batch(_attn(), [probe], gen, window)
        assert not torch.equal(alone, unquantised)
        torch.testing.assert_close(alone, unquantised, atol=0.1, rtol=0.1)


def check_derived_query_blocks():
    """The query blocks a batch's first layer computes are kept in `derived` and reused by the next call
    (same bits); planted wrong blocks in `derived` would be read (the reuse is real)."""
    gen = torch.Generator().manual_seed(5)
    seqs = [(*_seq(n, gen), start) for n, start in ((40, 0), (17, 9), (33, 32))]
    derived = {}
    first = _batch(_attn(derived=derived), seqs, gen)
    (key, starts), = derived.items()
    assert key[0] == "query_blocks" and starts.dtype == torch.int64
    again = _batch(_attn(derived=derived), seqs, gen)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    derived[key] = starts[:1]  # one program only: every other query block left unwritten
    planted = _batch(_attn(derived=derived), seqs, gen)
    assert not all(torch.equal(a, b) for a, b in zip(first, planted))


# ---- pytest entry ----

CHECKS = ["check_reference", "check_batch_invariance", "check_phases", "check_control", "check_fp8_kv",
          "check_derived_query_blocks", "check_decode_program", "check_batch_invariance_16_rows",
          "check_phases_16_rows", "check_programs_spanning_tiles"]


@pytest.mark.parametrize("check", CHECKS)
def test_interpreted(check):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    code = f"import torch; torch.set_num_threads(1); import tests.ops.test_attention_interpret as t; t.{check}()"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]


@pytest.mark.parametrize("program", ["64 rows", "16 rows", "decode", "decode deep", "64 rows fp8", "decode fp8",
                                     "128 rows"])
def test_kernel_builds_for_sm90(program):
    """The programs paged_attention launches build for the H200 (the Triton wheel's ptxas, no GPU): Qwen3's
    GQA group of 2 and head_dim 128, kv_tile 32, within the 227 KiB of shared memory; 64 rows (and 128 on 8
    warps, for q_block) run on wgmma, 16 on mma.sync (Hopper's wgmma takes M >= 64): the spec's 16 rows on
    4 warps and the decode program's 16 rows on one. Over an FP8 cache the dequantised tiles pass `_opaque`,
    so the decode program's mma.sync operands get the BF16 cache's kWidth 2 (4 without it: other bits than
    the 64-row program's, lab/results/attention-fp8-variants.json)."""
    import re

    from tests.attention_sass import signature
    from onepath.ops.cuda import attention as A
    from tests.interpret import SM90_SHARED_BYTES, build_sm90

    fp8 = program.endswith("fp8")
    rows, warps, stages = {"64 rows": (64, A.NUM_WARPS, A.NUM_STAGES), "16 rows": (16, A.NUM_WARPS, A.NUM_STAGES),
                           "128 rows": (128, 8, A.NUM_STAGES),
                           "decode": (A.DECODE_BLOCK_M, A.DECODE_NUM_WARPS, A.DECODE_NUM_STAGES),
                           "decode deep": (A.DECODE_BLOCK_M, A.DECODE_NUM_WARPS, A.DEEP_DECODE_NUM_STAGES)}[
                               program.removesuffix(" fp8")]
    ptrs = ("q_ptr", "k_ptr", "v_ptr", "out_ptr")
    sig = signature(fp8)
    bad = []
    for split in (False, True):
        consts = dict(GROUP=2, GROUP_PAD=2, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, KV_TILE=32, SPLIT_TILES=8,
                      BLOCK_M=rows, BLOCK_Q=rows // 2 if rows > 64 else min(rows // 2, 32), SPLIT=split, FP8_KV=fp8,
                      OPAQUE=fp8, UNMASKED=A.UNMASKED_INTERIOR and not split and not program.startswith("decode"),
                      TABLE_ASM=A.table_load_asm(fp8, program.startswith("decode"), split))
        config = type("Launch", (), dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False))
        built = build_sm90(A._paged_attention_kernel, sig, consts, ptrs + ("stride_qt", "stride_ot"), config)
        ptx, shared = built.asm["ptx"], built.metadata.shared
        mma = "wgmma.mma_async" in ptx if rows >= 64 else ("mma.sync" in ptx and "wgmma" not in ptx)
        dots = [line for line in built.asm["ttgir"].splitlines() if " tt.dot " in line]
        kwidth = {int(x) for line in dots for x in re.findall(r"kWidth = (\d+)", line)}
        if shared > SM90_SHARED_BYTES or not mma or (rows < 64 and kwidth != {2}):
            bad.append((split, shared, "wgmma" in ptx, "mma.sync" in ptx, kwidth))
        if fp8 and rows < 64:
            # control: without the barrier the same program's dots take kWidth 4 (the check above can fail)
            plain = build_sm90(A._paged_attention_kernel, sig, {**consts, "OPAQUE": False},
                               ptrs + ("stride_qt", "stride_ot"), config)
            dots = [line for line in plain.asm["ttgir"].splitlines() if " tt.dot " in line]
            if {int(x) for line in dots for x in re.findall(r"kWidth = (\d+)", line)} != {4}:
                bad.append((split, "without the barrier the decode program's kWidth is not 4"))
    assert not bad, f"(split, shared bytes, wgmma, mma.sync, kWidth): {bad}"


def test_fp8_decode_program_fits_eight_per_sm():
    """The one-warp decode program over an FP8 cache, built for sm_90 as the engine launches it (Qwen3's heads,
    the strides' 16-divisibility of a real cache, DECODE_NUM_STAGES), takes at most 1/8 of an SM's
    228 KiB of shared memory less the 1 KiB the driver reserves per block: 8 programs per SM, as many as
    its 255 registers allow. V is dequantised after the QK^T dot, into the dead K tile's buffer; dequantised
    with K it took 29 KB, 7 programs per SM, and decoded in 322 instead of 260 us at batch 256, context 1024
    (bench/results/attention/kernels-attention-decode-fp8.json, kernels-attention-decode-fp8-late-v.json). Control:
    kv_tile 64 (twice the tiles) does not fit, so the bound is a real one."""
    from onepath.ops.cuda import attention as A
    from tests.attention_sass import signature
    from tests.interpret import build_sm90

    per_program = 228 * 1024 // 8 - 1024
    sig = signature(fp8=True)
    # a cache [blocks, 16, 8, 128]: every stride but the scales' per-token one (Hkv = 8) is a multiple of 16
    aligned = ("q_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr", "out_ptr", "stride_qt", "stride_qh", "stride_ot",
               "stride_oh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh",
               "stride_ksb", "stride_vsb")
    config = type("Launch", (), dict(num_warps=A.DECODE_NUM_WARPS, num_stages=A.DECODE_NUM_STAGES,
                                         enable_fp_fusion=False))
    shared = {}
    for kv_tile in (32, 64):
        consts = dict(GROUP=2, GROUP_PAD=2, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, KV_TILE=kv_tile,
                      SPLIT_TILES=256 // kv_tile, BLOCK_M=A.DECODE_BLOCK_M, BLOCK_Q=A.DECODE_BLOCK_M // 2,
                      SPLIT=False, FP8_KV=True, OPAQUE=True, UNMASKED=False,  # the decode program: one loop
                      TABLE_ASM=False)
        shared[kv_tile] = build_sm90(A._paged_attention_kernel, sig, consts, aligned, config).metadata.shared
    assert shared[32] <= per_program < shared[64], \
        f"shared bytes by kv_tile {shared}, per program at 8/SM {per_program}"


def test_launch_plan():
    """Which launch and how many stages paged_attention picks (attention.launch_plan), on the H200's 132 SMs with
    Qwen3's 8 KV heads: split-KV at batch 16-48 (fewer than 4 programs per SM), the BF16 decode program
    in-register at 3 stages at batch 64-80 (3-5 per SM), in-register at 2 from batch 96; over an FP8 cache, at 2
    stages throughout (the deep rule is BF16's), batch 64 keeps the split launch and 80 runs in-register; the
    64-row program keeps NUM_STAGES; a single split never splits; explicit choices are kept."""
    from onepath.ops.cuda import attention as A

    def plan(batch, fp8=False, program=True, splits=16, **kw):
        return A.launch_plan(batch * 8, 132, splits, program, fp8, **kw)

    stages = A.DECODE_NUM_STAGES
    deep = A.DEEP_DECODE_NUM_STAGES
    assert [plan(b) for b in (16, 48, 64, 80, 96, 256)] == \
        [(True, stages), (True, stages), (False, deep), (False, deep), (False, stages), (False, stages)]
    assert [plan(b, fp8=True) for b in (48, 64, 80, 96)] == \
        [(True, stages), (True, stages), (False, stages), (False, stages)]
    assert plan(64, program=False) == (True, A.NUM_STAGES) and plan(96, program=False) == (False, A.NUM_STAGES)
    assert plan(16, splits=1) == (False, stages)
    assert plan(64, split_kv=True) == (True, stages) and plan(64, num_stages=2) == (False, 2)


def test_pow2_kv_names_the_rules_the_bf16_dequantisation_takes():
    """FP8 caches dequantise by bit placement and a BF16 multiply only when their rule makes every scale a power
    of two of at most 2^7: FP8_KV's ue8m0 scales under its 448 * 2^7 amax ceiling. FP32 scales, no ceiling, a
    higher one, or an unknown rule take the FP32 product."""
    from dataclasses import replace

    from onepath.numerics.spec import FP8_ACT, FP8_KV
    from onepath.ops.cuda.attention import pow2_kv

    assert pow2_kv(FP8_KV) and pow2_kv(replace(FP8_KV, amax_ceil=448.0))
    assert not pow2_kv(None) and not pow2_kv(FP8_ACT)
    assert not pow2_kv(replace(FP8_KV, scale_dtype="fp32"))
    assert not pow2_kv(replace(FP8_KV, amax_ceil=None)) and not pow2_kv(replace(FP8_KV, amax_ceil=448.0 * 2 ** 8))
