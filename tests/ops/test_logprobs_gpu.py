"""The chunked log-probs and the fused sampler (onepath.ops.cuda.{logprobs, sampling}) on the GPU at the
Qwen3 vocabulary, V = 151936 (38 chunks of BLOCK_V = 4096, 10 race spans).

A probe row's log-prob, entropy, probabilities and sampled token (with its log-prob) are computed
alone, then at random positions of batches of M rows: every copy must carry the probe's bits
(torch.equal), every launch twice the same bits. The fused sampler must equal probs -> sample ->
token_logprobs bit for bit and pick the torch race's token (float64, on the same device). Negative
control: the same harness with a chunk that follows M (4096 alone, 2048 in a batch, the kind of
dispatch a tuned kernel makes) moves rows' bits.
"""
import pytest
import torch

from onepath.ops import logprobs as reference_lp
from onepath.ops import sampling as ref
from onepath.ops.cuda import logprobs as LP
from onepath.ops.cuda import sampling as SA
from tests.ops.batch_probes import MS as PROBE_MS
from tests.ops.batch_probes import gen, places, rows_alone_differ
from tests.ops.batch_probes import randn as probe_randn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB = 151936
MS = (1, 3, 64, 257, 300)
# FP32 log-probs against a float64 reference: approximate exp/log, fp32 sums over V terms.
LOGPROB = dict(rtol=1e-5, atol=1e-4)
PROBS = dict(rtol=1e-4, atol=1e-8)


def batch(g, m, dtype=torch.float32, scale=4.0):
    logits = (torch.randn(m, VOCAB, generator=g, device="cuda") * scale).to(dtype)
    temperature = 0.5 + torch.rand(m, generator=g, device="cuda")
    temperature[torch.rand(m, generator=g, device="cuda") < 0.3] = 1.0   # T = 1 skips the division
    keep = torch.rand(m, VOCAB, generator=g, device="cuda") < 0.6
    keep[torch.rand(m, generator=g, device="cuda") < 0.3] = True   # rows without a filter
    tokens = torch.randint(0, VOCAB, (m,), generator=g, device="cuda")
    keep[torch.arange(m, device="cuda"), tokens] = True
    keys = torch.randint(0, 2 ** 62, (m,), generator=g, device="cuda")
    return logits, tokens, temperature, keep, keys


def everything(logits, tokens, temperature, keep, keys):
    lp, entropy = LP.token_logprobs(logits, tokens, temperature, keep)
    return (lp, entropy, LP.probs(logits, temperature, keep)) + SA.sample_with_logprobs(logits, temperature, keys, keep)


def torch_race(probs, keys):
    race = probs.double() / ref.exponential_noise(keys, probs.shape[-1])
    return probs.shape[-1] - 1 - torch.argmax(race.flip(-1), dim=-1)


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_alone_equal_rows_in_batch_deterministic(dtype):
    g = gen(1)
    probe = batch(g, 2, dtype)
    probe[3][0] = True   # probe 0 has no filter: alone with keep=None, in a batch an all-kept row
    alone = [everything(*(x[i:i + 1] for x in probe[:3]), None if i == 0 else probe[3][1:2], probe[4][i:i + 1])
             for i in range(2)]
    names = ("logprob", "entropy", "probs", "token", "sampled logprob")
    for m in MS:
        inputs = batch(g, m, dtype)
        at = torch.randperm(m, generator=g, device="cuda")[:2].tolist()
        for i, row in enumerate(at):
            for x, p in zip(inputs, probe):
                x[row] = p[i]
        out = everything(*inputs)
        again = everything(*inputs)
        for name, a, b in zip(names, out, again):
            assert torch.equal(a, b), f"{name} not deterministic: {dtype}, M {m}"
        for i, row in enumerate(at):
            for name, got, want in zip(names, out, alone[i]):
                assert torch.equal(got[row], want[0]), f"{name}: {dtype}, M {m}, row {row}, probe {i}"


@pytest.mark.parametrize("kind", ["flat", "peaked", "near_ties"])
def test_fused_equals_unfused_and_the_torch_race(kind):
    g = gen(2)
    logits, _, temperature, keep, keys = batch(g, 257, scale=4.0 if kind == "peaked" else 1.0)
    if kind == "near_ties":   # every race value p_i / E_i equal up to exp's rounding: the top ones ~1e-12 apart
        logits = (0.3 * ref.exponential_noise(keys, VOCAB)).log().float()
        temperature = torch.ones_like(temperature)
    for k in (None, keep):
        tokens, lp = SA.sample_with_logprobs(logits, temperature, keys, k)
        p = LP.probs(logits, temperature, k)
        assert torch.equal(tokens, SA.sample(p, keys)), f"fused tokens != sample(probs): {kind}, keep {k is not None}"
        want_lp, entropy = LP.token_logprobs(logits, tokens, temperature, k)
        assert torch.equal(lp, want_lp), f"fused log-prob != token_logprobs: {kind}, keep {k is not None}"
        race = torch_race(p, keys)
        assert torch.equal(tokens, race), f"{(tokens != race).sum()} rows differ from the torch race: {kind}"
        full = torch.ones_like(keep) if k is None else k
        x = (logits.double() / temperature.double()[:, None]).masked_fill(~full, float("-inf"))
        logp = torch.log_softmax(x, dim=-1)
        torch.testing.assert_close(lp.double(), logp.gather(-1, tokens[:, None])[:, 0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(entropy.double(), -(logp.exp() * logp.masked_fill(~full, 0.0)).sum(-1),
                                   rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(p.double(), logp.exp(), rtol=1e-4, atol=1e-8)


@pytest.mark.gpu_smoke
def test_every_row_alone_and_negative_control_chunk_follows_m():
    g = gen(3)
    logits, tokens, temperature, keep, keys = batch(g, 300)
    lp, entropy = LP.token_logprobs(logits, tokens, temperature, keep)
    sampled, sampled_lp = SA.sample_with_logprobs(logits, temperature, keys, keep)
    stats = LP.row_stats(LP.prepare(logits, temperature, keep))
    moved_stats = LP.row_stats(LP.prepare(logits, temperature, keep), block=2048)
    differ = moved = 0
    for r in range(64):
        one = (logits[r:r + 1], tokens[r:r + 1], temperature[r:r + 1], keep[r:r + 1])
        a_lp, a_entropy = LP.token_logprobs(*one)
        a_tok, a_lp2 = SA.sample_with_logprobs(one[0], one[2], keys[r:r + 1], one[3])
        differ += not (torch.equal(a_lp[0], lp[r]) and torch.equal(a_entropy[0], entropy[r])
                       and torch.equal(a_tok[0], sampled[r]) and torch.equal(a_lp2[0], sampled_lp[r]))
        alone_stats = LP.row_stats(LP.prepare(one[0], one[2], one[3]))
        differ += not torch.equal(alone_stats[0], stats[r])
        moved += not torch.equal(alone_stats[0], moved_stats[r])
    assert differ == 0, f"{differ} of 64 rows got other bits alone than at M = 300"
    print(f"negative control: a 2048 chunk at M = 300 moved {moved} of 64 rows' (m, S, D)")
    assert moved > 0, "negative control: a chunk following M left every row's bits in place"


def test_top_p_mask_rows_alone_equal_rows_in_batch_and_float_cumsum_control():
    """The top-p mask (ops.logprobs.sampling_mask, consistent spec) of a row alone equals its mask inside
    batches of every size. Negative control: the float32 running mass by torch.cumsum, the old rule, moves
    a row's bits with the batch (a nucleus boundary token then flips between the engine and the trainer)."""
    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops.logprobs import probs, sampling_mask

    spec = ExecutionSpec.default("consistent", "cuda")
    g = gen(17)
    m = 300
    logits = (torch.randn(m, VOCAB, generator=g, device="cuda") * 3.0).bfloat16()
    temperature = 0.7 + torch.rand(m, generator=g, device="cuda")
    top_k = torch.zeros(m, dtype=torch.long, device="cuda")
    top_p = 0.5 + 0.45 * torch.rand(m, generator=g, device="cuda")
    full = sampling_mask(spec, logits, temperature, top_k, top_p)
    moved_mask, moved_cumsum = [], []
    p_full = probs(spec, logits, temperature, full)
    run_full = torch.cumsum(p_full, dim=-1)
    for size in (1, 2, 7, 64, 129):
        for start in (0, m - size):
            rows = slice(start, start + size)
            part = sampling_mask(spec, logits[rows], temperature[rows], top_k[rows], top_p[rows])
            if not torch.equal(part, full[rows]):
                moved_mask.append((size, start))
            if not torch.equal(torch.cumsum(p_full[rows], dim=-1), run_full[rows]):
                moved_cumsum.append((size, start))
    assert not moved_mask, f"(batch size, first row) whose top-p masks differ from the 300-row batch's: {moved_mask}"
    assert moved_cumsum, "torch.cumsum kept every row's float running sum: the control cannot tell"


def _logits_batch(g, m, vocab, dtype):
    logits = probe_randn(g, m, vocab, scale=4, dtype=dtype)
    temperature = 0.5 + torch.rand(m, generator=g, device="cuda")
    keep = torch.rand(m, vocab, generator=g, device="cuda") < 0.6
    keep[torch.rand(m, generator=g, device="cuda") < 0.3] = True  # rows without a filter
    tokens = torch.randint(0, vocab, (m,), generator=g, device="cuda")
    keep[torch.arange(m, device="cuda"), tokens] = True
    return logits, tokens, temperature, keep


def _float64(logits, tokens, temperature, keep):
    x = (logits.double() / temperature.double()[:, None]).masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(x, dim=-1)
    entropy = -(logp.exp() * logp.masked_fill(~keep, 0.0)).sum(-1)
    return logp.gather(-1, tokens[:, None])[:, 0], entropy, logp.exp()


@pytest.mark.parametrize("vocab,dtype", [(151936, torch.bfloat16), (32000, torch.bfloat16), (32000, torch.float32)])
def test_token_logprobs_batch_invariant_deterministic_close(vocab, dtype):
    g = gen(vocab)
    # probe 0 has no filter and runs alone with keep=None; in a batch its row is all-kept beside
    # other rows' masks. Probe 1 carries a mask.
    p_logits, p_tokens, p_temp, p_keep = _logits_batch(g, 2, vocab, dtype)
    p_keep[0] = True
    alone = [LP.token_logprobs(p_logits[i:i + 1], p_tokens[i:i + 1], p_temp[i:i + 1], k)
             for i, k in ((0, None), (1, p_keep[1:2]))]
    alone_p = [LP.probs(p_logits[i:i + 1], p_temp[i:i + 1], k) for i, k in ((0, None), (1, p_keep[1:2]))]
    for m in PROBE_MS:
        logits, tokens, temperature, keep = _logits_batch(g, m, vocab, dtype)
        at = places(g, m, 2)
        for i, row in enumerate(at):
            logits[row], tokens[row], temperature[row], keep[row] = p_logits[i], p_tokens[i], p_temp[i], p_keep[i]
        lp, entropy = LP.token_logprobs(logits, tokens, temperature, keep)
        again = LP.token_logprobs(logits, tokens, temperature, keep)
        assert torch.equal(lp, again[0]) and torch.equal(entropy, again[1]), f"not deterministic: V {vocab}, M {m}"
        p = LP.probs(logits, temperature, keep)
        for i, row in enumerate(at):
            where = f"V {vocab} {dtype}, M {m}, row {row}, probe {i}"
            assert torch.equal(lp[row], alone[i][0][0]), f"logprob: {where}"
            assert torch.equal(entropy[row], alone[i][1][0]), f"entropy: {where}"
            assert torch.equal(p[row], alone_p[i][0]), f"probs: {where}"
        if m <= 100:
            want_lp, want_entropy, want_p = _float64(logits, tokens, temperature, keep)
            torch.testing.assert_close(lp.double(), want_lp, **LOGPROB)
            torch.testing.assert_close(entropy.double(), want_entropy, **LOGPROB)
            torch.testing.assert_close(p.double(), want_p, **PROBS)
        del p


def test_token_logprobs_rows_alone_with_negative_control():
    vocab, rows = 151936, range(64)
    g = gen(13)
    batch = _logits_batch(g, 4096, vocab, torch.bfloat16)
    assert rows_alone_differ(LP.token_logprobs, batch, rows) == 0
    assert rows_alone_differ(lambda lg, t, temp, k: LP.probs(lg, temp, k), batch, rows) == 0
    stock_lp = rows_alone_differ(lambda *a: reference_lp.reference(*a)[0], batch, rows)
    stock_entropy = rows_alone_differ(lambda *a: reference_lp.reference(*a)[1], batch, rows)
    print(f"stock log_softmax logprob: {stock_lp} of {len(rows)} rows differ alone vs M=4096 "
          f"(expected 0: one block per row); stock entropy (.sum): {stock_entropy}")
    assert stock_entropy > 0, "negative control: the stock entropy's .sum(-1) gave every row the same bits"


def test_greedy_rows_on_the_gpu_take_the_kept_argmax_and_the_temperature_1_logprob():
    """Greedy rows in the fused sampler at V = 151936: ties planted in different spans go to the larger
    index (torch.argmax, first maxima, differs: control), the log-prob is token_logprobs' at temperature 1,
    the sampled rows keep their draw, and a greedy row alone has its bits in a batch."""
    g = gen(7)
    logits, _, temperature, keep, keys = batch(g, 9, torch.bfloat16)
    top = (logits.float().max() + 1).to(torch.bfloat16)
    for r, spots in enumerate([[3, 70000, 151935], [4096, 4097], [11, 16383, 16384]]):
        logits[r, spots] = top
        keep[r, spots] = True
    greedy = torch.tensor([True, True, True, True, False, True, False, True, False], device="cuda")
    temperature[greedy] = 1.0
    tokens, lp = SA.sample_with_logprobs(logits, temperature, keys, keep, greedy)
    want = ref.greedy_tokens(logits, keep)
    assert torch.equal(tokens[greedy], want[greedy]) and tokens[:3].tolist() == [151935, 4097, 16384]
    first = torch.argmax(logits.float().masked_fill(~keep, float("-inf")), dim=-1)
    assert first[:3].tolist() == [3, 4096, 11]
    assert torch.equal(lp, LP.token_logprobs(logits, tokens, temperature, keep)[0])
    plain = SA.sample_with_logprobs(logits, temperature, keys, keep)
    assert torch.equal(tokens[~greedy], plain[0][~greedy]) and torch.equal(lp[~greedy], plain[1][~greedy])
    one = SA.sample_with_logprobs(logits[:1], temperature[:1], keys[:1], keep[:1], greedy[:1])
    assert torch.equal(one[0], tokens[:1]) and torch.equal(one[1], lp[:1])
