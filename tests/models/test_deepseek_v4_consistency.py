"""DeepSeek-V4's contract on the CPU, in FP32 and in BF16 (the GPU's default spec): a sequence's bits alone equal its
bits in a batch; whole prefill, chunked prefill and decode (and an FP8 KV cache read the same way, and the indexer
scoring FP8 codes from its own FP8 key pages) give the same bits;
the router's FP32 scores and its choices, the hash routing from the token id and the expert layouts do not depend on
the batch. The baseline mode (torch.topk, shape-dependent library kernels, a decode path of its own) differs on the
same cases: the negative controls. In BF16 torch's CPU GEMMs give a row the same bits at every M, so there the
baseline's differences come from its decode path (split by the batch), not from its prefill."""
import pytest
import torch

from onepath.consistency.recorder import Layout
from onepath.models.batch import ForwardBatch, SeqChunk
from onepath.models.deepseek_v4 import HashRouter, Indexer, MoE, TopKRouter
from onepath.numerics.quant import FP8Tensor
from onepath.numerics.spec import FP8_INDEX
from tests.tiny_deepseek_v4 import (BLOCK, CSA, HCA, SLIDING, onepath_logits, onepath_model, sequences,
                                    transformers_model)

# every layer type, both routers, a binding top-k, rates that leave windows open across chunks and decode steps
EDITS = dict(num_hidden_layers=4, layer_types=[CSA, HCA, SLIDING, CSA],
             mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
             compress_rates={CSA: 3, HCA: 5}, index_topk=2, sliding_window=6, hc_mult=3)
LENGTHS = (9, 23, 40, 31)


@pytest.fixture(scope="module")
def hf():
    return transformers_model(EDITS)


DTYPES = ["float32", "bfloat16"]


def models(hf, mode, quant=None, dtype="float32"):
    return onepath_model(hf, mode, quant, dtype=dtype)


def phase_logits(model, seqs, layout: Layout) -> list[torch.Tensor]:
    """Each sequence's logits at every position, its tokens computed in the passes `layout` schedules (prefill,
    chunks of it, then one token per pass), all sequences sharing each pass, over one paged cache."""
    tables, first = [], 0
    for s in seqs:
        tables.append(list(range(first, first - (-len(s) // BLOCK))))
        first = tables[-1][-1] + 1
    cache = model.make_cache(first, BLOCK, num_slots=len(seqs))
    out = [[None] * len(s) for s in seqs]
    with torch.no_grad():
        for pieces in layout.schedule([len(s) for s in seqs]):
            batch = ForwardBatch.build([SeqChunk(seqs[i][a:b], a, tables[i], i) for i, a, b in pieces], BLOCK,
                                       model.device)
            logits = model.compute_logits(model(batch, cache))
            rows = iter(logits)
            for i, a, b in pieces:
                for p in range(a, b):
                    out[i][p] = next(rows)
    return [torch.stack(rows) for rows in out]


LAYOUTS = {"chunks of 7": Layout(chunk=7), "decode": Layout(prefill=1), "prefill 11, chunks of 4, decode":
           Layout(prefill=11, chunk=4)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant", [None, "fp8_kv", "fp8_kv+fp8_indexer"])
def test_whole_chunked_and_decode_give_the_same_bits(hf, quant, dtype):
    model = models(hf, "consistent", quant, dtype)
    seqs = sequences(hf.config.vocab_size, LENGTHS)
    whole = phase_logits(model, seqs, Layout())
    for name, layout in LAYOUTS.items():
        for a, b in zip(whole, phase_logits(model, seqs, layout)):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_baseline_phases_differ(hf, dtype):
    """Negative control: the stock paths (M-dependent GEMMs, torch.topk's order, a decode path of its own) move
    bits between phases."""
    model = models(hf, "baseline", dtype=dtype)
    seqs = sequences(hf.config.vocab_size, LENGTHS)
    whole = phase_logits(model, seqs, Layout())
    decode = phase_logits(model, seqs, Layout(prefill=1))
    assert not all(torch.equal(a, b) for a, b in zip(whole, decode))
    if dtype == "float32":
        torch.testing.assert_close(torch.cat(whole), torch.cat(decode), rtol=1e-3, atol=1e-3)
    else:  # a BF16 difference can flip an indexer or router choice: close on average, not everywhere
        assert (torch.cat(whole) - torch.cat(decode)).abs().mean() < 0.05


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_cache_moves_the_logits_it_reads(hf, dtype):
    """The FP8 round trip is real (so its phase equality above says something)."""
    seqs = sequences(hf.config.vocab_size, LENGTHS)
    plain = onepath_logits(models(hf, "consistent", dtype=dtype), seqs)
    fp8 = onepath_logits(models(hf, "consistent", "fp8_kv", dtype), seqs)
    assert not torch.equal(plain, fp8)


def scored(model, seqs, monkeypatch) -> list[torch.Tensor]:
    """Each CSA layer's indexer scores [T, entries] of one forward over seqs."""
    out, select = [], Indexer.select

    def recorded(self, *args):
        picked, scores = select(self, *args)
        out.append(scores)
        return picked, scores
    with monkeypatch.context() as m:
        m.setattr(Indexer, "select", recorded)
        onepath_logits(model, seqs)
    return out


def test_fp8_indexer_scores_fp8_codes_from_its_own_key_pages(hf, monkeypatch):
    """fp8_indexer: the indexer's key pages hold e4m3 codes and a power-of-two row scale (FP8_INDEX) while the rest
    of the cache keeps its format; the bytes report counts them; the scores move from the model-dtype scorer's by
    FP8's error, not more (the first CSA layer, whose input both share); a sequence alone keeps its bits in a batch,
    the baseline's stock FP8 path does not."""
    model = models(hf, "consistent", "fp8_indexer")
    cache = model.make_cache(4, BLOCK, num_slots=1)
    csa = [layer for layer in cache.layers if layer.index_entries is not None]
    assert csa and all(isinstance(layer.index_entries, FP8Tensor) and layer.index_entries.rule == FP8_INDEX
                       and not isinstance(layer.entries, FP8Tensor) for layer in csa)
    plain = models(hf, "consistent")
    assert model.cache_bytes_per_token(BLOCK) < plain.cache_bytes_per_token(BLOCK)
    seqs = sequences(hf.config.vocab_size, LENGTHS)
    # the first layer's indexer sees the same input on both (later ones see what the selections made of it)
    fp8, fp32 = scored(model, seqs, monkeypatch)[0], scored(plain, seqs, monkeypatch)[0]
    live = torch.isfinite(fp32)
    assert torch.equal(live, torch.isfinite(fp8)) and not torch.equal(fp8, fp32)
    torch.testing.assert_close(fp8[live], fp32[live], rtol=0.1, atol=0.05 * float(fp32[live].abs().max()))
    for mode in ("consistent", "baseline"):
        m = models(hf, mode, "fp8_indexer")
        alone = torch.cat([onepath_logits(m, [s]) for s in seqs])
        assert torch.equal(alone, onepath_logits(m, seqs)) == (mode == "consistent")


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_sequence_alone_equals_sequence_in_a_batch(hf, mode):
    model = models(hf, mode)
    seqs = sequences(hf.config.vocab_size, LENGTHS)
    batch = onepath_logits(model, seqs)
    alone = torch.cat([onepath_logits(model, [s]) for s in seqs])
    assert torch.equal(alone, batch) == (mode == "consistent")


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_bf16_sequence_alone_equals_sequence_in_a_batch_in_prefill_and_decode(hf, mode):
    """BF16: prefill alone = in the batch on both sides (torch's BF16 CPU GEMMs are M-invariant), decode steps alone
    = in the batch on the consistent side only (the baseline's decode splits its candidates by the batch)."""
    model = models(hf, mode, dtype="bfloat16")
    seqs = sequences(hf.config.vocab_size, LENGTHS)
    assert torch.equal(torch.cat([onepath_logits(model, [s]) for s in seqs]), onepath_logits(model, seqs))
    batch = phase_logits(model, seqs, Layout(prefill=1))
    alone = [phase_logits(model, [s], Layout(prefill=1))[0] for s in seqs]
    assert all(torch.equal(a, b) for a, b in zip(alone, batch)) == (mode == "consistent")


def test_router_scores_are_fp32_and_batch_invariant_and_hash_routing_follows_the_token(hf):
    """Each router's experts for a sequence alone equal its experts in the batch; a hash layer's are the token's
    tid2eid row whatever its context; the gate GEMM gives FP32 rows with the bits of a single-row launch."""
    model = models(hf, "consistent")
    seqs = sequences(hf.config.vocab_size, LENGTHS)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]

    def experts(ss):
        chosen = {id(r): [] for r in routers}
        handles = [r.register_forward_hook(lambda m, args, out: chosen[id(m)].append(out[1])) for r in routers]
        try:
            onepath_logits(model, ss)
        finally:
            for h in handles:
                h.remove()
        return [torch.cat(chosen[id(r)]) for r in routers]

    batch = experts(seqs)
    alone = [torch.cat(parts) for parts in zip(*[experts([s]) for s in seqs])]
    assert all(torch.equal(a, b) for a, b in zip(alone, batch))
    ids = torch.tensor([t for s in seqs for t in s])
    hashed = [(r, e) for r, e in zip(routers, batch) if isinstance(r, HashRouter)]
    assert hashed and all(torch.equal(e, r.tid2eid[ids]) for r, e in hashed)
    gate = next(r for r in routers if not isinstance(r, HashRouter))
    x = torch.randn(37, hf.config.hidden_size)
    for mode in ("consistent", "baseline"):
        ops = models(hf, mode).ops
        full = ops.router(x, gate.weight)
        rows = torch.cat([ops.router(x[i:i + 1], gate.weight) for i in range(37)])
        assert full.dtype == torch.float32 and torch.equal(rows, full) == (mode == "consistent")


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_and_contiguous_expert_layouts_give_the_same_bits(hf, dtype):
    model = models(hf, "consistent", dtype=dtype)
    seqs = sequences(hf.config.vocab_size, LENGTHS)
    out = {}
    for layout in ("masked", "contiguous"):
        for m in model.modules():
            if isinstance(m, MoE):
                m.layout = layout
        out[layout] = onepath_logits(model, seqs)
    assert torch.equal(out["masked"], out["contiguous"])


@pytest.mark.parametrize("quant", [None, "fp8_indexer"])
def test_indexer_is_frozen_by_default_and_trainable_as_an_option(hf, quant):
    """Frozen: the indexer's weights take no gradient. Unfrozen: a training forward leaves the indexer's own loss
    (KL from the attention's probabilities of the selected entries), whose gradient reaches the indexer's weights
    only and which a few steps on them lower; the forward's bits are the frozen model's. Scoring in FP8, the
    gradient reaches the indexer's compressor through its keys' values, straight through their codes."""
    model = models(hf, "consistent", quant)
    indexer = {n: p for n, p in model.named_parameters() if ".indexer." in n}
    assert indexer and not any(p.requires_grad for p in indexer.values())
    assert all(p.requires_grad for n, p in model.named_parameters() if n not in indexer)
    seqs = sequences(hf.config.vocab_size, LENGTHS)
    batch, blocks = ForwardBatch.for_sequences(seqs, BLOCK)
    frozen = model.compute_logits(model(batch, model.make_cache(blocks, BLOCK)))
    with pytest.raises(RuntimeError, match="no indexer loss recorded"):
        model.indexer_loss()
    model.freeze_indexer(False)
    optimizer = torch.optim.SGD(indexer.values(), lr=0.5)
    losses = []
    for step in range(4):
        logits = model.compute_logits(model(batch, model.make_cache(blocks, BLOCK)))
        if step == 0:
            assert torch.equal(logits, frozen)
        loss = model.indexer_loss()
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            assert all(p.grad is None for n, p in model.named_parameters() if n not in indexer)
            assert all(p.grad is not None for p in indexer.values())
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
