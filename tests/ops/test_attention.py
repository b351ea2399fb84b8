import pytest
import torch

from onepath.models.batch import ForwardBatch, SeqChunk
from onepath.numerics.quant import FP8Tensor, quantize_fp8
from onepath.numerics.spec import FP8_KV
from onepath.ops import attention as A
from tests.ops.test_attention_interpret import causal_reference, chunked

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 24, 16   # GQA group of 3; head_dim not a power of two
SCALE = HEAD_DIM ** -0.5


def _qkv(n, gen):
    return (torch.randn(n, HEADS, HEAD_DIM, generator=gen), torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen),
            torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen))


def _caches(num_blocks):
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return torch.zeros(shape), torch.zeros(shape)


def _step(spec, chunks, q, k, v, caches, window=None):
    meta = ForwardBatch.build(chunks, BLOCK).attn
    return A.attention(spec, q, k, v, *caches, meta, SCALE, window)


def _one_step_batch(spec, seqs, gen, window=None):
    """seqs: (q, k, v, start) over a sequence's positions 0..len-1; its K/V before `start` are already
    cached, the rest is this step's chunk. Blocks are drawn at random from a shuffled pool, so block
    tables are non-contiguous and differ between calls. Returns each sequence's chunk output."""
    need = [-(-q.shape[0] // BLOCK) for q, *_ in seqs]
    pool = torch.randperm(sum(need) + 5, generator=gen).tolist()
    caches = _caches(len(pool))
    chunks = []
    for (q, k, v, start), n in zip(seqs, need):
        table, pool = pool[:n], pool[n:]
        j = torch.arange(start)
        A.write_kv(*caches, k[:start], v[:start], torch.tensor(table)[j // BLOCK] * BLOCK + j % BLOCK)
        chunks.append(SeqChunk([0] * (q.shape[0] - start), start, table))
    cat = lambda i: torch.cat([s[i][s[3]:] for s in seqs])
    out = _step(spec, chunks, cat(0), cat(1), cat(2), caches, window)
    return out.split([q.shape[0] - start for q, _, _, start in seqs])


def _phases(spec, q, k, v, sizes, gen, window=None):
    """One sequence run through successive engine steps of the given query lengths over one cache."""
    n = q.shape[0]
    num_blocks = -(-n // BLOCK)
    table = torch.randperm(num_blocks + 3, generator=gen)[:num_blocks].tolist()
    caches = _caches(num_blocks + 3)
    outs, pos = [], 0
    for size in sizes:
        s = slice(pos, pos + size)
        outs.append(_step(spec, [SeqChunk([0] * size, pos, table)], q[s], k[s], v[s], caches, window))
        pos += size
    assert pos == n
    return torch.cat(outs)


def _batch_drift(spec, gen, trials, decode_share):
    """Largest |probe inside a batch - probe alone| over random batches of 2..16 other sequences of
    1..70 tokens, the probe at a random index. Each sequence (the probe too) is a decode step (one token
    over a cached prefix) with probability `decode_share`, else a chunk from a random start."""
    def start(n):
        return n - 1 if torch.rand(1, generator=gen) < decode_share else int(torch.randint(0, n, (1,), generator=gen))

    worst = 0.0
    for _ in range(trials):
        n = int(torch.randint(2, 71, (1,), generator=gen))
        probe = (*_qkv(n, gen), start(n))
        alone = _one_step_batch(spec, [probe], gen)[0]
        others = []
        for _ in range(int(torch.randint(2, 17, (1,), generator=gen))):
            m = int(torch.randint(1, 71, (1,), generator=gen))
            others.append((*_qkv(m, gen), start(m)))
        at = int(torch.randint(0, len(others) + 1, (1,), generator=gen))
        inside = _one_step_batch(spec, others[:at] + [probe] + others[at:], gen)[at]
        if spec.mode == "consistent":
            assert torch.equal(inside, alone), f"probe len {n} start {probe[3]} at {at} of {len(others) + 1}"
        worst = max(worst, (inside - alone).abs().max().item())
    return worst


def test_batch_invariant_with_negative_control(consistent, baseline, gen):
    assert _batch_drift(consistent, gen, trials=10, decode_share=0.5) == 0.0
    # baseline pads decode queries to the batch's longest context in one batched matmul + softmax
    assert _batch_drift(baseline, gen, trials=4, decode_share=1.0) > 0.0


@pytest.mark.parametrize("window", [None, 20])
def test_phase_consistent_with_negative_control(consistent, baseline, gen, window):
    n = 70   # spans several KV tiles and blocks, ends mid-block
    q, k, v = _qkv(n, gen)
    phases = {"decode": [45] + [1] * (n - 45), **{f"chunk {c}": chunked(n, c) for c in (1, 7, 64)}}
    prefill = _phases(consistent, q, k, v, [n], gen, window)
    for name, sizes in phases.items():
        assert torch.equal(_phases(consistent, q, k, v, sizes, gen, window), prefill), f"{name} (window {window})"
    # baseline: SDPA prefill vs the matmul decode path of the stock backend
    assert not torch.equal(_phases(baseline, q, k, v, phases["decode"], gen, window),
                           _phases(baseline, q, k, v, [n], gen, window))


@pytest.mark.parametrize("window", [None, 1, 20])
def test_values_close_to_float64_reference(consistent, gen, window):
    seqs = [(*_qkv(n, gen), start) for n, start in ((1, 0), (37, 0), (70, 29), (45, 44))]
    outs = _one_step_batch(consistent, seqs, gen, window)
    for (q, k, v, start), out in zip(seqs, outs):
        # FP32 dot products of 24 terms and a softmax over <= 70 keys: errors ~1e-6 on O(1) outputs
        torch.testing.assert_close(out.double(), causal_reference(q, k, v, SCALE, window)[start:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 1, 20])
def test_baseline_mixed_step_values(baseline, gen, window):
    """The stock path on a continuous-batching step: fresh prompts (one padded SDPA call, here three of
    them between the others), a chunk over a cached prefix, decode tokens: every row's value is right."""
    seqs = [(*_qkv(n, gen), start) for n, start in ((37, 0), (70, 29), (1, 0), (45, 44), (12, 0), (60, 59))]
    outs = _one_step_batch(baseline, seqs, gen, window)
    for (q, k, v, start), out in zip(seqs, outs):
        torch.testing.assert_close(out.double(), causal_reference(q, k, v, SCALE, window)[start:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_gradient_is_plain_math(consistent, gen, window):
    lengths = [1, 17, 40]
    batch, num_blocks = ForwardBatch.for_sequences([[0] * n for n in lengths], BLOCK)
    q, k, v = (t.requires_grad_() for t in _qkv(sum(lengths), gen))
    g = torch.randn(sum(lengths), HEADS, HEAD_DIM, generator=gen)
    A.attention(consistent, q, k, v, *_caches(num_blocks), batch.attn, SCALE, window).backward(g)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    bounds = batch.attn.cu_seqlens
    expected = torch.cat([causal_reference(q2[s:e], k2[s:e], v2[s:e], SCALE, window) for s, e in zip(bounds, bounds[1:])])
    expected.backward(g.double())
    for got, want in zip((q.grad, k.grad, v.grad), (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_backward_refuses_a_cached_prefix(consistent, gen):
    q, k, v = (t.requires_grad_() for t in _qkv(10, gen))
    out = _one_step_batch(consistent, [(q, k, v, 4)], gen)[0]
    with pytest.raises(RuntimeError, match="whole sequences"):
        out.sum().backward()


def test_padded_sdpa_equals_plain_math_and_its_gradient(gen):
    """The stock path for whole sequences (baseline prefill, the GPU backward): one right-padded causal
    SDPA call; padding must change no valid row, forward or backward."""
    lengths = [5, 1, 33, 18]
    batch, _ = ForwardBatch.for_sequences([[0] * n for n in lengths], BLOCK)
    q, k, v = (t.double().requires_grad_() for t in _qkv(sum(lengths), gen))
    out = A.padded_sdpa(q, k, v, batch.attn, SCALE)
    bounds = batch.attn.cu_seqlens
    expected = torch.cat([causal_reference(q[s:e], k[s:e], v[s:e], SCALE, None) for s, e in zip(bounds, bounds[1:])])
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(expected, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _fp8_caches(num_blocks):
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return tuple(FP8Tensor(torch.zeros(shape, dtype=torch.float8_e4m3fn), torch.zeros(*shape[:3], 1), (1, HEAD_DIM))
                 for _ in range(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 9])
def test_fp8_cache_reads_as_the_cache_of_its_dequantised_values(consistent, gen, dtype, window):
    """A chunk over a cached prefix: attention over the FP8 cache == attention over a cache of q's dtype
    holding (code.float() * scale).to(dtype), bit for bit; and != the unquantised cache."""
    fp8 = consistent.with_quant("fp8_kv")
    n, start = 40, 23
    q, k, v = (t.to(dtype) for t in _qkv(n, gen))
    table = [3, 0, 2]
    slots = lambda j: torch.tensor(table)[j // BLOCK] * BLOCK + j % BLOCK
    caches = _fp8_caches(4)
    A.write_kv(*caches, k[:start], v[:start], slots(torch.arange(start)), FP8_KV)
    chunk = [SeqChunk([0] * (n - start), start, table)]
    out = _step(fp8, chunk, q[start:], k[start:], v[start:], caches, window)
    assert isinstance(caches[0], FP8Tensor) and caches[0].scales[3, 0, 0, 0] > 0
    dq = lambda x: quantize_fp8(x, FP8_KV).dequantize(dtype)
    plain = tuple(c.dequantize(dtype) for c in caches)
    assert torch.equal(out, _step(consistent, chunk, q[start:], dq(k[start:]), dq(v[start:]), plain, window))
    unquantised = tuple(torch.zeros(c.codes.shape, dtype=dtype) for c in caches)
    A.write_kv(*unquantised, k[:start], v[:start], slots(torch.arange(start)))
    assert not torch.equal(out, _step(consistent, chunk, q[start:], k[start:], v[start:], unquantised, window))


def test_fp8_cache_gradient_is_straight_through(consistent, gen):
    """The backward differentiates attention over the fresh K/V: the same gradient as an unquantised cache."""
    lengths = [1, 17, 30]
    batch, num_blocks = ForwardBatch.for_sequences([[0] * n for n in lengths], BLOCK)
    g = torch.randn(sum(lengths), HEADS, HEAD_DIM, generator=gen)
    qkv = _qkv(sum(lengths), gen)
    grads = []
    for spec, caches in ((consistent.with_quant("fp8_kv"), _fp8_caches(num_blocks)), (consistent, _caches(num_blocks))):
        leaves = [t.clone().requires_grad_() for t in qkv]
        A.attention(spec, *leaves, *caches, batch.attn, SCALE).backward(g)
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
