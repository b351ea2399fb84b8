"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM: FP32 logits on the CPU within 1e-4 on random small
configs that cover every layer type and option, each sequence run by transformers alone and by onepath in one
batch; BF16 logits (the GPU's spec) close to transformers' BF16 and no farther from the FP32 ones; checkpoints both
ways (a save reloads in transformers bitwise); bad input named.

transformers leaves the indexer's exact ties (ReLU scores at 0) to torch.topk; the contract gives them to the
larger position, and the reference here is made to do the same (tests/tiny_deepseek_v4.py); the rule itself is
tested with planted ties in tests/ops/test_topk.py.
"""
import pytest
import torch
from safetensors.torch import save_file
from transformers import DeepseekV4ForCausalLM

from onepath.models.batch import ForwardBatch
from onepath.models.checkpoint import load_config, load_state_dict, save_checkpoint
from onepath.models.config import ModelConfig
from tests.tiny_deepseek_v4 import (CSA, HCA, SLIDING, TINY, onepath_logits, onepath_model, sequences,
                                    softmax_scoring, ties_to_larger_position, transformers_logits, transformers_model)

TOL = 1e-4
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2}
# each case: the config edits of one random model; together they cover every layer type and option
CASES = {
    "sliding-hash-sqrtsoftplus": dict(layer_types=[SLIDING] * 2, mlp_layer_types=["hash_moe", "moe"],
                                      num_hidden_layers=2, hc_mult=4, o_groups=1),
    "hca-sigmoid": dict(layer_types=[HCA, HCA], num_hidden_layers=2, compress_rates={HCA: 4}, scoring_func="sigmoid",
                        mlp_layer_types=["moe", "moe"]),
    "csa-topk2": dict(layer_types=[CSA, CSA], num_hidden_layers=2, index_topk=2, mlp_layer_types=["moe", "hash_moe"]),
    "csa-hca-yarn": dict(compress_rates={CSA: 2, HCA: 8}, rope_parameters=YARN, compress_rope_theta=1000.0),
    "softmax-tied": dict(scoring_func="softmax", tie_word_embeddings=True, layer_types=[HCA, CSA, SLIDING]),
    "bias-clamp-scaling": dict(mlp_bias=True, swiglu_limit=0.3, routed_scaling_factor=2.5, scoring_func="sigmoid"),
    "partial-quarter": dict(partial_rotary_factor=0.25, index_head_dim=12, index_n_heads=8, rope_theta=500.0),
    "one-stream": dict(hc_mult=1, hc_sinkhorn_iters=1, o_groups=4, o_lora_rank=4),
    "three-streams": dict(hc_mult=3, hc_sinkhorn_iters=5, hc_eps=1e-3, n_routed_experts=6, num_experts_per_tok=3,
                          rms_norm_eps=1e-2),
    "topk-covers-all": dict(index_topk=16, sliding_window=1, compress_rates={CSA: 4, HCA: 2}),
    "odd-rates-wide-window": dict(compress_rates={CSA: 3, HCA: 5}, sliding_window=64, pad_token_id=5,
                                  layer_types=[CSA, HCA, CSA], num_experts_per_tok=1),
    "deep-mixed": dict(num_hidden_layers=5, layer_types=[HCA, SLIDING, CSA, HCA, CSA],
                       mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"], q_lora_rank=12, head_dim=8,
                       partial_rotary_factor=0.5, index_head_dim=4, hidden_size=24),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, monkeypatch):
    ties_to_larger_position(monkeypatch)
    softmax_scoring(monkeypatch)
    hf = transformers_model(CASES[case])
    seqs = sequences(hf.config.vocab_size)
    want = transformers_logits(hf, seqs)
    got = onepath_logits(onepath_model(hf), seqs)
    assert want.abs().max() > 1.0  # the random model is far from uniform: a wrong tensor shows
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


BF16_MEAN, BF16_MAX, BF16_RATIO = 0.025, 0.5, 1.25


@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_logits_are_close_to_transformers_bf16(case, monkeypatch, tmp_path):
    """onepath under the GPU's BF16 spec (run on the CPU) against transformers loaded in BF16 (from_pretrained with
    dtype bfloat16: the modules it keeps in FP32 stay FP32). The two round in different places (docs/models.md:
    onepath rounds each op's FP32 result once), so the claim is a tolerance, on models where every entry is selected
    and every expert used, so that no discrete choice can flip between them: mean |ours - theirs| <= BF16_MEAN and
    max <= BF16_MAX on logits up to ~4, and ours no farther from the FP32 logits on average than theirs (x BF16_RATIO).
    """
    ties_to_larger_position(monkeypatch)
    softmax_scoring(monkeypatch)
    edits = {**CASES[case], "index_topk": 16}
    edits["num_experts_per_tok"] = edits.get("n_routed_experts", TINY["n_routed_experts"])
    hf = transformers_model(edits)
    hf.save_pretrained(tmp_path)
    hf_bf16 = DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert hf_bf16.model.layers[0].attn_hc.fn.dtype == torch.float32
    seqs = sequences(hf.config.vocab_size)
    fp32, theirs = transformers_logits(hf, seqs), transformers_logits(hf_bf16, seqs).float()
    ours = onepath_logits(onepath_model(hf_bf16, dtype="bfloat16"), seqs).float()
    gap = (ours - theirs).abs()
    assert gap.mean() <= BF16_MEAN and gap.max() <= BF16_MAX, (gap.mean(), gap.max())
    assert (ours - fp32).abs().mean() <= BF16_RATIO * (theirs - fp32).abs().mean()
    assert not torch.equal(ours, fp32)  # BF16 for real


def test_the_cases_cover_every_layer_type_and_option():
    seen = {k for edits in CASES.values() for k in edits}
    assert {"layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "scoring_func",
            "tie_word_embeddings", "mlp_bias", "swiglu_limit", "routed_scaling_factor", "partial_rotary_factor",
            "hc_mult", "hc_sinkhorn_iters", "hc_eps", "o_groups", "index_topk", "sliding_window"} <= seen
    kinds = {t for edits in CASES.values() for t in edits.get("layer_types", TINY["layer_types"])}
    assert kinds == {SLIDING, CSA, HCA}
    assert {e.get("scoring_func", "sqrtsoftplus") for e in CASES.values()} == {"sqrtsoftplus", "sigmoid", "softmax"}


def test_the_tie_rule_matters_on_these_models(monkeypatch):
    """Negative control of the reference's tie rule: left to torch.topk, transformers picks other tied entries and
    the logits move far past the tolerance, so the cases above would catch a wrong tie rule on either side."""
    softmax_scoring(monkeypatch)
    hf = transformers_model(CASES["csa-hca-yarn"])
    seqs = sequences(hf.config.vocab_size)
    assert (onepath_logits(onepath_model(hf), seqs) - transformers_logits(hf, seqs)).abs().max() > 100 * TOL


@pytest.mark.parametrize("case", ["csa-hca-yarn", "softmax-tied"])
def test_save_reloads_in_transformers_bitwise(case, tmp_path, monkeypatch):
    softmax_scoring(monkeypatch)
    hf = transformers_model(CASES[case])
    ours = onepath_model(hf)
    save_checkpoint(tmp_path, ours.hf_state_dict(), ours.config)
    again = DeepseekV4ForCausalLM.from_pretrained(tmp_path)
    mine, theirs = ours.state_dict(), again.state_dict()
    if ours.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert sorted(mine) == sorted(theirs)
    for name, tensor in mine.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "partial_rotary_factor"):
        assert getattr(again.config, key) == getattr(hf.config, key), key


def test_loads_what_save_pretrained_writes(tmp_path):
    hf = transformers_model(CASES["csa-hca-yarn"])
    hf.save_pretrained(tmp_path)
    config = load_config(tmp_path)
    assert config.layer_types == hf.config.layer_types and config.rope_parameters == hf.config.rope_parameters
    ours = onepath_model(hf)
    again = onepath_model(hf)
    again.load_hf_state_dict(load_state_dict(tmp_path))
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


def test_loads_deepseek_names_and_skips_mtp(monkeypatch):
    """DeepSeek's own layout (no model. prefix, embed / head / norm / hc_head_*) with its MTP layer's tensors."""
    hf = transformers_model({})
    ours = onepath_model(hf)
    disk = {k.removeprefix("model."): v for k, v in ours.hf_state_dict().items()}
    disk["embed.weight"] = disk.pop("embed_tokens.weight")
    for part in ("fn", "base", "scale"):
        disk[f"hc_head_{part}"] = disk.pop(f"hc_head.hc_{part}")
    disk["mtp.0.attn.wq_a.weight"] = torch.zeros(3)
    again = onepath_model(hf)
    again.load_hf_state_dict(disk)
    seqs = sequences(hf.config.vocab_size)
    assert torch.equal(onepath_logits(again, seqs), onepath_logits(ours, seqs))


def test_checkpoint_missing_the_indexer_is_named(tmp_path):
    hf = transformers_model({})
    ours = onepath_model(hf)
    state = {k: v for k, v in ours.hf_state_dict().items() if ".indexer." not in k}
    with pytest.raises(ValueError, match=r"lightning indexer's tensors of layers \[1\].*layer_types"):
        onepath_model(hf).load_hf_state_dict(state)


@pytest.mark.parametrize("edit, message", [
    (dict(layer_types=[SLIDING, "full_attention", HCA]), r"layer_types\[1\] = 'full_attention'"),
    (dict(mlp_layer_types=["moe", "dense", "moe"]), r"mlp_layer_types\[1\] = 'dense'"),
    (dict(compress_rates={CSA: 4, HCA: 0}), r"compress_rates\['heavily_compressed_attention'\] = 0"),
    (dict(compress_rates={CSA: 4, "sliding_attention": 2}), "compress_rates has 'sliding_attention'"),
    (dict(compress_ratios=[0, 4, 64], layer_types=None), r"compress_ratios\[2\] = 64"),
    (dict(index_topk=65), r"index_topk 65 > 64, the compressed entries a context of max_position_embeddings 256"),
    (dict(scoring_func="relu"), "scoring_func 'relu'"),
    (dict(num_key_value_heads=2), "num_key_value_heads = 2"),
    (dict(partial_rotary_factor=0.75, index_head_dim=8), "index_head_dim 8 < the 12 rotated channels"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type 'linear'"),
])
def test_bad_config_is_refused_by_name(edit, message):
    raw = {**TINY, "model_type": "deepseek_v4", **edit}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_gradients_match_transformers(monkeypatch):
    """The trainer's backward (each op's reference, the cache reads straight through to this forward's rows) gives
    transformers' gradient of the same loss: every parameter but the frozen indexer's, which gets none on either
    side (its top-k is not differentiable)."""
    ties_to_larger_position(monkeypatch)
    hf = transformers_model(CASES["odd-rates-wide-window"])
    ours = onepath_model(hf)
    seqs = sequences(hf.config.vocab_size, (9, 23))
    loss = lambda logits: torch.nn.functional.cross_entropy(logits, torch.tensor([t for s in seqs for t in s]))
    loss(transformers_logits_with_grad(hf, seqs)).backward()
    batch, num_blocks = ForwardBatch.for_sequences(seqs, 16)
    loss(ours.compute_logits(ours(batch, ours.make_cache(num_blocks, 16)))).backward()
    theirs = dict(hf.named_parameters())
    compared = 0
    for name, p in ours.named_parameters():
        if ".indexer." in name:
            assert p.grad is None and theirs[name].grad is None
            continue
        compared += 1
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-3, atol=1e-5, msg=name)
    assert compared > 50


def transformers_logits_with_grad(hf, seqs):
    return torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
