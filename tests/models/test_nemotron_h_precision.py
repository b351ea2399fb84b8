"""Per-module precision, as the Nemotron recipe runs it: FP8 block W8A8 for the Mamba in/out projections
(module class "mamba_proj"), NVFP4 W4A16 for the routed experts ("expert"), FP8 KV for the attention layers, the
spec's dtype everywhere else. Each module computes in its class's formats, both sides follow the one spec (the
trainer's forward has the engine's bits in every phase), and the spec's hash covers the assignment."""
from dataclasses import replace

import torch

from onepath.models import build_decoder
from onepath.models.nemotron_h import Attention, Mamba2Mixer, MoE
from onepath.numerics.quant import FP8Tensor
from onepath.numerics.spec import FP8_ACT, FP8_KV, FP8_WEIGHT, NVFP4_WEIGHT, OPS, ExecutionSpec, OpSpec
from onepath.ops import Ops
from onepath.ops import linear_quant
from tests.models.test_nemotron_h_phases import CHUNK, all_phases, prompts, tiny_config

RECIPE = "fp8_mamba+nvfp4_experts+fp8_kv"


def bf16_spec(mode="consistent", quant=RECIPE):
    ops = {name: OpSpec(dtype="bfloat16" if name not in ("logprobs", "sampling", "topk") else "float32")
           for name in OPS}
    spec = ExecutionSpec(mode=mode, ops=ops).with_op("ssd", chunk=CHUNK)
    for preset in quant.split("+") if quant else ():
        spec = spec.with_quant(preset)
    return spec


def model_under(spec, seed=0):
    model = build_decoder(tiny_config(hidden_size=128), Ops(spec))
    model.init_weights(seed, std=0.1)
    return model


def test_the_recipe_assigns_formats_by_module_class():
    spec = ExecutionSpec.default("consistent", "cuda", quant=RECIPE)
    assert (spec.op("mamba_proj").weight, spec.op("mamba_proj").act) == (FP8_WEIGHT, FP8_ACT)
    assert (spec.op("expert").weight, spec.op("expert").act) == (NVFP4_WEIGHT, None)
    assert spec.op("attention").kv == FP8_KV
    assert spec.op("linear").weight is None and spec.op("lm_head").weight is None
    assert {spec.op(name).dtype for name in ("linear", "mamba_proj", "expert", "attention", "rmsnorm")} == {"bfloat16"}
    again = ExecutionSpec.from_json(spec.to_json())
    assert again == spec and again.hash() == spec.hash()
    assert {"mamba_proj", "expert"} <= set(spec.to_dict()["ops"])


def test_the_hash_covers_the_assignment():
    """Each change of who gets which format moves the hash; a spec without module classes keeps its JSON."""
    base = ExecutionSpec.default("consistent", "cuda")
    variants = [base.with_quant("fp8_mamba"), base.with_quant("nvfp4_experts"), base.with_quant("fp8"),
                base.with_quant("fp8_mamba").with_quant("nvfp4_experts"),
                base.with_quant("fp8").with_quant("nvfp4_experts"),  # all linears FP8, the experts NVFP4
                base.with_op("expert", weight=NVFP4_WEIGHT, act=replace(NVFP4_WEIGHT, outer_scale="per_token")),
                base.with_op("ssd", chunk=64), ExecutionSpec.default("consistent", "cuda", quant=RECIPE)]
    assert len({s.hash() for s in [base, *variants]}) == 1 + len(variants)
    assert "mamba_proj" not in base.to_dict()["ops"] and "ssd" not in base.to_dict()["ops"]
    assert ExecutionSpec().hash() == "d30793c88272e8bf"  # pinned in tests/numerics/test_spec.py
    # a module class without an entry computes as linear, and takes a later change of linear
    assert base.op("expert") == base.op("linear")


def test_each_module_computes_in_its_class_formats(monkeypatch):
    seen = []
    quant_linear = linear_quant.quant_linear
    monkeypatch.setattr(linear_quant, "quant_linear",
                        lambda spec, x, w, b, out_dtype, name="linear": seen.append(name) or quant_linear(
                            spec, x, w, b, out_dtype, name))
    from onepath.ops import linear
    monkeypatch.setattr(linear, "quant_linear", linear_quant.quant_linear)
    model = model_under(bf16_spec())
    seqs = prompts()
    phases = all_phases(model, seqs)
    assert set(seen) == {"mamba_proj", "expert"}  # attention, MLP, shared expert, LM head: unquantised
    kinds = {type(m) for m in model.modules()}
    assert {Mamba2Mixer, Attention, MoE} <= kinds
    for name, got in phases.items():
        assert all(torch.equal(g, w) for g, w in zip(got, phases["trainer"])), name
    plain = all_phases(model_under(bf16_spec(quant=None)), seqs)["trainer"]
    assert all(not torch.equal(a, b) for a, b in zip(plain[1:], phases["trainer"][1:]))


def test_the_attention_cache_is_fp8_and_the_mamba_layers_keep_none():
    model = model_under(bf16_spec())
    cache = model.make_cache(4, 16, num_slots=2)
    kinds = model.config.layers_block_type
    assert [isinstance(k, FP8Tensor) for k in cache.k] == [t == "full_attention" for t in kinds]
    assert all((k is None) == (t != "full_attention") for k, t in zip(cache.k, kinds))


def test_the_trainer_backward_is_straight_through_under_the_recipe():
    model = model_under(bf16_spec())
    from onepath.models.batch import ForwardBatch
    seqs = prompts()[2:4]
    batch, blocks = ForwardBatch.for_sequences(seqs, 16)
    logits = model.compute_logits(model(batch, model.make_cache(blocks, 16)))
    logits.float().logsumexp(-1).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name in ("model.layers.0.mixer.in_proj.weight", "model.layers.1.mixer.experts.up_proj",
                 "model.layers.2.mixer.q_proj.weight"):
        assert grads[name] is not None and torch.isfinite(grads[name].float()).all() and grads[name].abs().sum() > 0
