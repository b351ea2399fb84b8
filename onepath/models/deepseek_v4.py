"""DeepSeek-V4 decoder, written once against `ops`: transformers' DeepseekV4ForCausalLM, module by module.

Each layer: mHC collapses the residual streams into the block's input, the attention block runs, mHC mixes
its output back into the streams; the same around the MoE block. Attention reads one shared KV head as K and
V (partial interleaved RoPE on the trailing channels, the output's rotation undone), a sink per head, the
sliding window of `sliding_window` keys and, in CSA / HCA layers, compressed entries: every one a query may
see (HCA), or those the lightning indexer's deterministic top-k picks (CSA). The output projection is
grouped, low rank. The MoE block routes by a learned gate (top-k of sqrtsoftplus / sigmoid / softmax scores
plus a bias) or by the token id (tid2eid), runs the experts in models/moe.py's layouts with the SwiGLU clamp,
adds a shared expert, and combines in FP32 in slot order.

Everything a query reads goes through the paged cache (deepseek_v4_cache.py), so prefill, chunked prefill,
decode and the trainer compute it with one arithmetic. Parameter names are transformers' in memory; the
checkpoint layout is deepseek_v4_names.py's. The design: docs/models.md.
"""
from __future__ import annotations

import torch
from torch import nn

from onepath.models.batch import ForwardBatch
from onepath.models.deepseek_v4_cache import DeepseekV4Cache, LayerCache, Locator
from onepath.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from onepath.models.deepseek_v4_names import from_checkpoint, to_checkpoint
from onepath.models import dense
from onepath.models.dense import Linear
from onepath.models.kv_cache import BLOCK_SIZE
from onepath.models.moe import CAPACITY, MASKED_MAX_TOKENS, Experts, Router, slot_sum
from onepath.models.rope_scaling import frequencies, table
from onepath.ops import Ops

FP32 = torch.float32  # the modules transformers keeps in FP32 whatever the model's dtype


class RMSNorm(dense.RMSNorm):
    """DeepSeek-V4's norm: its weight FP32 whatever the model's dtype, applied before the one rounding to the input's
    dtype (transformers' DeepseekV4RMSNorm)."""

    def __init__(self, ops: Ops, size: int, eps: float):
        super().__init__(ops, size, eps, FP32)

    def forward(self, x):
        return self.ops.rmsnorm(x, self.weight, self.eps, cast_last=True)


class HyperConnection(nn.Module):
    """attn_hc / ffn_hc: mHC's projection to (pre, post, comb) of N streams."""

    def __init__(self, config: DeepseekV4Config, rows: int):
        super().__init__()
        n = config.hc_mult
        self.fn = nn.Parameter(torch.empty(rows, n * config.hidden_size, dtype=FP32))
        self.base = nn.Parameter(torch.empty(rows, dtype=FP32))
        self.scale = nn.Parameter(torch.empty(3, dtype=FP32))


class HyperHead(nn.Module):
    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        n = config.hc_mult
        self.hc_fn = nn.Parameter(torch.empty(n, n * config.hidden_size, dtype=FP32))
        self.hc_base = nn.Parameter(torch.empty(n, dtype=FP32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=FP32))


class Rope(nn.Module):
    """cos / sin tables of the "main" (sliding layers) and "compress" (CSA / HCA layers, compressors, indexer)
    RoPE over the rotated slice, as transformers' DeepseekV4RotaryEmbedding computes them."""

    def __init__(self, config: DeepseekV4Config, max_positions: int):
        super().__init__()
        for label in ("main", "compress"):
            cos, sin = table(*frequencies(config.rope(label), config.rope_dim, config.max_position_embeddings),
                             max_positions)
            self.register_buffer(f"{label}_cos", cos, persistent=False)
            self.register_buffer(f"{label}_sin", sin, persistent=False)

    def tables(self, label: str) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"{label}_cos"), getattr(self, f"{label}_sin")


class Compressor(nn.Module):
    """Pools every window of `rate` tokens into one entry of `dim` channels (HCA); with `overlap` (CSA) each
    entry pools the previous window's first half-rows and its own second half-rows, 2 * rate slots."""

    def __init__(self, ops: Ops, config: DeepseekV4Config, dim: int, rate: int, overlap: bool):
        super().__init__()
        self.ops, self.dim, self.rate, self.overlap = ops, dim, rate, overlap
        self.span = rate * (2 if overlap else 1)  # the input rows an entry pools
        width = (2 if overlap else 1) * dim
        dtype = ops.spec.dtype
        self.kv_proj = Linear(ops, config.hidden_size, width, False, dtype)
        self.gate_proj = Linear(ops, config.hidden_size, width, False, dtype)
        self.position_bias = nn.Parameter(torch.empty(rate, width, dtype=FP32))
        self.kv_norm = RMSNorm(ops, dim, config.rms_norm_eps)

    def compress(self, x, batch: ForwardBatch, loc: Locator, state_cache, entry_cache, rope: Rope) -> torch.Tensor:
        """Pools the windows that close in this forward from their compressor inputs (this forward's, staged, and
        the earlier ones in the sequence's ring), writes the entries into the pages and the inputs of the windows
        still open into the ring; returns the entries at their closing rows of a [T, 1, dim] tensor (the reads'
        gradient source)."""
        ops = self.ops
        state = torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)[:, None]            # [T, 1, 2 * width]
        staged = ops.cache_stage(state)
        closing, closes = loc.closing(self.rate)
        # a forward in which no window closes (prefill chunks inside one) launches nothing over zero windows: on CUDA
        # the norm's FP8 copy for the next GEMM cannot shape zero rows. Under grad the empty pooling runs, so the
        # compressor's weights get their zero gradient, as in any other batch.
        if closing.numel() or torch.is_grad_enabled():
            fresh = self.pool(state, staged, closing, closes, batch, loc, state_cache, entry_cache, rope)
        else:
            fresh = state.new_zeros(state.shape[0], 1, self.dim)
        if state_cache is not None:
            ops.cache_copy(state_cache, staged, *loc.ring_writes(self.span))
        return fresh

    def pool(self, state, staged, closing, closes, batch: ForwardBatch, loc: Locator, state_cache, entry_cache,
             rope: Rope) -> torch.Tensor:
        """compress's entries of the windows that close at rows `closing`, written to the pages, at those rows of a
        [T, 1, dim] tensor."""
        ops, rate, dim, span = self.ops, self.rate, self.dim, self.span
        positions = batch.positions[closing, None] - span + 1 + torch.arange(span, device=state.device)
        valid = positions >= 0
        slots, rows = loc.ring(closing, positions, valid, span)
        kv, gate = ops.cache_read(state_cache, slots, state, rows, staged)[:, :, 0].chunk(2, dim=-1)  # [E, span, w]
        bias = self.position_bias
        if self.overlap:  # slots 0..rate-1: the previous window's first halves; rate..: this window's second
            kv = torch.cat([kv[:, :rate, :dim], kv[:, rate:, dim:]], dim=1)
            gate = torch.cat([gate[:, :rate, :dim], gate[:, rate:, dim:]], dim=1)
            bias = torch.cat([bias[:, :dim], bias[:, dim:]], dim=0)
        entries = self.kv_norm(ops.compress(kv, gate, bias, valid))
        cos, sin = rope.tables("compress")
        start = (batch.positions[closing] - rate + 1).clamp(min=0)  # a row that closes nothing: its entry unused
        entries = ops.rope_interleaved(entries[:, None], start, cos, sin)
        ops.cache_write(entry_cache, loc.entry_writes(closing, closes, rate), entries)
        # zeros at the rows that close nothing (a decode step computes every row): one row per token, as recorded
        return entries.new_zeros(state.shape[0], 1, dim).index_copy(0, closing, torch.where(closes[:, None, None],
                                                                                             entries, 0.0))


class Scorer(nn.Module):
    def __init__(self, ops: Ops, config: DeepseekV4Config):
        super().__init__()
        self.weights_proj = Linear(ops, config.hidden_size, config.index_n_heads, False, ops.spec.dtype)


class Indexer(Compressor):
    """The lightning indexer: its own compressor at index_head_dim, a query per indexer head from the attention's
    low-rank query, and the deterministic top-k of each query's scores over the entries it may see."""

    def __init__(self, ops: Ops, config: DeepseekV4Config, rate: int):
        super().__init__(ops, config, config.index_head_dim, rate, overlap=True)
        self.heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = Linear(ops, config.q_lora_rank, self.heads * self.dim, False, ops.spec.dtype)
        self.scorer = Scorer(ops, config)

    @property
    def trained(self) -> bool:
        """Whether this forward trains the indexer (its weights unfrozen, grad on): then it reads its inputs
        detached, so its loss reaches its own weights only, and keeps its scores for that loss."""
        return torch.is_grad_enabled() and self.q_b_proj.weight.requires_grad

    def select(self, x, q_residual, batch: ForwardBatch, loc: Locator, cache: LayerCache, rope: Rope):
        """([T, index_topk] entry indices of each query by descending position, -1 where none; the scores
        [T, entries])."""
        if self.trained:
            x, q_residual = x.detach(), q_residual.detach()
        ops, t = self.ops, x.shape[0]
        fresh = self.compress(x, batch, loc, cache.index_state, cache.index_entries, rope)
        _, valid, slots, rows = loc.cached(("entries", self.rate), lambda: entry_candidates(loc, self.rate))
        cos, sin = rope.tables("compress")
        q = ops.rope_interleaved(self.q_b_proj(q_residual).view(t, self.heads, self.dim), batch.positions, cos, sin)
        weights, scales = self.scorer.weights_proj(x), (self.dim ** -0.5, self.heads ** -0.5)
        if ops.index_quant is None:
            keys = ops.cache_read(cache.index_entries, slots, fresh, rows)[:, :, 0]
            scores = ops.index_scores(q, keys, weights, valid, *scales)
        else:  # FP8: codes and row scales as cached; a trained indexer's gradient reaches its keys straight through
            values = ops.cache_read(cache.index_entries, slots, fresh, rows)[:, :, 0] if self.trained else None
            scores = ops.index_scores(q, ops.cache_read_stored(cache.index_entries, slots), weights, valid, *scales,
                                      key_values=values)
        return ops.index_topk(scores, valid, self.topk), scores

    def loss(self, picked: torch.Tensor, scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """KL(attention || indexer) over each query's selected entries, as DeepSeek-V3.2 trains its indexer:
        `weights` [T, k] the main attention's probabilities of those entries summed over heads (no gradient),
        normalised; the indexer's log-softmax of its scores of the same entries. Mean over the queries that
        selected any."""
        chosen = picked >= 0
        target = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
        logits = scores.gather(-1, picked.clamp(min=0)).masked_fill(~chosen, -torch.inf)
        log_q = torch.log_softmax(logits, dim=-1)
        kl = torch.where(chosen & (target > 0), target * (target.log() - log_q), 0.0).sum(-1)
        rows = chosen.any(-1)
        return kl[rows].mean() if bool(rows.any()) else scores.sum() * 0.0


class CSACompressor(Compressor):
    def __init__(self, ops: Ops, config: DeepseekV4Config):
        rate = config.compress_rates[CSA]
        super().__init__(ops, config, config.head_dim, rate, overlap=True)
        self.indexer = Indexer(ops, config, rate)


def entry_candidates(loc: Locator, rate: int):
    """Every entry a query of this forward may see, by index w < the longest context // rate: indices [T, E],
    valid (w < (p + 1) // rate), their page slots and rows."""
    meta = loc.meta
    t = meta.positions.shape[0]
    w = torch.arange(max(meta.context_lens, default=0) // rate, device=meta.positions.device)
    index = w.expand(t, -1)
    valid = w[None, :] < ((meta.positions + 1) // rate)[:, None]
    return (index, valid, *loc.entries(torch.arange(t, device=w.device), index, valid, rate))


class Attention(nn.Module):
    def __init__(self, ops: Ops, config: DeepseekV4Config, layer: int):
        super().__init__()
        self.ops, self.config = ops, config
        self.kind = config.layer_types[layer]
        self.rope_label = "main" if self.kind == SLIDING else "compress"
        h, d, dtype = config.num_attention_heads, config.head_dim, ops.spec.dtype
        self.heads, self.head_dim, self.groups = h, d, config.o_groups
        self.q_a_proj = Linear(ops, config.hidden_size, config.q_lora_rank, False, dtype)
        self.q_a_norm = RMSNorm(ops, config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = Linear(ops, config.q_lora_rank, h * d, False, dtype)
        self.kv_proj = Linear(ops, config.hidden_size, d, False, dtype)
        self.kv_norm = RMSNorm(ops, d, config.rms_norm_eps)
        self.o_a_proj = Linear(ops, h * d // self.groups, self.groups * config.o_lora_rank, False, dtype)
        self.o_b_proj = Linear(ops, self.groups * config.o_lora_rank, config.hidden_size, False, dtype)
        self.sinks = nn.Parameter(torch.empty(h, dtype=FP32))
        if self.kind == CSA:
            self.compressor = CSACompressor(ops, config)
        elif self.kind == HCA:
            self.compressor = Compressor(ops, config, d, config.compress_rates[HCA], overlap=False)
        self.register_buffer("unit", torch.ones(d, dtype=FP32), persistent=False)

    def forward(self, x, batch: ForwardBatch, cache: LayerCache, loc: Locator, rope: Rope):
        ops, t, eps = self.ops, x.shape[0], self.config.rms_norm_eps
        pos = batch.positions
        cos, sin = rope.tables(self.rope_label)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = ops.rmsnorm(self.q_b_proj(q_residual).view(t, self.heads, self.head_dim), self.unit, eps, cast_last=True)
        q = ops.rope_interleaved(q, pos, cos, sin)
        kv = ops.rope_interleaved(self.kv_norm(self.kv_proj(x)).view(t, 1, self.head_dim), pos, cos, sin)
        staged = ops.cache_stage(kv, quantised=ops.kv_quant is not None)
        window = self.config.sliding_window
        _, valid, slots, rows = loc.cached("window", lambda: window_candidates(loc, window))
        keys, masks = [ops.cache_read(cache.kv, slots, kv, rows, staged)], [valid]
        if cache.kv is not None:
            ops.cache_copy(cache.kv, staged, *loc.ring_writes(window))
        selection = None
        if self.kind != SLIDING:
            keys_c, valid_c, selection = self.compressed(x, q_residual, batch, cache, loc, rope)
            keys.append(keys_c)
            masks.append(valid_c)
        keys, masks = torch.cat(keys, dim=1)[:, :, 0], torch.cat(masks, dim=1)
        o = ops.sparse_attention(q, keys, masks, self.sinks, self.head_dim ** -0.5, loc.decode)
        if selection is not None and self.compressor.indexer.trained:
            with torch.no_grad():
                weights = ops.attention_weights(q, keys, masks, self.sinks, self.head_dim ** -0.5)[:, :, window:]
            self.indexer_loss = self.compressor.indexer.loss(*selection, weights.sum(1))
        o = ops.rope_interleaved(o, pos, cos, sin, inverse=True)
        grouped = o.reshape(t, self.groups, -1)
        mixed = ops.group_linear(grouped, self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1]))
        return self.o_b_proj(mixed.reshape(t, -1))

    def compressed(self, x, q_residual, batch, cache: LayerCache, loc: Locator, rope: Rope):
        """This query's compressed entries [T, C, 1, D] and their validity [T, C]: all it may see in an HCA
        layer (ascending), the indexer's selection in a CSA layer (descending position, invalid last); and in
        a CSA layer the indexer's (selection, scores)."""
        c = self.compressor
        fresh = c.compress(x, batch, loc, cache.state, cache.entries, rope)
        selection = None
        if self.kind == HCA:
            _, valid, slots, rows = loc.cached(("entries", c.rate), lambda: entry_candidates(loc, c.rate))
        else:
            selection = c.indexer.select(x, q_residual, batch, loc, cache, rope)
            valid = selection[0] >= 0
            slots, rows = loc.entries(torch.arange(x.shape[0], device=x.device), selection[0], valid, c.rate)
        return self.ops.cache_read(cache.entries, slots, fresh, rows), valid, selection


def window_candidates(loc: Locator, window: int):
    """Each query's sliding window, positions p - window + 1 .. p ascending [T, window]: valid, ring slots and
    this forward's rows."""
    meta = loc.meta
    t = meta.positions.shape[0]
    positions = meta.positions[:, None] - window + 1 + torch.arange(window, device=meta.positions.device)
    valid = positions >= 0
    return (positions, valid, *loc.ring(torch.arange(t, device=positions.device), positions, valid, window))


class TopKRouter(Router):
    """mlp.gate: (weights [T, k] FP32, experts [T, k]) from the top-k of the scores plus a bias; a moe.Router, so
    the routing recorders (the engine's, the trainer's agreement check) see its choices."""

    def __init__(self, ops: Ops, config: DeepseekV4Config):
        nn.Module.__init__(self)
        self.ops, self.config = ops, config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=ops.spec.dtype))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=FP32))

    def choose(self, x, input_ids, scores):
        return self.ops.topk(scores + self.e_score_correction_bias, self.config.num_experts_per_tok)[1]

    def forward(self, x, input_ids):
        """(weights [T, k] FP32, experts [T, k])."""
        config = self.config
        scores = getattr(self.ops, config.scoring_func)(self.ops.router(x, self.weight))
        experts = self.choose(x, input_ids, scores)
        weights = scores.gather(-1, experts)
        weights = weights / (slot_sum(weights).unsqueeze(-1) + 1e-20)
        return weights * config.routed_scaling_factor, experts


class HashRouter(TopKRouter):
    """Experts from the token id (tid2eid), weights from the learned gate's scores."""

    def __init__(self, ops: Ops, config: DeepseekV4Config):
        nn.Module.__init__(self)
        self.ops, self.config = ops, config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=ops.spec.dtype))
        self.register_buffer("tid2eid", torch.zeros(config.vocab_size, config.num_experts_per_tok, dtype=torch.long))

    def choose(self, x, input_ids, scores):
        return self.tid2eid[input_ids]


class SharedExpert(nn.Module):
    def __init__(self, ops: Ops, config: DeepseekV4Config):
        super().__init__()
        h, i, bias, dtype = config.hidden_size, config.moe_intermediate_size, config.mlp_bias, ops.spec.dtype
        self.gate_proj = Linear(ops, h, i, bias, dtype)
        self.up_proj = Linear(ops, h, i, bias, dtype)
        self.down_proj = Linear(ops, i, h, bias, dtype)


class MoE(nn.Module):
    def __init__(self, ops: Ops, config: DeepseekV4Config, layer: int):
        super().__init__()
        self.ops, self.limit = ops, config.swiglu_limit
        self.gate = (HashRouter if config.mlp_layer_types[layer] == "hash_moe" else TopKRouter)(ops, config)
        self.experts = Experts(ops, config, ops.spec.dtype)
        self.shared_experts = SharedExpert(ops, config)
        self.capacity, self.masked_max_tokens = CAPACITY, MASKED_MAX_TOKENS
        self.layout: str | None = None  # None: masked up to masked_max_tokens tokens, else contiguous (moe.py)

    def forward(self, x, input_ids):
        weights, experts = self.gate(x, input_ids)
        layout = self.layout or ("masked" if x.shape[0] <= self.masked_max_tokens else "contiguous")
        out = slot_sum(weights.unsqueeze(-1) * self.experts(x, experts, layout, self.capacity))
        se, ops = self.shared_experts, self.ops
        act = ops.silu_mul(se.gate_proj(x), se.up_proj(x), self.limit)
        # the shared expert joins the FP32 sum unrounded; the sum is rounded once
        return (out + ops.expert_down(act, se.down_proj.weight, se.down_proj.bias)).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, ops: Ops, config: DeepseekV4Config, layer: int):
        super().__init__()
        self.ops, self.config = ops, config
        n = config.hc_mult
        self.self_attn = Attention(ops, config, layer)
        self.mlp = MoE(ops, config, layer)
        self.input_layernorm = RMSNorm(ops, config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(ops, config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config, (2 + n) * n)
        self.ffn_hc = HyperConnection(config, (2 + n) * n)

    def forward(self, x, batch: ForwardBatch, cache: LayerCache, loc: Locator, rope: Rope):
        """x: the residual streams [T, hc_mult, hidden]."""
        ops, c = self.ops, self.config
        mix = lambda hc, streams: ops.hc_pre(streams, hc.fn, hc.base, hc.scale, c.rms_norm_eps, c.hc_eps,
                                             c.hc_sinkhorn_iters)
        post, comb, collapsed = mix(self.attn_hc, x)
        x = ops.hc_post(self.self_attn(self.input_layernorm(collapsed), batch, cache, loc, rope), x, post, comb)
        post, comb, collapsed = mix(self.ffn_hc, x)
        return ops.hc_post(self.mlp(self.post_attention_layernorm(collapsed), batch.input_ids), x, post, comb)


class DeepseekV4Decoder(nn.Module):
    # the engine keeps each running sequence's window and open compressor windows in a slot's rings
    has_recurrent_state = True
    prefix_caching_refused = ("a cached prefix holds its compressed entries but not the sequence's rings after it "
                              "(its sliding window and open compressor windows)")

    @property
    def capturable(self) -> bool:
        """Whether decode steps may run in CUDA graphs: a decode step finds its rows on the device (Locator), and
        the experts must read their counts there too (grouped launches: on CUDA; loops read them on the host)."""
        return all(m.experts.counts_on_device for m in self.modules() if isinstance(m, MoE))

    def __init__(self, config: DeepseekV4Config, ops: Ops, max_positions: int | None = None):
        super().__init__()
        self.config, self.ops = config, ops
        dtype = ops.spec.dtype
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.model.layers = nn.ModuleList(DecoderLayer(ops, config, i) for i in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(ops, config.hidden_size, config.rms_norm_eps)
        self.model.hc_head = HyperHead(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        self.rope = Rope(config, max_positions or config.max_position_embeddings)
        self.freeze_indexer()
        if self.rope.main_cos.device.type != "meta":
            self.to(ops.spec.device)

    def freeze_indexer(self, frozen: bool = True) -> "DeepseekV4Decoder":
        """The lightning indexer's weights take no gradient (frozen: the default, as DeepSeek-V3.2 and GLM-5
        train theirs apart); frozen=False makes them trainable: each forward with grad on then leaves in
        `indexer_loss()` the indexer's own loss, which reaches its weights only. Neither moves a forward bit."""
        for name, p in self.named_parameters():
            if ".indexer." in name:
                p.requires_grad_(not frozen)
        return self

    def indexer_loss(self) -> torch.Tensor:
        """The sum over CSA layers of the last training forward's indexer loss (Indexer.loss), then forgotten;
        add it to the policy loss to train an unfrozen indexer."""
        losses = [m.__dict__.pop("indexer_loss") for m in self.modules()
                  if isinstance(m, Attention) and "indexer_loss" in m.__dict__]
        if not losses:
            raise RuntimeError("no indexer loss recorded: unfreeze the indexer (freeze_indexer(False)) and run a "
                               "forward with grad enabled over a model with compressed_sparse_attention layers")
        return torch.stack(losses).sum()

    def share_projection_storage(self) -> None:
        """Nothing to share: no stacked projections (DenseDecoder's engine hook)."""

    @property
    def device(self) -> torch.device:
        return self.rope.main_cos.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    @property
    def rope_cos(self) -> torch.Tensor:
        """A RoPE table: its rows are the positions the model can run (the engine checks max_model_len by it)."""
        return self.rope.main_cos

    def make_cache(self, num_blocks: int, block_size: int, num_slots: int = 0) -> DeepseekV4Cache:
        """Pages for num_blocks token blocks and rings for num_slots running sequences and the scratch slot (0: whole
        sequences, no rings)."""
        return DeepseekV4Cache(self.config, num_blocks, block_size, self.ops.spec.dtype, self.device,
                               kv=self.ops.kv_quant, num_slots=num_slots, index_kv=self.ops.index_quant)

    def cache_bytes_per_token(self, block_size: int = BLOCK_SIZE) -> float:
        return DeepseekV4Cache.bytes_per_token(self.config, self.ops.spec.dtype, self.ops.kv_quant, block_size,
                                               self.ops.index_quant)

    def cache_bytes_per_slot(self) -> int:
        return DeepseekV4Cache.bytes_per_slot(self.config, self.ops.spec.dtype, self.ops.kv_quant,
                                              self.ops.index_quant)

    def forward(self, batch: ForwardBatch, cache: DeepseekV4Cache, layer_fn=None) -> torch.Tensor:
        """Hidden states after the final norm [T, hidden]; layer_fn(layer, *args) as DenseDecoder's."""
        c, ops = self.config, self.ops
        x = ops.embedding(batch.input_ids, self.model.embed_tokens.weight, c.padding_idx)
        x = x.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
        slots = None
        if cache.num_slots:
            slots = list(range(batch.attn.num_seqs)) if batch.state_slots is None else batch.state_slots
        loc = Locator(batch.attn, slots, cache.scratch_block)
        for layer, layer_cache in zip(self.model.layers, cache.layers):
            args = (x, batch, layer_cache, loc, self.rope)
            x = layer(*args) if layer_fn is None else layer_fn(layer, *args)
        head = self.model.hc_head
        return self.model.norm(ops.hc_head(x, head.hc_fn, head.hc_base, head.hc_scale, c.rms_norm_eps, c.hc_eps))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.lm_head(hidden, self.lm_head_weight)

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Random weights (norms 1, biases, sinks and position biases 0, mHC scales 1) and a random hash table."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("scale") or name.endswith("hc_scale"):
                p.fill_(1.0)
            elif name.endswith(("bias", "sinks", "position_bias", "base", "hc_base")):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        for name, b in self.named_buffers():
            if name.endswith("tid2eid"):
                rows = torch.stack([torch.randperm(self.config.n_routed_experts, generator=g)[:b.shape[1]]
                                    for _ in range(b.shape[0])])
                b.copy_(rows)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """From a checkpoint in DeepSeek's layout (as transformers' save_pretrained writes it, with or without the
        model. prefix) or in transformers' in-memory names; the mtp.* layers are skipped."""
        state = from_checkpoint(state, self.config)
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        indexer = sorted({int(n.split(".")[2]) for n in missing if ".indexer." in n})
        if indexer:
            raise ValueError(f"checkpoint lacks the lightning indexer's tensors of layers {indexer} (first "
                             f"{[n for n in missing if '.indexer.' in n][:2]}): layer_types makes them "
                             f"{CSA!r}, which has an indexer; fix layer_types or use a checkpoint that has them")
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, first {missing[:3]}: it does not match "
                             "config.json (layer_types decide which layers carry a compressor and an indexer)")
        unexpected = sorted(set(state) - set(expected) - ({"lm_head.weight"} if self.config.tie_word_embeddings
                                                          else set()))
        if unexpected:
            raise ValueError(f"checkpoint has {len(unexpected)} tensors this model does not, first {unexpected[:3]}")
        with torch.no_grad():
            for name, tensor in expected.items():
                if tuple(state[name].shape) != tuple(tensor.shape):
                    raise ValueError(f"tensor {name} has shape {tuple(state[name].shape)}, config.json implies "
                                     f"{tuple(tensor.shape)}")
                tensor.copy_(state[name])

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """DeepSeek's layout, as transformers' save_pretrained writes it (from_pretrained renames it back)."""
        return to_checkpoint({k: v.detach().cpu() for k, v in self.state_dict().items()})
