"""Ops.sample_with_logprobs on the torch backends: the engine's sampler in one call.

It must be exactly what the engine computed with three calls (probs -> sample -> token_logprobs),
and a row's token and log-prob must not depend on its batch. The Triton path's bits are checked by
tests/ops/test_logprobs_interpret.py (interpreter) and tests/gpu/test_logprobs_gpu.py.
"""
import pytest
import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from onepath.ops.sampling import sample_key


def _batch(gen, rows, vocab=500):
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temperature = 0.5 + torch.rand(rows, generator=gen)
    top_k = torch.where(torch.rand(rows, generator=gen) < 0.5, torch.randint(1, 60, (rows,), generator=gen), 0)
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.5, 1.0, 0.5 + 0.5 * torch.rand(rows, generator=gen))
    keys = [sample_key(4, r, 11) for r in range(rows)]
    return logits, temperature, top_k, top_p, keys


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_sample_with_logprobs_is_probs_sample_token_logprobs(mode, gen):
    ops = Ops(ExecutionSpec(mode=mode))
    logits, temperature, top_k, top_p, keys = _batch(gen, 37)
    for keep in (None, ops.sampling_mask(logits, temperature, top_k, top_p)):
        tokens, lp = ops.sample_with_logprobs(logits, temperature, keys, keep)
        want_tokens = ops.sample(ops.probs(logits, temperature, keep), keys)
        assert torch.equal(tokens, want_tokens)
        assert torch.equal(lp, ops.token_logprobs(logits, want_tokens, temperature, keep)[0])
        assert tokens.dtype == torch.int64 and lp.dtype == torch.float32 and torch.isfinite(lp).all()


def test_sample_with_logprobs_rows_alone_equal_rows_in_batch(consistent, gen):
    ops = Ops(consistent)
    probe = _batch(gen, 1)
    p_logits, p_temp, p_k, p_p, p_keys = probe
    p_k[0], p_p[0] = 40, 0.9
    alone = ops.sample_with_logprobs(p_logits, p_temp, p_keys, ops.sampling_mask(p_logits, p_temp, p_k, p_p))
    stream_moved = False
    for m in (1, 3, 64, 257):
        logits, temperature, top_k, top_p, keys = _batch(gen, m)
        at = int(torch.randint(0, m, (1,), generator=gen))
        logits[at], temperature[at], top_k[at], top_p[at], keys[at] = p_logits[0], p_temp[0], p_k[0], p_p[0], p_keys[0]
        keep = ops.sampling_mask(logits, temperature, top_k, top_p)
        tokens, lp = ops.sample_with_logprobs(logits, temperature, keys, keep)
        assert torch.equal(tokens[at:at + 1], alone[0]) and torch.equal(lp[at:at + 1], alone[1]), f"M {m}, row {at}"
        # control: one batch-wide stream (the stock engine's torch.multinomial) hands the probe another draw
        draw = lambda p: torch.multinomial(p, 1, generator=torch.Generator().manual_seed(0))[:, 0]
        p = ops.probs(logits, temperature, keep)
        stream_moved |= m > 1 and not torch.equal(draw(p)[at:at + 1], draw(p[at:at + 1]))
    assert stream_moved
