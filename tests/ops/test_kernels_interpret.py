"""onepath.ops.cuda.{rmsnorm, elementwise, logprobs} run by Triton's CPU interpreter (TRITON_INTERPRET=1).

The interpreter must be on before the kernels are decorated, so the checks run in a subprocess: this
file, run as a script, prints one JSON line of results that the tests below assert on. Tiny shapes
that still cross a chunk boundary (H > BLOCK_H, V > BLOCK_V). What this proves is the kernels'
logic (chunk walk, masks, the one rounding, keep, rows never mixing); the bits of Hopper's
exp/log and reduction trees are tests/gpu/test_norm_elementwise_logprobs_gpu.py's job.
"""
from __future__ import annotations

from tests.interpret import check_recorder, interpreted_checks, patch_bf16_rounding, print_checks

CHECKS = ["rmsnorm_values", "rmsnorm_rows_alone_equal_rows_in_batch", "rmsnorm_residual", "rmsnorm_misaligned_input",
          "silu_mul_values", "silu_mul_rows_alone_equal_rows_in_batch", "rope_equals_reference",
          "rope_rows_alone_equal_rows_in_batch", "qk_norm_rope_equals_norm_then_rope", "write_kv_equals_index_put",
          "logprobs_values", "logprobs_rows_alone_equal_rows_in_batch",
          "logprobs_keep_none_equals_all_kept", "probs_values", "probs_rows_alone_equal_rows_in_batch",
          "sample_equals_torch_race", "sample_rows_alone_equal_rows_in_batch", "sample_sparse_row_equals_torch_race"]


def _patch_libdevice_log1p():
    """The interpreter has no libdevice: give the sampler's log1p numpy's (the GPU's is libdevice's)."""
    import types

    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    from onepath.ops.cuda import sampling

    def log1p(x):
        return tl.tensor(TensorHandle(np.log1p(x.handle.data), x.handle.dtype.scalar), x.type)

    sampling.libdevice = types.SimpleNamespace(log1p=log1p)


def _run_checks() -> dict:
    patch_bf16_rounding()
    _patch_libdevice_log1p()
    import math

    import torch

    from onepath.ops import logprobs as LP
    from onepath.ops import rmsnorm as RN
    from onepath.ops import rope as RP
    from onepath.ops import silu_mul as SM
    from onepath.ops import sampling as SA
    from onepath.ops.cuda import elementwise, logprobs, rmsnorm
    from onepath.ops.cuda import sampling

    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()

    def rand(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def close(a, b, **tol):
        try:
            torch.testing.assert_close(a, b, **tol)
            return True, ""
        except AssertionError as e:
            return False, str(e).splitlines()[-1]

    def embedded(probe, m, make):
        """A random batch of m rows (from make) with probe's rows at a random position."""
        batch = make(m + probe.shape[0] - 1)
        pos = int(torch.randint(m, (1,), generator=gen))
        batch[pos:pos + probe.shape[0]] = probe
        return batch, pos

    # rmsnorm: H = 1030 walks a full 1024 chunk and a masked 6-wide tail.
    for dtype in (torch.bfloat16, torch.float32):
        for h in (40, 1030):
            x, w = rand(5, h, dtype=dtype, scale=3), rand(h, dtype=dtype)
            ok, why = close(rmsnorm.rmsnorm(x, w, 1e-6), RN.reference(x, w, 1e-6))
            record("rmsnorm_values", ok, f"{dtype} H={h}: {why}")
    h = 1030
    w = rand(h)
    probe = rand(1, h, scale=3)
    alone = rmsnorm.rmsnorm(probe, w, 1e-5)
    for m in (1, 2, 3, 7):
        batch, pos = embedded(probe, m, lambda n: rand(n, h, scale=3))
        record("rmsnorm_rows_alone_equal_rows_in_batch", torch.equal(rmsnorm.rmsnorm(batch, w, 1e-5)[pos], alone[0]),
               f"M={m} pos={pos}")
    x, r = rand(4, h, scale=2), rand(4, h, scale=2)
    normed, summed = rmsnorm.rmsnorm_residual(x, r, w, 1e-5)
    record("rmsnorm_residual", torch.equal(summed, x + r), "new residual != x + residual")
    record("rmsnorm_residual", torch.equal(normed, rmsnorm.rmsnorm(x + r, w, 1e-5)), "normed != rmsnorm(x + residual)")
    x3 = rand(2, 3, h)
    flat_out = rmsnorm.rmsnorm(x3.reshape(6, h), w, 1e-5)
    record("rmsnorm_residual", torch.equal(rmsnorm.rmsnorm(x3, w, 1e-5).reshape(6, h), flat_out), "leading dims")
    # A view one element off 16-byte alignment (and odd H) takes aligned_rows' copy: same bits.
    for hh in (1030, 37):
        ww = rand(hh)
        flat = rand(1 + 3 * hh)
        odd = flat[1:].view(3, hh)
        same = torch.equal(rmsnorm.rmsnorm(odd, ww, 1e-5), rmsnorm.rmsnorm(odd.clone(), ww, 1e-5))
        record("rmsnorm_misaligned_input", same, f"H={hh}")

    # silu_mul: I = 1100 crosses a BLOCK_I; gate/up as views of one fused projection.
    width = 1100
    fused = rand(6, 2 * width, scale=4)
    gate, up = fused[:, :width], fused[:, width:]
    ok, why = close(elementwise.silu_mul(gate, up), SM.reference(gate, up))
    record("silu_mul_values", ok, why)
    copies = elementwise.silu_mul(gate.contiguous(), up.contiguous())
    record("silu_mul_values", torch.equal(elementwise.silu_mul(gate, up), copies), "views vs contiguous")
    probe = rand(1, 2 * width, scale=4)
    alone = elementwise.silu_mul(probe[:, :width], probe[:, width:])
    for m in (1, 2, 7):
        batch, pos = embedded(probe, m, lambda n: rand(n, 2 * width, scale=4))
        got = elementwise.silu_mul(batch[:, :width], batch[:, width:])[pos]
        record("silu_mul_rows_alone_equal_rows_in_batch", torch.equal(got, alone[0]), f"M={m} pos={pos}")

    # rope: 5 heads (a partial head block), D = 24 (half 12, a partial power of two); q as a view of qkv.
    heads, dim, positions_max = 5, 24, 64
    cos, sin = torch.randn(positions_max, dim // 2, generator=gen), torch.randn(positions_max, dim // 2, generator=gen)
    qkv = rand(9, heads + 2, dim, scale=2)
    q = qkv[:, :heads]
    pos = torch.randint(0, positions_max, (9,), generator=gen)
    same = torch.equal(elementwise.rope(q, pos, cos, sin), RP.reference(q, cos[pos], sin[pos]))
    record("rope_equals_reference", same, "bf16 rope != torch eager's unfused arithmetic")
    qf = rand(4, heads, dim, dtype=torch.float32)
    pf = torch.randint(0, positions_max, (4,), generator=gen)
    same = torch.equal(elementwise.rope(qf, pf, cos, sin), RP.reference(qf, cos[pf], sin[pf]))
    record("rope_equals_reference", same, "fp32")
    probe, probe_pos = rand(1, heads, dim, scale=2), torch.tensor([17])
    alone = elementwise.rope(probe, probe_pos, cos, sin)
    for m in (1, 2, 7):
        batch, at = embedded(probe, m, lambda n: rand(n, heads, dim, scale=2))
        positions = torch.randint(0, positions_max, (m,), generator=gen)
        positions[at] = 17
        same = torch.equal(elementwise.rope(batch, positions, cos, sin)[at], alone[0])
        record("rope_rows_alone_equal_rows_in_batch", same, f"M={m} pos={at}")

    # qk_norm_rope: 3 q heads and 2 k heads of a stacked qkv view (v's 2 heads after them), D = 24; the
    # bits of rmsnorm then rope, each part by its own weight; a token alone equals it in a batch.
    wq, wk = rand(dim, scale=0.5) + 1, rand(dim, scale=0.5) + 1
    qkv = rand(7, 7, dim, scale=3)
    qk, pos = qkv[:, :5], torch.randint(0, positions_max, (7,), generator=gen)
    fused = rmsnorm.qk_norm_rope(qk, wq, wk, 3, 1e-6, pos, cos, sin)
    parts = [elementwise.rope(rmsnorm.rmsnorm(qk[:, :3], wq, 1e-6), pos, cos, sin),
             elementwise.rope(rmsnorm.rmsnorm(qk[:, 3:], wk, 1e-6), pos, cos, sin)]
    record("qk_norm_rope_equals_norm_then_rope", torch.equal(fused, torch.cat(parts, dim=1)), "fused != two ops")
    swapped = rmsnorm.qk_norm_rope(qk, wk, wq, 3, 1e-6, pos, cos, sin)
    record("qk_norm_rope_equals_norm_then_rope", not torch.equal(swapped, fused), "the weights are not read")
    alone = rmsnorm.qk_norm_rope(qk[4:5].clone(), wq, wk, 3, 1e-6, pos[4:5], cos, sin)
    record("qk_norm_rope_equals_norm_then_rope", torch.equal(alone[0], fused[4]), "a token alone != in its batch")

    # write_kv: k and v as strided views of a stacked projection, 3 KV heads of D = 24, 6 tokens to scattered slots.
    kv = rand(6, 7, dim)
    k, v = kv[:, 1:4], kv[:, 4:7]
    slots = torch.tensor([5, 0, 17, 9, 30, 2])
    caches = [torch.zeros(4, 8, 3, dim, dtype=torch.bfloat16) for _ in range(4)]
    elementwise.write_kv(caches[0], caches[1], k, v, slots)
    for cache, x in ((caches[2], k), (caches[3], v)):
        cache.view(-1, 3, dim)[slots] = x
    record("write_kv_equals_index_put", torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]),
           "caches differ from index_put's")

    # token_logprobs / probs: V = 5000 walks a full 4096 chunk and a masked tail.
    def plain(lg, tok, temp, keep):
        x = (lg.double() / temp.double()[:, None]).masked_fill(~keep, -math.inf)
        logp = torch.log_softmax(x, dim=-1)
        ent = -(logp.exp() * logp.masked_fill(~keep, 0.0)).sum(-1)
        return logp.gather(-1, tok[:, None])[:, 0].float(), ent.float(), logp.exp().float()

    def batch_of(n, vocab, dtype=torch.bfloat16):
        lg = rand(n, vocab, dtype=dtype, scale=4)
        temp = 0.5 + torch.rand(n, generator=gen)
        keep = torch.rand(n, vocab, generator=gen) < 0.6
        tok = torch.multinomial(keep.float(), 1, generator=gen)[:, 0]
        return lg, tok, temp, keep

    for dtype in (torch.bfloat16, torch.float32):
        for vocab in (33, 5000):
            lg, tok, temp, keep = batch_of(4, vocab, dtype)
            keep[1] = True
            for k in (keep, None):
                kk = torch.ones_like(keep) if k is None else k
                want_lp, want_ent, want_p = plain(lg, tok, temp, kk)
                lp, ent = logprobs.token_logprobs(lg, tok, temp, k)
                ok, why = close(lp, want_lp, rtol=1e-5, atol=2e-5)
                record("logprobs_values", ok, f"logprob {dtype} V={vocab} keep={k is not None}: {why}")
                ok, why = close(ent, want_ent, rtol=1e-5, atol=2e-5)
                record("logprobs_values", ok, f"entropy {dtype} V={vocab} keep={k is not None}: {why}")
                ref_lp, ref_ent = LP.reference(lg, tok, temp, k)
                ok, why = close((lp, ent), (ref_lp, ref_ent), rtol=1e-5, atol=2e-5)
                record("logprobs_values", ok, f"vs reference {dtype} V={vocab} keep={k is not None}: {why}")
                ok, why = close(logprobs.probs(lg, temp, k), want_p, rtol=1e-5, atol=1e-7)
                record("probs_values", ok, f"{dtype} V={vocab} keep={k is not None}: {why}")
            outside = tok.clone()
            outside[0] = int((~keep[0]).nonzero()[0])
            record("logprobs_values", logprobs.token_logprobs(lg, outside, temp, keep)[0][0].item() == -math.inf,
                   "a token outside keep must get -inf")

    vocab = 5000
    p_lg, p_tok, p_temp, p_keep = batch_of(1, vocab)
    alone = logprobs.token_logprobs(p_lg, p_tok, p_temp, p_keep)
    alone_p = logprobs.probs(p_lg, p_temp, p_keep)
    for m in (1, 2, 7):
        lg, tok, temp, keep = batch_of(m, vocab)
        at = int(torch.randint(m, (1,), generator=gen))
        lg[at], tok[at], temp[at], keep[at] = p_lg[0], p_tok[0], p_temp[0], p_keep[0]
        lp, ent = logprobs.token_logprobs(lg, tok, temp, keep)
        same = torch.equal(lp[at], alone[0][0]) and torch.equal(ent[at], alone[1][0])
        record("logprobs_rows_alone_equal_rows_in_batch", same, f"M={m} pos={at}")
        record("probs_rows_alone_equal_rows_in_batch", torch.equal(logprobs.probs(lg, temp, keep)[at], alone_p[0]),
               f"M={m} pos={at}")
    # A row with no filter: alone with keep=None, in a batch whose other rows carry top-k/top-p masks.
    none_lp, none_ent = logprobs.token_logprobs(p_lg, p_tok, p_temp, None)
    none_p = logprobs.probs(p_lg, p_temp, None)
    for m in (1, 3):
        lg, tok, temp, keep = batch_of(m, vocab)
        at = m - 1
        lg[at], tok[at], temp[at], keep[at] = p_lg[0], p_tok[0], p_temp[0], True
        lp, ent = logprobs.token_logprobs(lg, tok, temp, keep)
        same = torch.equal(lp[at], none_lp[0]) and torch.equal(ent[at], none_ent[0])
        same = same and torch.equal(logprobs.probs(lg, temp, keep)[at], none_p[0])
        record("logprobs_keep_none_equals_all_kept", same, f"M={m}")

    # sampling: V = 40000 spans three programs (SPAN 16384) and a masked tail; zeros outside a top-k set.
    vocab = 40000
    keys = [SA.sample_key(3, r, 17) for r in range(6)]
    probs = torch.softmax(torch.randn(6, vocab, generator=gen) * 3, -1)
    probs[2, 100:] = 0.0
    probs[2] /= probs[2].sum()
    key_tensor = torch.tensor(keys)
    fused = sampling.sample(probs, key_tensor)
    record("sample_equals_torch_race", torch.equal(fused, SA.sample(probs, keys)), f"{fused} vs {SA.sample(probs, keys)}")
    record("sample_equals_torch_race", int(fused[2]) < 100, "a token with probability 0 was drawn")
    for m in (1, 4):
        at = m - 1
        batch = torch.softmax(torch.randn(m, vocab, generator=gen), -1)
        batch[at] = probs[4]
        batch_keys = torch.tensor([SA.sample_key(5, r, 1) for r in range(m)])
        batch_keys[at] = keys[4]
        record("sample_rows_alone_equal_rows_in_batch", int(sampling.sample(batch, batch_keys)[at]) == int(fused[4]),
               f"M={m}")
    # four equal probabilities in three spans: the winner is the torch race's (the noise breaks the tie)
    flat = torch.zeros(1, vocab)
    flat[0, [5, 20000, 33000, 39999]] = 0.25
    race = flat.double() / SA.exponential_noise(torch.tensor(keys[:1]), vocab)
    want = int(torch.nonzero(race[0] == race[0].max()).max())
    record("sample_sparse_row_equals_torch_race", int(sampling.sample(flat, torch.tensor(keys[:1]))[0]) == want,
           "fused race winner differs from the torch race on a sparse row")
    return results


interpreted, test_kernels_interpreted = interpreted_checks(__file__, "kernel", CHECKS)


if __name__ == "__main__":
    print_checks(_run_checks)
