"""Backends with planted defects: each breaks one part of the contract, so a check can show it fails.
Top-level classes of an importable module, so a bisect repro can load them by name."""
import math

import torch

from onepath.ops import Ops
from onepath.ops.ssd import NO_LIMIT


class SplitKAboveEightOps(Ops):
    """An M-dependent branch: above 8 rows in a launch, linear reduces K in two halves."""

    def linear(self, x, weight, bias=None):
        if x.reshape(-1, x.shape[-1]).shape[0] <= 8:
            return super().linear(x, weight, bias)
        h = x.shape[-1] // 2
        return super().linear(x[..., :h], weight[:, :h]) + super().linear(x[..., h:], weight[:, h:], bias)


class SplitKBelowWideOps(Ops):
    """An N-dependent branch: a GEMM with fewer than 2048 output columns reduces K in two halves."""

    def linear(self, x, weight, bias=None):
        if weight.shape[0] >= 2048:
            return super().linear(x, weight, bias)
        h = x.shape[-1] // 2
        return super().linear(x[..., :h], weight[:, :h]) + super().linear(x[..., h:], weight[:, h:], bias)


class DecodeBaselineAttentionOps(Ops):
    """Decode with another reduction order: launches of single-token queries over a longer context
    take the baseline attention."""

    def attention(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None):
        decode = all(meta.query_len(b) == 1 < meta.context_lens[b] for b in range(meta.num_seqs))
        ops = Ops(self.spec.with_mode("baseline")) if decode else super()
        return ops.attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window)


class SplitKExpertsAboveTwoRowsOps(Ops):
    """An MoE expert's down projection that reduces K in two halves when more than two of its rows are
    occupied (a masked chunk's padding rows are zeros): visible only inside the experts, whose occupancy
    follows the routing of the whole launch."""

    def expert_down(self, x, weight):
        if int(x.ne(0).any(dim=-1).sum()) <= 2:
            return super().expert_down(x, weight)
        h = x.shape[-1] // 2
        return super().expert_down(x[..., :h], weight[:, :h]) + super().expert_down(x[..., h:], weight[:, h:])


class ScanDecodeUlpOps(Ops):
    """A one-ulp divergence inside the scan: in a decode pass (every sequence continues its state with one token) the
    scan reads each token's dt one ulp up, as a replay that rounded dt's discretisation differently would."""

    def ssd(self, x, dt, B, C, A_log, D, dt_bias, spans, state=None, dt_limit=NO_LIMIT, state_dtype=torch.float32):
        decode = state is not None and all(p and spans.rows(b).stop - spans.rows(b).start == 1
                                           for b, p in enumerate(spans.starts))
        if decode:
            dt = torch.nextafter(dt, torch.full_like(dt, math.inf))
        return super().ssd(x, dt, B, C, A_log, D, dt_bias, spans, state, dt_limit, state_dtype)


class IndexerUlpInSmallLaunchesOps(Ops):
    """A one-ulp change in DeepSeek-V4's lightning-indexer score: a launch of at most 8 queries (a decode step, a
    short chunk) scores every valid entry one ulp higher."""

    def index_scores(self, q, keys, weights, valid, softmax_scale, weights_scale):
        scores = super().index_scores(q, keys, weights, valid, softmax_scale, weights_scale)
        if q.shape[0] > 8:
            return scores
        up = torch.nextafter(scores, torch.full_like(scores, math.inf))
        return torch.where(torch.isfinite(scores), up, scores)
