import math

import pytest
import torch

from onepath.ops import logprobs as LP

# (temperature, top_k, top_p) of a probe row; top_k 0 / top_p 1.0 mean "no filter"
SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 50, 1.0), (0.6, 0, 0.9), (0.8, 20, 0.95), (1.0, 1, 0.5)]


def _params(rows, gen):
    temperature = 0.5 + torch.rand(rows, generator=gen)
    top_k = torch.randint(0, 60, (rows,), generator=gen)
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.5, 1.0, 0.5 + 0.5 * torch.rand(rows, generator=gen))
    return temperature, top_k, top_p


def _mask(spec, logits, temperature, top_k, top_p):
    keep = LP.sampling_mask(spec, logits, temperature, top_k, top_p)
    return torch.ones_like(logits, dtype=torch.bool) if keep is None else keep


def _kept_token(keep, gen):
    """A random allowed token of each row."""
    return torch.multinomial(keep.float(), 1, generator=gen)[:, 0]


def _plain(logits, tokens, temperature, keep):
    """Log-prob and entropy of softmax(logits / T) restricted to keep, in float64."""
    x = (logits.double() / temperature.double()[:, None]).masked_fill(~keep, -math.inf)
    logp = torch.log_softmax(x, dim=-1)
    entropy = -(logp.exp() * logp.masked_fill(~keep, 0.0)).sum(-1)
    return logp.gather(-1, tokens[:, None])[:, 0], entropy


@pytest.mark.parametrize("vocab", [151, 1000])
def test_token_logprobs_batch_invariant(consistent, gen, vocab):
    # torch.log_softmax on CPU is row-serial: measured at V in {151, 1000, 4099, 32000, 151936} and batches
    # 1..100 it gives a row the same bits alone and in any batch, so this op has no negative control of
    # its own; the model-level tests carry the control.
    for temperature, top_k, top_p in SETTINGS:
        probe = torch.randn(1, vocab, generator=gen) * 4
        t, k, p = torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p])
        keep = _mask(consistent, probe, t, k, p)
        token = _kept_token(keep, gen)
        alone = LP.token_logprobs(consistent, probe, token, t, keep)
        for m in (1, 2, 15, 16, 17, int(torch.randint(1, 101, (1,), generator=gen))):
            logits = torch.randn(m, vocab, generator=gen) * 4
            temps, ks, ps = _params(m, gen)
            keeps = _mask(consistent, logits, temps, ks, ps)
            tokens = _kept_token(keeps, gen)
            at = int(torch.randint(0, m, (1,), generator=gen))
            logits[at], temps[at], keeps[at], tokens[at] = probe[0], t[0], keep[0], token[0]
            lp, entropy = LP.token_logprobs(consistent, logits, tokens, temps, keeps)
            assert torch.equal(lp[at:at + 1], alone[0]), f"logprob: V {vocab}, m {m}, row {at}"
            assert torch.equal(entropy[at:at + 1], alone[1]), f"entropy: V {vocab}, m {m}, row {at}"


@pytest.mark.parametrize("vocab", [1, 151, 1000])
def test_values_close_to_reference(consistent, gen, vocab):
    rows = 37
    logits = torch.randn(rows, vocab, generator=gen) * 5
    temperature, top_k, top_p = _params(rows, gen)
    for keep in (None, _mask(consistent, logits, temperature, top_k, top_p)):
        full = torch.ones_like(logits, dtype=torch.bool) if keep is None else keep
        tokens = _kept_token(full, gen)
        lp, entropy = LP.token_logprobs(consistent, logits, tokens, temperature, keep)
        want_lp, want_entropy = _plain(logits, tokens, temperature, full)
        assert torch.isfinite(entropy).all() and torch.isfinite(lp).all()
        # FP32 softmax over <= 1000 terms: ~1e-6 relative
        torch.testing.assert_close(lp.double(), want_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy.double(), want_entropy, rtol=1e-5, atol=1e-5)


def test_entropy_of_a_single_allowed_token_is_zero(consistent, gen):
    logits = torch.randn(3, 50, generator=gen)
    t = torch.ones(3)
    keep = _mask(consistent, logits, t, torch.ones(3, dtype=torch.long), torch.ones(3))
    lp, entropy = LP.token_logprobs(consistent, logits, logits.argmax(-1), t, keep)
    assert (lp == 0).all() and (entropy == 0).all()


def _order(x):
    """Indices of each row by descending value, ties to the larger index (the contract's rule)."""
    return [sorted(range(len(row)), key=lambda i: (row[i], i), reverse=True) for row in x.tolist()]


def test_top_k_keeps_exactly_k_larger_index_wins_ties(consistent, baseline, gen):
    rows, vocab = 20, 300
    logits = torch.randint(0, 6, (rows, vocab), generator=gen).float()   # every value tied ~50 times
    temperature = 0.5 + torch.rand(rows, generator=gen)
    top_k = torch.randint(1, vocab, (rows,), generator=gen)
    top_k[0] = vocab
    ones = torch.ones(rows)
    expected = torch.zeros(rows, vocab, dtype=torch.bool)
    for r, order in enumerate(_order(logits / temperature[:, None])):
        expected[r, order[:int(top_k[r])]] = True
    assert torch.equal(LP.sampling_mask(consistent, logits, temperature, top_k, ones), expected)
    # torch.sort's order among ties is its own (not the larger index)
    assert not torch.equal(LP.sampling_mask(baseline, logits, temperature, top_k, ones), expected)


def test_top_p_keeps_the_smallest_prefix_reaching_p(consistent, gen):
    rows, vocab = 40, 1000
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temperature, top_k, top_p = _params(rows, gen)
    top_p = 0.3 + 0.69 * torch.rand(rows, generator=gen)
    keep = LP.sampling_mask(consistent, logits, temperature, top_k, top_p)
    x = logits / temperature[:, None]
    for r, order in enumerate(_order(x)):
        kept = keep[r, order].tolist()
        size = sum(kept)
        assert kept == [True] * size + [False] * (vocab - size), f"row {r}: the kept set is not a prefix"
        k = int(top_k[r]) or vocab
        assert size <= k
        probs = torch.softmax(x[r, order[:k]].double(), dim=-1)   # renormalised over the top-k set
        # the kept prefix reaches top_p, and one token fewer does not (float32 mass: 1e-6 slack)
        assert probs[:size].sum() >= top_p[r] - 1e-6, f"row {r}"
        assert probs[:size - 1].sum() < top_p[r] + 1e-6, f"row {r}"


def _mask_drift(spec, gen, probe_settings):
    vocab = 1000
    for temperature, top_k, top_p in probe_settings:
        probe = torch.randn(1, vocab, generator=gen) * 4
        t, k, p = torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p])
        alone = _mask(spec, probe, t, k, p)
        for m in (2, 17, int(torch.randint(2, 101, (1,), generator=gen))):
            logits = torch.randn(m, vocab, generator=gen) * 4
            temps, ks, ps = _params(m, gen)
            at = int(torch.randint(0, m, (1,), generator=gen))
            logits[at], temps[at], ks[at], ps[at] = probe[0], t[0], k[0], p[0]
            assert torch.equal(_mask(spec, logits, temps, ks, ps)[at:at + 1], alone), \
                f"(T, top_k, top_p) = {(temperature, top_k, top_p)}, m {m}, row {at}"


def test_sampling_mask_batch_invariant(consistent, gen):
    # The mask is a discrete decision built from the same per-row steps in both modes; the stock CPU
    # sort/softmax/cumsum are row-serial too, so there is no negative control here.
    _mask_drift(consistent, gen, [s for s in SETTINGS if s[2] < 1.0])


def test_sampling_mask_batch_invariant_for_rows_without_top_p(consistent, gen):
    # peaked rows (T = 0.25): their float32 cumulative mass reaches 1.0 before the tail
    _mask_drift(consistent, gen, [(0.25, 0, 1.0)] * 3 + [(0.25, 200, 1.0)] * 3)


def test_token_outside_keep_is_refused(consistent, gen):
    logits = torch.randn(4, 100, generator=gen)
    t = torch.ones(4)
    keep = _mask(consistent, logits, t, torch.full((4,), 5), torch.ones(4))
    tokens = _kept_token(keep, gen)
    tokens[2] = int((~keep[2]).nonzero()[0])
    with pytest.raises(ValueError, match=f"token {int(tokens[2])} of row 2 lies outside its top-k/top-p set"):
        LP.token_logprobs(consistent, logits, tokens, t, keep)


@pytest.mark.parametrize("masked", [False, True])
def test_gradient_is_plain_math(consistent, gen, masked):
    rows, vocab = 13, 151
    logits = (torch.randn(rows, vocab, generator=gen) * 3).requires_grad_()
    temperature, top_k, top_p = _params(rows, gen)
    keep = LP.sampling_mask(consistent, logits.detach(), temperature, top_k, top_p) if masked else None
    full = torch.ones(rows, vocab, dtype=torch.bool) if keep is None else keep
    tokens = _kept_token(full, gen)
    g_lp, g_entropy = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
    lp, entropy = LP.token_logprobs(consistent, logits, tokens, temperature, keep)
    (lp * g_lp + entropy * g_entropy).sum().backward()
    x = logits.detach().clone().requires_grad_()
    want_lp, want_entropy = _plain(x, tokens, temperature, full)
    (want_lp * g_lp.double() + want_entropy * g_entropy.double()).sum().backward()
    assert torch.isfinite(logits.grad).all()
    torch.testing.assert_close(logits.grad, x.grad, rtol=1e-5, atol=1e-5)
