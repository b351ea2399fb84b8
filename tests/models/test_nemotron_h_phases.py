"""A Nemotron-H model's logits are the same bits in every phase: the trainer's forward (whole sequences, no state
kept), one prefill pass, chunked prefills cut where neither the scan's chunks nor the KV blocks are, and decode one
token a pass beside other sequences (the recurrent state kept per slot in a HybridCache). Baseline mode (the stock
paths: chunked scans from each pass's first token, the one-step recurrence in decode, SDPA) moves bits on the same
runs: the negative control."""
import pytest
import torch

from onepath.models import build_decoder
from onepath.models.batch import ForwardBatch, SeqChunk
from onepath.models.config import NemotronHConfig
from onepath.models.kv_cache import KVCache
from onepath.models.state_cache import StateCache
from onepath.ops import ExecutionSpec, Ops

BLOCK = 16
CHUNK = 8
LENGTHS = (1, CHUNK - 1, CHUNK + 1, 3 * CHUNK + 5, 2 * BLOCK + 3)


def tiny_config(**overrides) -> NemotronHConfig:
    fields = dict(vocab_size=61, hidden_size=32, layers_block_type=["linear_attention", "moe", "full_attention",
                                                                      "linear_attention", "mlp"],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=40, mamba_num_heads=4,
                  mamba_head_dim=6, ssm_state_size=5, n_groups=2, chunk_size=CHUNK, n_routed_experts=6,
                  num_experts_per_tok=2, moe_intermediate_size=12, moe_shared_expert_intermediate_size=20,
                  n_group=3, topk_group=2, max_position_embeddings=256)
    fields.update(overrides)
    return NemotronHConfig(**fields)


def tiny_model(mode="consistent", seed=0, **overrides):
    spec = ExecutionSpec(mode=mode).with_op("ssd", chunk=CHUNK)
    model = build_decoder(tiny_config(**overrides), Ops(spec))
    model.init_weights(seed, std=0.3)
    return model


def prompts(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 61, (n,), generator=g).tolist() for n in LENGTHS]


def trainer_logits(model, seqs):
    batch, blocks = ForwardBatch.for_sequences(seqs, BLOCK, model.device)
    with torch.no_grad():
        logits = model.compute_logits(model(batch, model.make_cache(blocks, BLOCK)))
    return list(logits.split([len(s) for s in seqs]))


def engine_logits(model, seqs, passes):
    """Each pass a list of (sequence, start, end): the tokens it computes; every sequence has its own state slot."""
    tables, first = [], 0
    for s in seqs:
        n = -(-len(s) // BLOCK)
        tables.append(list(range(first, first + n)))
        first += n
    cache = model.make_cache(first, BLOCK, num_slots=len(seqs) + 2)
    slot = {i: len(seqs) + 1 - i for i in range(len(seqs))}  # not the batch order
    rows = [[None] * len(s) for s in seqs]
    for pieces in passes:
        batch = ForwardBatch.build([SeqChunk(seqs[i][a:e], a, tables[i], slot[i]) for i, a, e in pieces], BLOCK,
                                   model.device)
        with torch.no_grad():
            logits = model.compute_logits(model(batch, cache))
        offset = 0
        for i, a, e in pieces:
            rows[i][a:e] = logits[offset:offset + e - a]
            offset += e - a
    return [torch.stack(r) for r in rows]


def whole(seqs):
    return [[(i, 0, len(s)) for i, s in enumerate(seqs)]]


def chunked(seqs, cuts=(3, 5, 11, 19, 20, 33)):
    """Every sequence cut at the same odd positions, its pieces in successive passes."""
    passes, done = [], [0] * len(seqs)
    for cut in (*cuts, max(map(len, seqs))):
        pieces = [(i, done[i], min(cut, len(s))) for i, s in enumerate(seqs) if done[i] < min(cut, len(s))]
        for i, _, e in pieces:
            done[i] = e
        if pieces:
            passes.append(pieces)
    return passes


def decoded(seqs, prefill=2):
    """A prefill of each sequence's first tokens, then one token per sequence per pass, all sequences together."""
    passes = [[(i, 0, min(prefill, len(s))) for i, s in enumerate(seqs)]]
    for p in range(prefill, max(map(len, seqs))):
        passes.append([(i, p, p + 1) for i, s in enumerate(seqs) if p < len(s)])
    return passes


def all_phases(model, seqs):
    return {"trainer": trainer_logits(model, seqs), "prefill": engine_logits(model, seqs, whole(seqs)),
            "chunked": engine_logits(model, seqs, chunked(seqs)), "decode": engine_logits(model, seqs, decoded(seqs))}


@pytest.mark.parametrize("overrides", [{}, {"mamba_ssm_cache_dtype": "bfloat16"},
                                       {"moe_latent_size": 16, "n_groups": 1, "conv_kernel": 2}])
def test_every_phase_gives_the_trainer_bits(overrides):
    model, seqs = tiny_model(**overrides), prompts()
    phases = all_phases(model, seqs)
    for name, got in phases.items():
        for b, (g, w) in enumerate(zip(got, phases["trainer"])):
            assert torch.equal(g, w), f"{name}, sequence {b} ({len(seqs[b])} tokens): max |diff| {(g - w).abs().max()}"


def test_baseline_moves_bits_on_the_same_runs():
    """Negative control: the stock paths give other bits in chunked prefill and in decode than in the trainer."""
    model, seqs = tiny_model("baseline"), prompts()
    phases = all_phases(model, seqs)
    for name in ("chunked", "decode"):
        moved = sum(not torch.equal(g, w) for g, w in zip(phases[name], phases["trainer"]))
        worst = max((g - w).abs().max() for g, w in zip(phases[name], phases["trainer"]))
        assert moved >= 2 and 0 < worst < 1e-3, (name, moved, worst)


def test_a_reused_slot_starts_afresh():
    """A slot that held another sequence's state gives a new sequence (starting at position 0) the bits of a
    fresh cache: nothing of the old state leaks."""
    model, seqs = tiny_model(), prompts()
    cache = model.make_cache(8, BLOCK, num_slots=1)
    with torch.no_grad():
        model(ForwardBatch.build([SeqChunk(seqs[3], 0, [0, 1], 0)], BLOCK), cache)
        again = model.compute_logits(model(ForwardBatch.build([SeqChunk(seqs[4], 0, [2, 3, 4], 0)], BLOCK), cache))
    assert torch.equal(again, trainer_logits(model, [seqs[4]])[0])


def test_the_state_cache_holds_what_decode_needs():
    config = tiny_config(mamba_ssm_cache_dtype="bfloat16")
    states = StateCache(config, 3, torch.float32, CHUNK)
    mamba = [i for i, t in enumerate(config.layers_block_type) if t == "linear_attention"]
    assert [i for i, s in enumerate(states.ssd) if s is not None] == mamba
    ssd = states.ssd[mamba[0]]
    assert ssd.ssm.shape == (3, 4, 6, 5) and ssd.ssm.dtype == torch.bfloat16
    assert ssd.x.shape == (3, CHUNK, 4, 6) and ssd.dt.shape == (3, CHUNK, 4) and ssd.B.shape == (3, CHUNK, 2, 5)
    assert states.conv[mamba[0]].shape == (3, config.conv_kernel - 1, config.conv_dim)
    per_slot = sum(t.numel() * t.element_size() for s in states.ssd if s for t in (s.ssm, s.x, s.dt, s.B)) + \
        sum(c.numel() * c.element_size() for c in states.conv if c is not None)
    assert StateCache.bytes_per_slot(config, torch.float32, CHUNK) * 3 == per_slot
    kv = KVCache(config, 4, BLOCK, torch.float32)
    assert [i for i, k in enumerate(kv.k) if k is not None] == [2]  # the attention layer alone keeps K/V
    assert KVCache.bytes_per_token(config, torch.float32) == 2 * 2 * 8 * 4
