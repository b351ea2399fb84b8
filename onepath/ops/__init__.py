"""One interface per operator; the ExecutionSpec picks the backend (consistent or baseline).

Models call `Ops` methods only, so the spec is the single switch between the two sides' numerics. Each operator
is one module, ops/<op>.py: its reference, its consistent CPU path and its (mode, device) table of backends;
its CUDA kernels are ops/cuda/<op>*.py, its tests tests/ops/test_<op>*.py, its notes docs/ops/<op>.md.
"""
from __future__ import annotations

import torch

from onepath.numerics.spec import ExecutionSpec
from onepath.ops import attention as _attention
from onepath.ops import cache_rows as _cache_rows
from onepath.ops import compressor as _compressor
from onepath.ops import conv1d as _conv1d
from onepath.ops import embedding as _embedding
from onepath.ops import indexer as _indexer
from onepath.ops import linear as _linear
from onepath.ops import logprobs as _logprobs
from onepath.ops import mhc as _mhc
from onepath.ops import relu2 as _relu2
from onepath.ops import rmsnorm as _rmsnorm
from onepath.ops import rope as _rope
from onepath.ops import sampling as _sampling
from onepath.ops import sigmoid as _sigmoid
from onepath.ops import silu_mul as _silu_mul
from onepath.ops import softmax as _softmax
from onepath.ops import sparse_attention as _sparse_attention
from onepath.ops import sqrtsoftplus as _sqrtsoftplus
from onepath.ops import ssd as _ssd
from onepath.ops import topk as _topk
from onepath.ops.attention import AttentionMetadata


class Ops:
    def __init__(self, spec: ExecutionSpec):
        self.spec = spec

    def embedding(self, token_ids, weight, padding_idx=None):
        return _embedding.embedding(self.spec, token_ids, weight, padding_idx)

    def linear(self, x, weight, bias=None, op="linear"):
        """op: "linear", or a module class with its own formats in the spec (MODULE_OPS: "mamba_proj", "expert")."""
        return _linear.linear(self.spec, x, weight, bias, op=op)

    def lm_head(self, x, weight):
        return _linear.linear(self.spec, x, weight, op="lm_head")

    def router(self, x, weight):
        """MoE router scores x W^T, FP32 at every batch size: the LM head's GEMM (FP32 output)."""
        return _linear.linear(self.spec, x, weight, op="lm_head")

    def expert_down(self, x, weight, bias=None, op="linear"):
        """An MoE expert's down projection with FP32 output (the experts are combined in FP32 and rounded
        once); a linear layer otherwise, quantised as the spec's `op` says."""
        return _linear.linear(self.spec, x, weight, bias, op=op, out_dtype=torch.float32)

    @property
    def grouped_experts(self) -> bool:
        """True where the experts' GEMMs run through grouped_linear: one grouped launch per projection on
        CUDA (consistent: our kernels, quantised too; baseline BF16 and FP8: torch._grouped_mm), and for
        quantised experts on the CPU (a GEMM per expert on the stacked quantised weights)."""
        return _linear.grouped_experts(self.spec)

    def grouped_kernel(self, op="linear") -> bool:
        """grouped_experts for the linears of module class `op` (their quantisation may rule the launch out)."""
        return _linear.grouped_kernel(self.spec, op)

    def grouped_on_device(self, weight) -> bool:
        """True where grouped_linear over `weight` [G, N, K] reads the counts on the device only (no host
        sync: a CUDA graph can hold it)."""
        return _linear.grouped_on_device(self.spec, weight)

    def can_stack(self, sizes: list[int]) -> bool:
        """Whether linears sharing an input (output sizes `sizes`) may run as one GEMM over their stacked
        weights, each keeping its own bits (ops/linear.can_stack)."""
        return _linear.can_stack(self.spec, sizes)

    @property
    def kv_tile(self) -> int:
        """The attention's KV tile (absolute positions summed together): chunked prefill aligns to it."""
        return self.spec.op("attention").kv_tile

    @property
    def kv_quant(self):
        """The KV cache's QuantSpec (FP8_KV) or None for a cache in the model's dtype."""
        return self.spec.op("attention").kv

    @property
    def index_quant(self):
        """The lightning indexer's key-cache rule (FP8_INDEX: it scores in FP8, the fp8_indexer preset) or None."""
        return self.spec.op("indexer").kv

    def grouped_linear(self, x, weight, counts, op="linear"):
        """x's rows packed by expert (counts[e] rows each) through ops.linear against weight[e]."""
        return _linear.grouped_linear(self.spec, x, weight, counts, op=op)

    def group_linear(self, x, weight):
        """x [T, G, K] through weight [G, N, K] group by group -> [T, G, N] (DeepSeek-V4's grouped output
        projection): grouped_linear over the groups' rows, one row per token."""
        t, groups = x.shape[:2]
        packed = x.transpose(0, 1).reshape(groups * t, -1)
        counts = [t] * groups
        if x.is_cuda and self.grouped_on_device(weight):
            # filled on the device: a CUDA graph holds the fill (a list would be a host copy, refused in capture)
            counts = torch.full((groups,), t, dtype=torch.int32, device=x.device)
        return self.grouped_linear(packed, weight, counts).view(groups, t, -1).transpose(0, 1)

    def grouped_expert_down(self, x, weight, counts, op="linear"):
        """ops.expert_down (FP32 output) of rows packed by expert, as grouped_linear."""
        return _linear.grouped_linear(self.spec, x, weight, counts, op=op, out_dtype=torch.float32)

    def softmax(self, x):
        """FP32 softmax over the last dim (the router's expert probabilities)."""
        return _softmax.softmax(self.spec, x)

    def sigmoid(self, x):
        """FP32 sigmoid (Qwen2-MoE's shared-expert gate, DeepSeek-V4's sigmoid router score)."""
        return _sigmoid.sigmoid(self.spec, x)

    def sqrtsoftplus(self, x):
        """FP32 sqrt(softplus(x)) (DeepSeek-V4's router score)."""
        return _sqrtsoftplus.sqrtsoftplus(self.spec, x)

    def rmsnorm(self, x, weight, eps, cast_last=False):
        """cast_last: scale by the weight in FP32 before the one rounding to x's dtype (DeepSeek-V4's norm)."""
        return _rmsnorm.rmsnorm(self.spec, x, weight, eps, cast_last)

    def add_rmsnorm(self, x, residual, weight, eps):
        """(rmsnorm(x + residual), x + residual): a residual add and the norm after it, in one launch on CUDA."""
        return _rmsnorm.add_rmsnorm(self.spec, x, residual, weight, eps)

    def rope(self, x, positions, cos_table, sin_table):
        return _rope.rope(self.spec, x, positions, cos_table, sin_table)

    def qk_norm_rope(self, x, q_weight, k_weight, q_heads, eps, positions, cos_table, sin_table):
        """x [T, heads, D], q's heads then k's: rmsnorm each part by its weight, then rope."""
        return _rope.qk_norm_rope(self.spec, x, q_weight, k_weight, q_heads, eps, positions, cos_table, sin_table)

    def rope_interleaved(self, x, positions, cos_table, sin_table, inverse=False):
        """RoPE on the trailing channels of each head in adjacent pairs (DeepSeek-V4's partial RoPE); inverse:
        the rotation undone (by -sin)."""
        return _rope.rope_interleaved(self.spec, x, positions, cos_table, sin_table, inverse)

    def silu_mul(self, gate, up, limit=None):
        return _silu_mul.silu_mul(self.spec, gate, up, limit)

    def relu2(self, x):
        """relu(x)^2 (Nemotron-H's MLP and experts)."""
        return _relu2.relu2(self.spec, x)

    def gated_rmsnorm(self, x, gate, weight, eps, group_size):
        """rmsnorm over groups of x * silu(gate) (Mamba-2's norm before out_proj)."""
        return _rmsnorm.gated_rmsnorm(self.spec, x, gate, weight, eps, group_size)

    def causal_conv1d(self, x, weight, bias, spans, state=None):
        """Mamba-2's depthwise causal conv and SiLU over each sequence of `spans`, its state kept per slot."""
        return _conv1d.causal_conv1d(self.spec, x, weight, bias, spans, state)

    def ssd(self, x, dt, B, C, A_log, D, dt_bias, spans, state=None, dt_limit=_ssd.NO_LIMIT,
            state_dtype=torch.float32):
        """Mamba-2's scan in the spec's fixed chunks, one arithmetic for every phase (ops/ssd.py)."""
        return _ssd.ssd(self.spec, x, dt, B, C, A_log, D, dt_bias, spans, state, dt_limit, state_dtype)

    def attention(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None):
        return _attention.attention(self.spec, q, k, v, k_cache, v_cache, meta, scale, sliding_window)

    def cache_write(self, cache, slots, x):
        """Rows x [N, *row] into a paged cache at slots [N] (FP8 by the spec's attention.kv)."""
        _cache_rows.write(self.spec, cache, slots, x)

    def cache_read(self, cache, slots, fresh=None, rows=None, staged=None):
        """The cache's rows at slots [...] (-1: zeros) in the model's dtype, or the staged rows at rows where
        rows >= 0: every phase's one read path; the gradient goes to `fresh` at `rows` (ops/cache_rows.py)."""
        return _cache_rows.read(self.spec, cache, slots, self.spec.dtype, fresh, rows, staged)

    def cache_read_stored(self, cache, slots):
        """The one-head rows at slots [...] (-1: zeros) as stored: an FP8 cache's codes [..., width] and row scales
        [..., 1] (FP8Tensor), a plain cache's rows [..., width]; no gradient (ops/cache_rows.py)."""
        return _cache_rows.gather_stored(cache, slots)

    def cache_stage(self, x, quantised=False):
        """This forward's rows x [N, 1, width] as a cache stores them (FP8 by the spec's attention.kv if
        `quantised`), to read with cache_read before they reach a ring."""
        return _cache_rows.stage(self.spec, x, quantised)

    def cache_copy(self, cache, staged, slots, rows):
        """Staged rows `rows` [N] into the cache's slots [N], as stored."""
        _cache_rows.copy(cache, slots, staged, rows)

    def sparse_attention(self, q, keys, valid, sinks, scale, decode=False):
        """Each query over its own gathered keys (K = V) with a sink per head (DeepSeek-V4); decode: a decode step
        (the baseline's path of its own)."""
        return _sparse_attention.sparse_attention(self.spec, q, keys, valid, sinks, scale, decode)

    def attention_weights(self, q, keys, valid, sinks, scale):
        """sparse_attention's probabilities [T, H, L] in plain FP32 (a training target, not a forward value)."""
        return _sparse_attention.weights(q, keys, valid, sinks, scale)

    def compress(self, kv, gate, bias, valid):
        """Gated pooling of windows of token rows into compressed entries, FP32 (DeepSeek-V4's compressor)."""
        return _compressor.compress(self.spec, kv, gate, bias, valid)

    def index_scores(self, q, keys, weights, valid, softmax_scale, weights_scale, key_values=None):
        """The lightning indexer's FP32 score of each entry for each query (DeepSeek-V4); in FP8 under the spec's
        indexer quantisation, keys then an FP8Tensor as cached and key_values their values for the gradient."""
        return _indexer.index_scores(self.spec, q, keys, weights, valid, softmax_scale, weights_scale, key_values)

    def index_topk(self, scores, valid, k):
        """The k best valid entries by (score, position), emitted by descending position, -1 last."""
        return _topk.index_topk(self.spec, scores, valid, k)

    def hc_pre(self, x, fn, base, scale, norm_eps, hc_eps, iters):
        """mHC before a block: (post, comb, the collapsed input) from the streams x [T, N, D]."""
        return _mhc.hc_pre(self.spec, x, fn, base, scale, norm_eps, hc_eps, iters)

    def hc_post(self, out, x, post, comb):
        """mHC after a block: the new streams from its output and the old streams."""
        return _mhc.hc_post(self.spec, out, x, post, comb)

    def hc_head(self, x, fn, base, scale, norm_eps, hc_eps):
        """mHC's final collapse of the streams before the last norm."""
        return _mhc.hc_head(self.spec, x, fn, base, scale, norm_eps, hc_eps)

    def token_logprobs(self, logits, tokens, temperature, keep=None):
        return _logprobs.token_logprobs(self.spec, logits, tokens, temperature, keep)

    def sampling_mask(self, logits, temperature, top_k, top_p):
        return _logprobs.sampling_mask(self.spec, logits, temperature, top_k, top_p)

    def probs(self, logits, temperature, keep=None):
        return _logprobs.probs(self.spec, logits, temperature, keep)

    def sample(self, probs, keys):
        return _sampling.sample(probs, keys)

    def sample_with_logprobs(self, logits, temperature, keys, keep=None, greedy=None):
        """sample(probs(logits, temperature, keep), keys) and the tokens' token_logprobs in one call:
        (tokens [N] int64, logprobs [N] FP32); greedy [N] bool rows take the argmax (ties to the larger
        index). On CUDA the probabilities never reach memory."""
        return _sampling.sample_with_logprobs(self.spec, logits, temperature, keys, keep, greedy)

    def topk(self, x, k):
        return _topk.topk(self.spec, x, k)


__all__ = ["Ops", "AttentionMetadata", "ExecutionSpec"]
