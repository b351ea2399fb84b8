"""onepath.ops.cuda.logprobs and the fused sampler run by Triton's CPU interpreter (TRITON_INTERPRET=1).

The interpreter runs one program at a time, so the blocks are shrunk (BLOCK_V 256, race BLOCK 128 and
SPAN 256; the same code; _full_block_checks runs the real sizes first): V = 600 cuts a row into
three chunks and three race spans, the last ones partial, and rows are masked so that whole chunks
have no kept entry. Checked: a row's log-prob, entropy, probabilities and sampled token are the same
bits alone and at random positions of batches of 1, 3, 64 and 257 rows; the fused sampler equals
probs -> sample -> token_logprobs bit for bit; values are close to float64. Negative control: with a
chunk that follows M (256 alone, 64 in a batch) the same rows get other bits. The bits of Hopper's
exp/log and reduction trees are tests/ops/test_logprobs_gpu.py's job.
"""
from __future__ import annotations

from tests.interpret import check_recorder, interpreted_checks, kernel_case_tools, patch_libdevice_log1p, print_checks

CHECKS = ["rows_alone_equal_rows_in_batch", "fused_equals_unfused", "values", "masked_chunks",
          "negative_control_chunk_follows_m", "logprobs_values", "logprobs_rows_alone_equal_rows_in_batch",
          "logprobs_keep_none_equals_all_kept", "probs_values", "probs_rows_alone_equal_rows_in_batch"]
VOCAB = 600


def _full_block_checks(record, gen) -> None:
    """token_logprobs and probs at the kernels' real BLOCK_V (4096), before the blocks are shrunk."""
    import math

    import torch

    from onepath.ops import logprobs as LP
    from onepath.ops.cuda import logprobs

    rand, close, _ = kernel_case_tools(gen)

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


def _run_checks() -> dict:
    from tests.interpret import patch_bf16_rounding
    patch_bf16_rounding()
    patch_libdevice_log1p()
    import math

    import torch

    from onepath.ops.cuda import logprobs as LP
    from onepath.ops.cuda import sampling as SA
    from onepath.ops.sampling import sample_key

    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()
    _full_block_checks(record, gen)
    LP.BLOCK_V, SA.BLOCK, SA.SPAN = 256, 128, 256

    def batch(n, dtype=torch.float32):
        logits = (torch.randn(n, VOCAB, generator=gen) * 3).to(dtype)
        temperature = torch.where(torch.rand(n, generator=gen) < 0.3, 1.0, 0.5 + torch.rand(n, generator=gen))
        keep = torch.rand(n, VOCAB, generator=gen) < 0.7
        keep[:, :LP.BLOCK_V] &= torch.rand(n, 1, generator=gen) < 0.5   # some rows: a first chunk with no kept entry
        tokens = torch.multinomial(keep.float(), 1, generator=gen)[:, 0]
        keys = torch.tensor([sample_key(1, r, 7) for r in range(n)])
        return logits, tokens, temperature, keep, keys

    def everything(logits, tokens, temperature, keep, keys):
        lp, entropy = LP.token_logprobs(logits, tokens, temperature, keep)
        # probs is what the sampler computes in registers: checked here up to M = 64, to save the interpreter time
        p = LP.probs(logits, temperature, keep) if len(logits) <= 64 else None
        return (lp, entropy, p) + SA.sample_with_logprobs(logits, temperature, keys, keep)

    def plain(logits, tokens, temperature, keep):
        x = (logits.double() / temperature.double()[:, None]).masked_fill(~keep, -math.inf)
        logp = torch.log_softmax(x, dim=-1)
        entropy = -(logp.exp() * logp.masked_fill(~keep, 0.0)).sum(-1)
        return logp.gather(-1, tokens[:, None])[:, 0], entropy, logp.exp()

    names = ("logprob", "entropy", "probs", "token", "sampled logprob")
    for dtype, sizes in ((torch.float32, (1, 3, 64, 257)), (torch.bfloat16, (1, 3))):
        probe = batch(2, dtype)
        probe[3][0] = True   # probe 0 has no filter: alone with keep=None, in a batch an all-kept row
        alone = [everything(*(x[i:i + 1] for x in probe[:3]), None if i == 0 else probe[3][1:2], probe[4][i:i + 1])
                 for i in range(2)]
        for m in sizes:
            inputs = batch(m, dtype)
            at = torch.randperm(m, generator=gen)[:2].tolist()
            for i, row in enumerate(at):
                for x, p in zip(inputs, probe):
                    x[row] = p[i]
            out = everything(*inputs)
            for i, row in enumerate(at):
                for name, got, want in zip(names, out, alone[i]):
                    if got is not None:
                        record("rows_alone_equal_rows_in_batch", torch.equal(got[row], want[0]),
                               f"{name}: {dtype}, M {m}, row {row}, probe {i}")

        logits, tokens, temperature, keep, keys = batch(6, dtype)
        for k in (None, keep):
            tok, lp = SA.sample_with_logprobs(logits, temperature, keys, k)
            p = LP.probs(logits, temperature, k)
            record("fused_equals_unfused", torch.equal(tok, SA.sample(p, keys)), f"tokens: {dtype}, keep {k is not None}")
            record("fused_equals_unfused", torch.equal(lp, LP.token_logprobs(logits, tok, temperature, k)[0]),
                   f"logprob: {dtype}, keep {k is not None}")
            full = torch.ones_like(keep) if k is None else k
            record("fused_equals_unfused", bool(full.gather(-1, tok[:, None]).all()), "a token outside keep was drawn")
            want_lp, want_entropy, want_p = plain(logits, tok, temperature, full)
            lp2, entropy = LP.token_logprobs(logits, tok, temperature, k)
            for name, got, want, tol in (("logprob", lp2, want_lp, 1e-5), ("entropy", entropy, want_entropy, 1e-5),
                                         ("probs", p, want_p, 1e-7)):
                ok = torch.allclose(got.double(), want, rtol=1e-5, atol=tol)
                record("values", ok, f"{name}: {dtype}, keep {k is not None}: max err {(got.double() - want).abs().max():.3g}")
            outside = tokens.clone()
            outside[0] = int((~keep[0]).nonzero()[0])
            record("values", LP.token_logprobs(logits, outside, temperature, keep)[0][0].item() == -math.inf,
                   "a token outside keep must get -inf")

    # Two kept tokens in the last chunk only, and one row whose only kept token is the last entry.
    logits, tokens, temperature, _, keys = batch(2)
    keep = torch.zeros(2, VOCAB, dtype=torch.bool)
    keep[0, [550, 599]] = True
    keep[1, VOCAB - 1] = True
    tokens = torch.tensor([550, VOCAB - 1])
    lp, entropy = LP.token_logprobs(logits, tokens, temperature, keep)
    want_lp, want_entropy, _ = plain(logits, tokens, temperature, keep)
    record("masked_chunks", torch.allclose(lp.double(), want_lp, atol=1e-6) and lp[1] == 0 and entropy[1] == 0,
           f"{lp} vs {want_lp}")
    record("masked_chunks", torch.allclose(entropy.double(), want_entropy, atol=1e-6), f"{entropy} vs {want_entropy}")
    tok, _ = SA.sample_with_logprobs(logits, temperature, keys, keep)
    record("masked_chunks", tok[0] in (550, 599) and tok[1] == VOCAB - 1, f"sampled {tok.tolist()}")

    # The chunk fixes the order of a row's sums: one that followed M would give rows other bits.
    logits, tokens, temperature, keep, _ = batch(64)
    rows = LP.prepare(logits, temperature, keep)
    alone = torch.cat([LP.row_stats(LP.prepare(logits[r:r + 1], temperature[r:r + 1], keep[r:r + 1])) for r in range(64)])
    record("negative_control_chunk_follows_m", torch.equal(LP.row_stats(rows), alone), "fixed chunk: rows moved")
    moved = (LP.row_stats(rows, block=64) != alone).any(-1).sum().item()
    record("negative_control_chunk_follows_m", moved > 0, "a chunk of 64 at M = 64 gave every row the same bits")
    return results


interpreted, test_logprobs_interpreted = interpreted_checks(__file__, "logprobs", CHECKS)


if __name__ == "__main__":
    print_checks(_run_checks)
