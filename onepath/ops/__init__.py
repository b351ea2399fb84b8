"""One interface per operator; the ExecutionSpec picks the backend (consistent or baseline).

Models call `Ops` methods only, so the spec is the single switch between the two sides' numerics.
"""
from __future__ import annotations

from onepath.numerics.spec import ExecutionSpec
from onepath.ops import attention as _attention
from onepath.ops import embedding as _embedding
from onepath.ops import linear as _linear
from onepath.ops import logprobs as _logprobs
from onepath.ops import rmsnorm as _rmsnorm
from onepath.ops import rope as _rope
from onepath.ops import sampling as _sampling
from onepath.ops import silu_mul as _silu_mul
from onepath.ops import topk as _topk
from onepath.ops.attention import AttentionMetadata


class Ops:
    def __init__(self, spec: ExecutionSpec):
        self.spec = spec

    def embedding(self, token_ids, weight):
        return _embedding.embedding(self.spec, token_ids, weight)

    def linear(self, x, weight, bias=None):
        return _linear.linear(self.spec, x, weight, bias)

    def lm_head(self, x, weight):
        return _linear.linear(self.spec, x, weight, op="lm_head")

    def rmsnorm(self, x, weight, eps):
        return _rmsnorm.rmsnorm(self.spec, x, weight, eps)

    def rope(self, x, positions, cos_table, sin_table):
        return _rope.rope(self.spec, x, positions, cos_table, sin_table)

    def silu_mul(self, gate, up):
        return _silu_mul.silu_mul(self.spec, gate, up)

    def attention(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None):
        return _attention.attention(self.spec, q, k, v, k_cache, v_cache, meta, scale, sliding_window)

    def token_logprobs(self, logits, tokens, temperature, keep=None):
        return _logprobs.token_logprobs(self.spec, logits, tokens, temperature, keep)

    def sampling_mask(self, logits, temperature, top_k, top_p):
        return _logprobs.sampling_mask(self.spec, logits, temperature, top_k, top_p)

    def probs(self, logits, temperature, keep=None):
        return _logprobs.probs(self.spec, logits, temperature, keep)

    def sample(self, probs, keys):
        return _sampling.sample(probs, keys)

    def topk(self, x, k):
        return _topk.topk(self.spec, x, k)


__all__ = ["Ops", "AttentionMetadata", "ExecutionSpec"]
