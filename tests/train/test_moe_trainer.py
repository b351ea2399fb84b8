"""No routing replay: the trainer recomputes the MoE model's routing and log-probs, and they equal
the engine's bit for bit, before and after an update + in-place sync (the procedures of
tests/train/test_trainer_consistency.py on a tiny Qwen3-MoE); the baseline backend must differ. The
routing diagnostic counts the tokens an update moves to another expert set; the engine records its
routing and the trainer's recomputed routing equals it on every token over 20 RL steps."""
from pathlib import Path

import pytest
import torch

from onepath.numerics.diff import is_exact
from onepath.models.checkpoint import load_state_dict, save_checkpoint
from onepath.cli import main as cli_main
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.moe import MoeDecoder, expert_choices, routing_agreement, routing_changes
from onepath.numerics.spec import ExecutionSpec
from onepath.train.actor import Actor, Responses
from onepath.train.grpo import policy_loss
from onepath.train.metrics import read_metrics
from onepath.train.trainer import build_model
from tests.tiny import random_prompts, tiny_moe_config, tiny_moe_model
from tests.train import test_trainer_consistency as dense

DEMO = Path(__file__).resolve().parents[2] / "onepath" / "configs" / "demo.yaml"


@pytest.fixture(autouse=True)
def moe_model(monkeypatch):
    monkeypatch.setattr(dense, "tiny_model", tiny_moe_model)


def test_trainer_logprobs_equal_engine_logprobs():
    (metrics,) = dense.rollout_and_recompute("consistent", update=False)
    assert metrics["rollout_corr/valid_tokens"] > 100
    assert is_exact(metrics), metrics


def test_after_update_and_in_place_sync_still_equal():
    before, after = dense.rollout_and_recompute("consistent", update=True)
    assert is_exact(before) and is_exact(after), (before, after)


def test_fp8_experts_engine_equals_trainer(monkeypatch):
    """Block-FP8 experts (gate/up and the FP32-output down projection quantised per token, the same way
    in the engine's masked and the trainer's contiguous layout): diff = 0 before and after an update."""
    monkeypatch.setattr(dense, "tiny_model", lambda mode, **kw: tiny_moe_model(mode, quant="fp8", **kw))
    before, after = dense.rollout_and_recompute("consistent", update=True)
    assert is_exact(before) and is_exact(after), (before, after)
    block = tiny_moe_model("consistent", quant="fp8").model.layers[0].mlp
    plain = tiny_moe_model("consistent").model.layers[0].mlp
    x = torch.randn(5, block.experts.down_proj.shape[-1])
    assert not torch.equal(block.ops.expert_down(x, block.experts.down_proj[0]),
                           plain.ops.expert_down(x, plain.experts.down_proj[0]))  # the down projection is quantised


def test_negative_control_baseline_trainer_differs():
    (metrics,) = dense.rollout_and_recompute("baseline", update=False)
    assert metrics["rollout_corr/tokens_differing_frac"] > 0


def test_micro_batches_and_head_chunks_do_not_move_a_bit():
    dense.test_micro_batches_and_head_chunks_do_not_move_a_bit()


def test_routing_diagnostic_counts_tokens_an_update_moves():
    before, policy = tiny_moe_model("consistent", seed=4), tiny_moe_model("consistent", seed=4)
    seqs = random_prompts(torch.Generator().manual_seed(2), 8, low=10, high=30)
    same = routing_changes(before, policy, seqs)
    assert same["moe/tokens"] == sum(map(len, seqs)) and same["moe/routing_changed_tokens"] == 0
    actor = Actor(policy, block_size=16, lr=3e-2)
    for _ in range(2):  # a step of several updates: the later ones train on moved routing
        r = Responses.build(seqs, [s[:3] for s in seqs], [dense.PARAMS[0]] * len(seqs),
                            [[0.0] * 3 for _ in seqs])
        lp, _ = actor.logprobs(r)
        loss, _ = policy_loss(lp, lp.detach(), torch.randn(len(seqs), generator=torch.Generator().manual_seed(3)),
                              r.mask, 0.2)
        actor.update(loss)
    moved = routing_changes(before, policy, seqs)
    assert 0 < moved["moe/routing_changed_tokens"] < moved["moe/tokens"], moved
    assert moved["moe/routing_changed_frac"] == moved["moe/routing_changed_tokens"] / moved["moe/tokens"]
    assert len(expert_choices(policy, seqs)) == policy.config.num_hidden_layers


def test_build_model_builds_the_moe_decoder_from_a_checkpoint(tmp_path):
    model = tiny_moe_model("consistent", seed=7)
    save_checkpoint(tmp_path, model.hf_state_dict(), model.config)
    built = build_model(model.config, ExecutionSpec(), 64, load_state_dict(tmp_path))
    assert isinstance(built, MoeDecoder)
    assert all(torch.equal(t, built.state_dict()[k]) for k, t in model.state_dict().items())
    assert isinstance(build_model(tiny_moe_config(), ExecutionSpec(), 64, None), MoeDecoder)


def test_routing_agreement_counts_a_planted_mismatch_and_skips_uncomputed_positions():
    engine = torch.randint(0, 8, (2, 6, 3, 2), generator=torch.Generator().manual_seed(0))
    trainer = engine.clone()
    assert routing_agreement(list(engine), list(trainer)) == {"moe/routing_agreement": 1.0,
                                                              "moe/routing_compared_tokens": 12}
    trainer[1, 4, 2, 1] += 1  # one slot of one layer of one token
    assert routing_agreement(list(engine), list(trainer))["moe/routing_agreement"] == 11 / 12
    engine[1, 4] = -1  # a prefix-cache hit: the engine computed nothing there
    assert routing_agreement(list(engine), list(trainer)) == {"moe/routing_agreement": 1.0,
                                                              "moe/routing_compared_tokens": 11}
    with pytest.raises(ValueError, match="cover other positions"):
        routing_agreement([engine[0]], [trainer[0, :5]])


def test_engine_records_routing_at_every_position_it_computes():
    """Chunked prefill, preemption and prefix-cache hits: the engine's routing at each position it
    computed equals a whole-sequence forward's; positions served by the prefix cache read -1."""
    assert engine_routing_hits(tiny_moe_model("consistent", seed=3), max_tokens=24, repeats=1) >= 16


def engine_routing_hits(model, max_tokens: int, repeats: int) -> int:
    """Asserts the engine's recorded routing (chunked prefill, preemption, then the first prompt `repeats` times
    more) equals a whole-sequence forward's at every position it computed; returns the prefix-cache hits."""
    prompts = random_prompts(torch.Generator().manual_seed(4), 6, low=20, high=40)
    engine = LLMEngine(model, num_blocks=14, block_size=16, record_routing=True,
                       scheduler=SchedulerConfig(max_model_len=96, prefill_chunk_size=16))
    params = SamplingParams(max_tokens=max_tokens, seed=1)
    outs = engine.generate(prompts, params, request_ids=list(range(len(prompts))))
    assert engine.scheduler.num_preemptions > 0
    for again in range(repeats):  # its first full blocks: prefix-cache hits
        outs += engine.generate(prompts[:1], params, request_ids=[99 + again])
    hits = 0
    for o in outs:
        fed = o.prompt_token_ids + o.token_ids[:-1]
        whole = torch.stack(expert_choices(model, [fed]), 1)
        computed = (o.routing >= 0).all(-1).all(-1)
        assert o.routing.shape == whole.shape and computed.sum() > len(o.token_ids) - 1
        assert torch.equal(o.routing[computed], whole[computed])
        hits += int((~computed).sum())
    return hits


def test_twenty_rl_steps_recompute_the_rollout_routing_for_every_token(tmp_path):
    """`onepath train` on an embedded Qwen3-MoE: the trainer's routing equals the engine's on every
    compared token at every step (no routing replay), with diff = 0."""
    argv = ["train", "--config", str(DEMO), "--mode", "consistent", "--out", str(tmp_path), "--quiet",
            "--model.model_type", "qwen3_moe", "--model.num_experts", "8", "--model.moe_intermediate_size", "48",
            "--warm_start.steps", "20", "--train.steps", "20", "--train.prompts_per_step", "4",
            "--train.val_every", "0", "--train.save_every", "0"]
    assert cli_main(argv) == 0
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 20
    assert all(r["moe/routing_agreement"] == 1.0 and r["moe/routing_compared_tokens"] > 100 for r in records)
    assert all(r["rollout_corr/tokens_differing_frac"] == 0 for r in records)
