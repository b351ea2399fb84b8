"""The Triton paged attention kernel on the GPU (BF16, paged cache, non-contiguous random block tables):
a probe's bits alone == inside batches of 2..32 sequences of 1..3000 tokens; prefill == chunked prefill
(7, 64, 512) == decode token by token; in-register == split-KV launch; the 16-row one-warp decode
program == the 64-row program in every phase, over BF16 and FP8 caches (negative controls: 16 rows on two
warps; an FP8 cache without the operand barrier); 128-row programs spanning several tiles (q_block) == the
64-row program; tiles run without masks inside every row's key range == every tile masked; FP8_KV's
power-of-two dequantisation == the FP32 product (every code and scale; whole attention in every phase, launch
and program; control: FP32 scales read that way differ); sliding window; run-to-run
determinism, with the kernel's 64 rows per program and the spec's alternative 16 (attention.q_rows);
values within 1e-2 + 1e-2|ref| of an FP32 reference. Negative controls: SDPA flash's
prefill last row differs from its decode, and a split-KV whose split count follows the batch differs
from itself."""
import math
import sys
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from onepath.ops.cuda import attention as A

from tests.ops.test_attention_interpret import PagedCache, chunked, phases, step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE, DTYPE = "cuda", torch.bfloat16
SHAPES = [(16, 8, 128), (32, 4, 128)]          # Qwen3-0.6B heads; GQA 8
MAX_LEN, MAX_SEQS, TRIALS = 3000, 32, 4
PHASE_LEN = 700                                 # crosses tiles (32), splits (256) and query blocks
WINDOWS = (None, 1000, None, 333)


def attn(*args, **kw):
    from onepath.ops.cuda.attention import paged_attention
    return paged_attention(*args, **kw)


def _seq(n, shape, gen):
    heads, kv_heads, head_dim = shape
    randn = lambda *s: torch.randn(*s, generator=gen, device=DEVICE).to(DTYPE)
    return randn(n, heads, head_dim), randn(n, kv_heads, head_dim), randn(n, kv_heads, head_dim)


def _reference(q, k, v, start, window):
    """FP32 attention of queries at positions start.. over keys 0..; q [nq, H, D], k/v [n, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * q.shape[2] ** -0.5
    i = torch.arange(start, start + q.shape[0], device=q.device)[:, None]
    j = torch.arange(k.shape[0], device=q.device)[None, :]
    allowed = (j <= i) & ((j > i - window) if window else True)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~allowed, -math.inf), -1), v)


def _close(out, ref):
    err = (out.float() - ref).abs()
    assert bool((err <= 1e-2 + 1e-2 * ref.abs()).all()), f"max error {err.max().item():.3g}"


def _batch(seqs, gen, window, **kw):
    """seqs: (q, k, v, start); tokens start.. are this step's chunk over the cached prefix."""
    kv_heads, head_dim = seqs[0][1].shape[1:]
    cache = PagedCache(sum(-(-q.shape[0] // 16) for q, *_ in seqs) + 7, kv_heads, head_dim, DTYPE, DEVICE, gen)
    chunks = []
    for q, k, v, start in seqs:
        table = cache.table(q.shape[0])
        cache.write(table, 0, k, v)
        chunks.append((q[start:], start, table))
    return step(attn, cache, chunks, head_dim ** -0.5, sliding_window=window, **kw)


def _random_seq(shape, gen, cuda_gen):
    """1..MAX_LEN tokens; the step is a decode (last token) half the time, else a chunk from a random start."""
    n = int(torch.randint(1, MAX_LEN + 1, (1,), generator=gen))
    start = n - 1 if torch.rand(1, generator=gen) < 0.5 else int(torch.randint(0, n, (1,), generator=gen))
    return (*_seq(n, shape, cuda_gen), start)


ROWS = [None, 16]  # the spec's attention.q_rows: the kernel's 64 (wgmma) and 16 (mma.sync)


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("rows", ROWS, ids=lambda r: f"rows{r or 64}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"H{s[0]}-Hkv{s[1]}-D{s[2]}")
def test_alone_equals_batch(shape, rows, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "attn", partial(attn, block_m=rows))
    gen, cuda_gen = torch.Generator().manual_seed(0), torch.Generator(DEVICE).manual_seed(0)
    for trial in range(TRIALS):
        window = WINDOWS[trial]
        probe = _random_seq(shape, gen, cuda_gen)
        alone = _batch([probe], gen, window, split_kv=False)[0]
        assert torch.equal(_batch([probe], gen, window, split_kv=True)[0], alone), "split-KV != in-register"
        _close(alone, _reference(probe[0][probe[3]:], probe[1], probe[2], probe[3], window))
        num_others = int(torch.randint(1, MAX_SEQS, (1,), generator=gen))
        others = [_random_seq(shape, gen, cuda_gen) for _ in range(num_others)]
        at = int(torch.randint(0, len(others) + 1, (1,), generator=gen))
        batch = others[:at] + [probe] + others[at:]
        first = _batch(batch, gen, window)
        assert torch.equal(first[at], alone), (trial, len(batch), probe[0].shape[0], probe[3])
        again = _batch(batch, gen, window)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), "not deterministic run to run"
        if sum(q.shape[0] - s for q, _, _, s in batch) <= 4096:
            assert torch.equal(_batch(batch, gen, window, split_kv=True)[at], alone)


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("rows", ROWS, ids=lambda r: f"rows{r or 64}")
@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"H{s[0]}-Hkv{s[1]}-D{s[2]}")
def test_prefill_equals_chunks_equals_decode(shape, window, rows, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "attn", partial(attn, block_m=rows))
    gen, cuda_gen = torch.Generator().manual_seed(1), torch.Generator(DEVICE).manual_seed(1)
    q, k, v = _seq(PHASE_LEN, shape, cuda_gen)
    scale = shape[2] ** -0.5

    def run(sizes, **kw):
        cache = PagedCache(-(-PHASE_LEN // 16) + 9, shape[1], shape[2], DTYPE, DEVICE, gen)
        return phases(attn, q, k, v, sizes, cache, scale, sliding_window=window, **kw)

    whole = run([PHASE_LEN])
    _close(whole, _reference(q, k, v, 0, window))
    prefix = 3 * PHASE_LEN // 7
    runs = {"prefill split-KV": run([PHASE_LEN], split_kv=True), "decode": run([1] * PHASE_LEN),
            f"prefix {prefix} + decode": run([prefix] + [1] * (PHASE_LEN - prefix))}
    for size in (7, 64, 512):
        runs[f"chunks of {size}"] = run(chunked(PHASE_LEN, size))
        runs[f"chunks of {size}, in-register"] = run(chunked(PHASE_LEN, size), split_kv=False)
    for name, out in runs.items():
        differ = (out != whole).any(dim=(1, 2)).nonzero().flatten().tolist()
        assert not differ, f"{name}: tokens {differ[:10]} differ from the whole prefill"


PROGRAM_SHAPES = [*SHAPES, (8, 4, 64), (32, 2, 128), (32, 1, 128)]  # groups 2, 8, 2 (D 64), 16, 32


def _program_runner(shape, window=None, kv=None):
    """run(sizes, **kw): one PHASE_LEN-token sequence through steps of `sizes` tokens over a fresh paged
    cache (FP8 with kv=FP8_KV), every step's outputs concatenated."""
    gen, cuda_gen = torch.Generator().manual_seed(3), torch.Generator(DEVICE).manual_seed(3)
    q, k, v = _seq(PHASE_LEN, shape, cuda_gen)

    def run(sizes, **kw):
        cache = PagedCache(-(-PHASE_LEN // 16) + 9, shape[1], shape[2], DTYPE, DEVICE, gen, kv=kv)
        return phases(attn, q, k, v, sizes, cache, shape[2] ** -0.5, sliding_window=window, **kw)
    return run


@pytest.mark.parametrize("kv", [None, "fp8"], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("shape", PROGRAM_SHAPES, ids=lambda s: f"H{s[0]}-Hkv{s[1]}-D{s[2]}")
def test_decode_program_equals_64_row_program(shape, window, kv):
    """The 16-row one-warp decode program (mma.sync) gives each query the bits of the 64-row four-warp
    program (wgmma), in every phase and both launches: prefill, chunks and decode run by either program
    all equal the 64-row whole prefill; over a BF16 cache and over an FP8 one; the decode program reading
    its block table by inline asm (attention.TABLE_LOAD_ASM) and by tl.load, and the 64-row program by tl.load
    against its own inline-asm whole prefill (the default over a BF16 cache)."""
    from onepath.numerics.spec import FP8_KV
    run = _program_runner(shape, window, FP8_KV if kv else None)

    whole = run([PHASE_LEN], decode_program=False)
    prefix = 3 * PHASE_LEN // 7
    for name, sizes in (("prefill", [PHASE_LEN]), ("chunks of 7", chunked(PHASE_LEN, 7)),
                        ("decode", [1] * PHASE_LEN), (f"prefix {prefix} + decode", [prefix] + [1] * (PHASE_LEN - prefix))):
        for split in (False, True):
            for program, table_asm in ([(None, None), (True, True), (True, False), (False, None), (False, False)]
                                       if name == "decode" else [(True, True), (True, False), (False, False)]):
                out = run(sizes, split_kv=split, decode_program=program, table_asm=table_asm)
                differ = (out != whole).any(dim=(1, 2)).nonzero().flatten().tolist()
                assert not differ, (f"{name}, split {split}, decode program {program}, table by asm {table_asm}: "
                                    f"tokens {differ[:10]} differ")


@pytest.mark.parametrize("kv", [None, "fp8"], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("warps", [8, 4])
@pytest.mark.parametrize("shape", [SHAPES[0], (8, 8, 128)], ids=lambda s: f"H{s[0]}-Hkv{s[1]}-D{s[2]}")
def test_programs_spanning_tiles_equal_64_row_program(shape, warps, kv):
    """A 128-row program whose positions span several 32-key tiles (q_block = 128 rows / group: 64 positions
    at Qwen3-0.6B's group of 2, 128 at 1) gives each query the default 64-row program's bits in prefill and
    chunks, both launches, over BF16 and FP8 caches: on 8 warps (two warpgroups, each one m64 wgmma per
    row block) and on 4 (one warpgroup, two m64 blocks). Control: the same program with 64-key tiles (another
    reduction tree) differs, so the comparison sees a change of bits."""
    from onepath.numerics.spec import FP8_KV
    run = _program_runner(shape, None, FP8_KV if kv else None)
    whole = run([PHASE_LEN], decode_program=False)
    q_block = 128 // (shape[0] // shape[1])
    for name, sizes in (("prefill", [PHASE_LEN]), ("chunks of 7", chunked(PHASE_LEN, 7)),
                        ("chunks of 64", chunked(PHASE_LEN, 64))):
        for split in (False, True):
            out = run(sizes, split_kv=split, block_m=128, num_warps=warps, q_block=q_block)
            differ = (out != whole).any(dim=(1, 2)).nonzero().flatten().tolist()
            assert not differ, f"{name}, split {split}: tokens {differ[:10]} differ from the 64-row prefill"
    assert not torch.equal(run([PHASE_LEN], block_m=128, num_warps=warps, q_block=q_block, kv_tile=64), whole)


@pytest.mark.parametrize("kv", [None, "fp8"], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("shape", PROGRAM_SHAPES[:3], ids=lambda s: f"H{s[0]}-Hkv{s[1]}-D{s[2]}")
def test_unmasked_interior_tiles_equal_every_tile_masked(shape, window, kv, monkeypatch):
    """The in-register launch of the 64-row program runs tiles inside every row's key range without masks
    (UNMASKED_INTERIOR): each query keeps the bits it has when every tile is masked, in prefill, chunks and
    decode, with and without a window, over BF16 and FP8 caches (the decode program and split-KV launches keep
    one masked loop). Control: 64-key tiles (another reduction tree) differ from the masked reference, so the
    comparison sees a change of bits."""
    from onepath.numerics.spec import FP8_KV
    run = _program_runner(shape, window, FP8_KV if kv else None)
    prefix = 3 * PHASE_LEN // 7
    cases = {"prefill": [PHASE_LEN], "chunks of 7": chunked(PHASE_LEN, 7), "chunks of 64": chunked(PHASE_LEN, 64),
             f"prefix {prefix} + decode": [prefix] + [1] * (PHASE_LEN - prefix)}
    monkeypatch.setattr(A, "UNMASKED_INTERIOR", False)
    masked = {name: run(sizes, split_kv=False, decode_program=False) for name, sizes in cases.items()}
    assert not torch.equal(run([PHASE_LEN], split_kv=False, decode_program=False, kv_tile=64), masked["prefill"])
    monkeypatch.setattr(A, "UNMASKED_INTERIOR", True)
    for name, sizes in cases.items():
        out = run(sizes, split_kv=False, decode_program=False)
        differ = (out != masked[name]).any(dim=(1, 2)).nonzero().flatten().tolist()
        assert not differ, f"{name}: tokens {differ[:10]} differ from every tile masked"


def test_deep_decode_launch_equals_other_launches():
    """A decode batch whose grid runs the BF16 decode program deep (attention.launch_plan: 3-5 programs per SM,
    in-register at DEEP_DECODE_NUM_STAGES) gives every query the bits of the split-KV launch, of the in-register
    launch at DECODE_NUM_STAGES and of the 64-row program: 4 programs per SM of decodes over 1..3000 cached
    tokens, other block tables each run. Control: kv_split 128 (another reduction tree) moves bits on the same
    batch."""
    shape = SHAPES[0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = -(-4 * sms // shape[1])
    assert A.launch_plan(batch * shape[1], sms, MAX_LEN // 256 + 1, True, False) == (False, A.DEEP_DECODE_NUM_STAGES)
    gen, cuda_gen = torch.Generator().manual_seed(11), torch.Generator(DEVICE).manual_seed(11)
    seqs = []
    for _ in range(batch):
        n = int(torch.randint(1, MAX_LEN + 1, (1,), generator=gen))
        seqs.append((*_seq(n, shape, cuda_gen), n - 1))
    run = lambda **kw: _batch(seqs, gen, None, **kw)  # each run draws fresh block tables
    deep = run()
    for kw in (dict(split_kv=True), dict(split_kv=False, num_stages=A.DECODE_NUM_STAGES),
               dict(decode_program=False)):
        out = run(**kw)
        assert all(torch.equal(a, b) for a, b in zip(out, deep)), f"{kw}: other bits than the deep launch"
    assert not all(torch.equal(a, b) for a, b in zip(run(kv_split=128), deep)), "kv_split 128: control failed"


def test_negative_control_16_rows_on_two_warps():
    """The decode program's equality is a property of its layout, not of any 16-row program: 16 rows on
    two warps split the key columns between the warps, and decode then differs from the 64-row prefill."""
    run = _program_runner(SHAPES[0])
    whole = run([PHASE_LEN], decode_program=False)
    assert not torch.equal(run([1] * PHASE_LEN, block_m=16, num_warps=2), whole)


def test_negative_control_fp8_tiles_without_the_barrier(monkeypatch):
    """Over an FP8 cache with FP32 scales the equality rests on `_opaque`: without it Triton gives the one-warp
    program's mma.sync operands kWidth 4 (behind the 8-bit loads), and its decode differs from the 64-row
    prefill. (FP8_KV's power-of-two scales dequantise through `_e4m3_pow2_to_bf16`, whose asm is the barrier.)"""
    from onepath.numerics.spec import FP8_KV
    run = _program_runner(SHAPES[0], kv=replace(FP8_KV, scale_dtype="fp32", amax_ceil=None))
    whole = run([PHASE_LEN], decode_program=False)
    assert torch.equal(run([1] * PHASE_LEN, decode_program=True), whole)
    monkeypatch.setattr(A, "OPAQUE_FP8_TILES", False)
    assert torch.equal(run([PHASE_LEN], decode_program=False), whole)  # wgmma reads B from shared memory
    assert not torch.equal(run([1] * PHASE_LEN, decode_program=True), whole)


@triton.jit
def _dequantize_rows(codes_ptr, scales_ptr, out_ptr, ROWS: tl.constexpr):
    """Rows of 256 FP8 codes times each row's scale, by the attention kernel's power-of-two dequantisation."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, 256)
    codes = tl.load(codes_ptr + rows[:, None] * 256 + cols[None, :])
    out = A._dequantize(codes, tl.load(scales_ptr + rows), True, A.KV_FP8_POW2, tl.bfloat16)
    tl.store(out_ptr + rows[:, None] * 256 + cols[None, :], out)


def test_pow2_dequantisation_equals_the_fp32_product_for_every_code():
    """`_e4m3_pow2_to_bf16` (bit placement, one BF16 multiply by 2^120 * scale) gives (code * scale) in FP32
    rounded once to BF16, bit for bit, for every E4M3 code the quantiser writes (all but the two NaN codes) and
    every power-of-two scale FP8_KV can produce, 2^-126..2^7, plus scale 0 (a masked key). Controls: a scale that
    is not a power of two, 1 + 2^-8 (its BF16 factor rounds to 1, where the FP32 product rounds a code with mantissa
    bits up), and 2^8 (the factor overflows) give other values."""
    def run(scales):
        rows = -(-len(scales) // 16) * 16
        scales = torch.tensor(scales + [0.0] * (rows - len(scales)), device=DEVICE)
        codes = torch.arange(256, device=DEVICE, dtype=torch.uint8).repeat(rows, 1).view(torch.float8_e4m3fn)
        out = torch.empty(rows, 256, device=DEVICE, dtype=torch.bfloat16)
        _dequantize_rows[(rows // 16,)](codes, scales, out, ROWS=16, num_warps=1)
        want = (codes.float() * scales[:, None]).to(torch.bfloat16)
        real = torch.ones(256, dtype=torch.bool, device=DEVICE)
        real[[0x7F, 0xFF]] = False                                  # E4M3's NaN codes: never written
        return out[:, real].view(torch.int16), want[:, real].view(torch.int16)

    got, want = run([2.0 ** e for e in range(-126, 8)] + [0.0])
    assert torch.equal(got, want), f"{int((got != want).sum())} values differ"
    for scale in (1.0 + 2.0 ** -8, 2.0 ** 8):
        got, want = run([scale])
        assert not torch.equal(got[0], want[0]), scale


@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("shape", PROGRAM_SHAPES[:3], ids=lambda s: f"H{s[0]}-Hkv{s[1]}-D{s[2]}")
def test_fp8_kv_pow2_path_equals_fp32_product_path(shape, window):
    """A cache written by FP8_KV's rule (power-of-two scales, at most 2^7) is read through
    `_e4m3_pow2_to_bf16`; every query gets the bits the FP32-product path gives on the same cache (its rule
    taken away), in prefill, chunks of 7 and decode, both launches, both programs. Control: a cache written
    with FP32 scales but labelled FP8_KV (so read by the power-of-two path) differs from its FP32-product read."""
    from onepath.numerics.spec import FP8_KV

    def fp32_path(q, k, v, *args, **kw):
        return attn(q, replace(k, rule=None), replace(v, rule=None), *args, **kw)

    gen, cuda_gen = torch.Generator().manual_seed(4), torch.Generator(DEVICE).manual_seed(4)
    q, k, v = _seq(PHASE_LEN, shape, cuda_gen)

    def run(sizes, attend, kv=FP8_KV, label=None, **kw):
        cache = PagedCache(-(-PHASE_LEN // 16) + 9, shape[1], shape[2], DTYPE, DEVICE, gen, kv=kv)
        if label is not None:
            cache.k, cache.v = replace(cache.k, rule=label), replace(cache.v, rule=label)
        return phases(attend, q, k, v, sizes, cache, shape[2] ** -0.5, sliding_window=window, **kw)

    for name, sizes in (("prefill", [PHASE_LEN]), ("chunks of 7", chunked(PHASE_LEN, 7)), ("decode", [1] * PHASE_LEN)):
        for split in (False, True):
            for program in ((True, False) if name == "decode" else (False,)):
                fast = run(sizes, attn, split_kv=split, decode_program=program)
                exact = run(sizes, fp32_path, split_kv=split, decode_program=program)
                differ = (fast != exact).any(dim=(1, 2)).nonzero().flatten().tolist()
                assert not differ, f"{name}, split {split}, decode program {program}: tokens {differ[:10]} differ"
    fp32_scales = replace(FP8_KV, scale_dtype="fp32", amax_ceil=None)
    assert not torch.equal(run([PHASE_LEN], attn, fp32_scales, label=FP8_KV),
                           run([PHASE_LEN], fp32_path, fp32_scales, label=FP8_KV))


def _sdpa_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    group = q.shape[1] // k.shape[1]
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)[0].transpose(0, 1)


def _split_kv_decode(q, k, v, num_splits):
    """FP32 decode of one query over all keys in num_splits equal pieces, merged by their softmax weights."""
    group = q.shape[0] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    m, l, acc = [], [], []
    for piece in torch.tensor_split(torch.arange(k.shape[0], device=q.device), num_splits):
        s = torch.einsum("hd,khd->hk", q.float(), k[piece]) * q.shape[1] ** -0.5
        m.append(s.amax(-1))
        e = torch.exp(s - m[-1][:, None])
        l.append(e.sum(-1))
        acc.append(torch.einsum("hk,khd->hd", e, v[piece]))
    m_all = torch.stack(m).amax(0)
    w = [torch.exp(mi - m_all) for mi in m]
    return sum(wi[:, None] * a for wi, a in zip(w, acc)) / sum(wi * li for wi, li in zip(w, l))[:, None]


@pytest.mark.gpu_smoke
def test_negative_controls():
    """The properties above are not free: SDPA flash gives the last token other bits in prefill than
    in decode, and a split count chosen from the batch (many splits for 1 sequence, few for 32) moves bits."""
    cuda_gen = torch.Generator(DEVICE).manual_seed(2)
    flash_differs = []
    for shape in SHAPES:
        for n in (100, 700, 1500, 3000):
            q, k, v = _seq(n, shape, cuda_gen)
            prefill_last = _sdpa_flash(q, k, v, causal=True)[-1]
            decode = _sdpa_flash(q[-1:], k, v, causal=False)[0]
            flash_differs.append(not torch.equal(prefill_last, decode))
    assert any(flash_differs), "SDPA flash prefill last row == decode in every case: control failed"
    q, k, v = _seq(3000, SHAPES[0], cuda_gen)
    assert not torch.equal(_split_kv_decode(q[-1], k, v, 16), _split_kv_decode(q[-1], k, v, 1))
