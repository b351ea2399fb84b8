"""The Triton exponential race (onepath.ops.cuda.sampling) run by Triton's CPU interpreter (TRITON_INTERPRET=1).

The race skips a block when an FP32 bound proves that none of its entries can reach the span's best
so far. A skip must never move the winner, so the checks are exact: the token equals the torch
race's (ops/sampling.py) on flat, peaked, sparse and all-zero rows, and equals the float64 argmax on
rows with planted near-ties: race values equal to within 2^-24 at the entries of smallest noise
(where the bound is tightest) and at random ones, the largest one early, late, or last; and logits
that make every entry a near-tie, where the fused race must use the probs kernel's very bits. The
bound itself lies below -log1p(-u) with margin on adversarial noise words. The interpreter's log1p is numpy's (the GPU's is libdevice's), so the planted rows'
expected winner is computed with numpy's too.
"""
from __future__ import annotations

from tests.interpret import check_recorder, interpreted_checks, patch_libdevice_log1p, print_checks

CHECKS = ["race_equals_torch_race", "planted_near_ties", "bound_below_exponential", "sample_equals_torch_race",
          "sample_rows_alone_equal_rows_in_batch", "sample_sparse_row_equals_torch_race",
          "greedy_takes_the_largest_kept_logit", "greedy_ties_go_to_the_larger_index", "greedy_logprob_is_temperature_1",
          "greedy_rows_leave_sampled_rows_alone"]


def _race_checks(record, gen) -> None:
    """sample() on given probabilities: V = 40000 spans three programs (SPAN 16384) and a masked tail."""
    import torch

    from onepath.ops import sampling as SA
    from onepath.ops.cuda import sampling

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


def _greedy_checks(record, gen) -> None:
    """The fused sampler's greedy rows: the largest kept logit, ties (within a block, across blocks and spans)
    to the larger index; the log-prob is token_logprobs' at temperature 1; the sampled rows keep their draw."""
    import torch

    from onepath.ops import sampling as SA
    from onepath.ops.cuda import logprobs as LP
    from onepath.ops.cuda import sampling

    vocab, n = 40000, 6   # three spans, the last partial
    logits = (torch.randn(n, vocab, generator=gen) * 2).bfloat16()
    top = (logits.float().max() + 1).bfloat16()
    logits[0, [7, 20000, 39000]] = top          # equal maxima in three spans: 39000
    logits[1, [100, 101, 1500]] = top           # within a block and across blocks of one span: 1500
    logits[2, [5, 17000]] = top                 # 17000 is not kept: 5
    keep = torch.ones(n, vocab, dtype=torch.bool)
    keep[2, 17000] = False
    keep[3, torch.randperm(vocab, generator=gen)[:30000]] = False
    greedy = torch.tensor([True, True, True, True, False, False])
    temperature = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.7, 1.3])   # a greedy row's is 1 (SamplingParams)
    keys = torch.tensor([SA.sample_key(2, r, 5) for r in range(n)])
    tokens, lp = sampling.sample_with_logprobs(logits, temperature, keys, keep, greedy)
    want = SA.greedy_tokens(logits, keep)
    record("greedy_takes_the_largest_kept_logit", torch.equal(tokens[:4], want[:4]) and tokens[:3].tolist() ==
           [39000, 1500, 5], f"{tokens[:4].tolist()} vs {want[:4].tolist()}")
    first = torch.argmax(logits.float().masked_fill(~keep, float("-inf")), dim=-1)
    record("greedy_ties_go_to_the_larger_index", first[:2].tolist() == [7, 100],
           f"control: torch.argmax's first maxima {first[:2].tolist()} should differ from the rule's")
    lp_want = LP.token_logprobs(logits, tokens, temperature, keep)[0]
    record("greedy_logprob_is_temperature_1", torch.equal(lp, lp_want), f"{lp.tolist()} vs {lp_want.tolist()}")
    sampled, sampled_lp = sampling.sample_with_logprobs(logits, temperature, keys, keep)
    record("greedy_rows_leave_sampled_rows_alone", torch.equal(tokens[4:], sampled[4:]) and
           torch.equal(lp[4:], sampled_lp[4:]), f"{tokens[4:].tolist()} vs {sampled[4:].tolist()}")


def _run_checks() -> dict:
    global SA   # bound_kernel below is interpreted in this module's globals
    from tests.interpret import patch_bf16_rounding
    patch_bf16_rounding()
    patch_libdevice_log1p()
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    from onepath.ops import sampling as ref
    from onepath.ops.cuda import logprobs as LP
    from onepath.ops.cuda import sampling as SA

    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()
    _race_checks(record, gen)
    _greedy_checks(record, gen)

    vocab = 40000   # three spans of SPAN = 16384, the last partial
    keys = torch.tensor([ref.sample_key(9, r, 3) for r in range(8)])
    logits = torch.randn(8, vocab, generator=gen)
    logits[1] *= 4                                   # peaked
    p = torch.softmax(logits, -1)
    p[2, torch.randperm(vocab, generator=gen)[50:]] = 0.0   # 50 tokens left, as after top-k
    p[3, :vocab - 5] = 0.0                           # all mass in the last span's last block
    p[4] = 0.0                                       # no mass: all race values tie at 0, the last index wins
    p[5, :SA.SPAN] = 0.0                             # an empty first span
    for probs in (p, p.bfloat16()):
        got, want = SA.sample(probs, keys), ref.sample(probs, keys.tolist())
        record("race_equals_torch_race", torch.equal(got, want), f"{probs.dtype}: {got.tolist()} vs {want.tolist()}")
    temperature = torch.ones(8)
    tokens, _ = SA.sample_with_logprobs(logits, temperature, keys)
    want = ref.sample(LP.probs(logits, temperature), keys.tolist())
    record("race_equals_torch_race", torch.equal(tokens, want), f"fused: {tokens.tolist()} vs {want.tolist()}")

    # Near-ties: p_j = R * E_j rounded to FP32 makes race_j = R to within 2^-24, closer than any bound's slack.
    u = ref.uniform_noise(keys[:4], vocab).numpy()
    e = -np.log1p(-u)
    planted = np.full((4, vocab), 1e-9, dtype=np.float32)
    for r in range(4):
        # entries of small u, where the bound is tightest (u near 6e-4: within 4e-4 of E), and random ones
        small = np.argsort(u[r])[:40]
        later = small[small % SA.SPAN >= SA.BLOCK]   # not in its span's first block
        tight = int(later[np.argmin(np.abs(np.log(u[r, later] / 6e-4)))])
        spread = np.concatenate([small, torch.randperm(vocab, generator=gen)[:20].numpy(), [tight // SA.SPAN * SA.SPAN]])
        lead = (tight, int(spread.max()), vocab - 1, None)[r]   # row 0: a best before it in its span
        planted[r, spread] = (0.3 * e[r, spread]).astype(np.float32)
        if lead is not None:   # one entry a hair above the rest (2^-21): early, late, or the very last
            planted[r, lead] = np.float32(0.3 * (1 + 2.0 ** -21) * e[r, lead])
    race = planted.astype(np.float64) / e
    want = [int(np.flatnonzero(row == row.max()).max()) for row in race]
    got = SA.sample(torch.from_numpy(planted), keys[:4]).tolist()
    record("planted_near_ties", got == want, f"{got} vs {want}")
    # near-ties through logits, every entry planted (exp's rounding spreads them by ~1e-6, so the top two
    # are ~1e-11 apart): the fused race must divide out the very p of the probs kernel
    e = -np.log1p(-ref.uniform_noise(keys, vocab).numpy())
    logits = torch.from_numpy(np.log(0.3 * e).astype(np.float32))
    p = LP.probs(logits, torch.ones(8)).numpy()
    race = p.astype(np.float64) / e
    want = [int(np.flatnonzero(row == row.max()).max()) for row in race]
    got = SA.sample_with_logprobs(logits, torch.ones(8), keys)[0].tolist()
    record("planted_near_ties", got == want, f"fused: {got} vs {want}")

    @triton.jit
    def bound_kernel(z_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, SA._race_bound(tl.load(z_ptr + i).to(tl.uint64, bitcast=True)))

    k = [0, 1, 2, 3, 2 ** 29 - 1, 2 ** 29, 2 ** 29 + 1, 2 ** 30 - 1, 2 ** 40 + 7, 2 ** 52, 2 ** 53 - 2, 2 ** 53 - 1]
    words = torch.cat([torch.tensor(k, dtype=torch.int64) << 11 | 2047,
                       torch.randint(-2 ** 63, 2 ** 63 - 1, (4096 - len(k),), generator=gen, dtype=torch.int64)])
    e_lo = torch.empty(4096, dtype=torch.float32)
    bound_kernel[(1,)](words, e_lo, N=4096)
    u = ref._shift_right(words, 11).double() * 2.0 ** -53
    e = torch.from_numpy(-np.log1p(-u.numpy()))
    below = (e_lo.double() <= e * (1 - 2.0 ** -22)) | ((e_lo == 0) & (e == 0))
    record("bound_below_exponential", bool(below.all()), f"{(~below).sum()} words: e_lo above -log1p(-u)")
    useful = (u < 2.0 ** -20) | (u > 0.5) | (e_lo.double() >= 0.85 * e)
    record("bound_below_exponential", bool(useful.all()), "the bound is loose where races are won")
    return results


interpreted, test_sampling_interpreted = interpreted_checks(__file__, "sampling", CHECKS)


if __name__ == "__main__":
    print_checks(_run_checks)
