import pytest

from dataclasses import replace

from onepath.numerics.spec import (FP8_ACT, FP8_INDEX, FP8_KV, FP8_WEIGHT, NVFP4_ACT, NVFP4_WEIGHT, QUANT_PRESETS,
                                   ExecutionSpec, OpSpec, QuantSpec, check_same_spec)


def test_json_round_trip_and_stable_hash():
    spec = ExecutionSpec(mode="consistent", ops={"attention": OpSpec(kv_tile=32)})
    again = ExecutionSpec.from_json(spec.to_json())
    assert again == spec and again.hash() == spec.hash()
    assert again.op("attention").kv_tile == 32 and again.op("linear") == OpSpec()
    # sha256 of canonical JSON: the same in every process (no PYTHONHASHSEED), pinned here. The
    # quantisation fields did not move it: fields left None are left out of the JSON.
    assert ExecutionSpec().hash() == "d30793c88272e8bf"
    assert "weight" not in ExecutionSpec().to_dict()["ops"]["linear"]
    assert len(spec.hash()) == 16


def test_any_change_changes_the_hash():
    base = ExecutionSpec()
    variants = [base.with_mode("baseline"), ExecutionSpec(ops={"linear": OpSpec(row_chunk=32)}),
                ExecutionSpec(ops={"logprobs": OpSpec(accum_dtype="bfloat16")})]
    assert len({base.hash(), *(v.hash() for v in variants)}) == 4


def test_engine_and_trainer_refuse_different_specs():
    check_same_spec(ExecutionSpec(), ExecutionSpec())
    with pytest.raises(RuntimeError, match="one numeric contract"):
        check_same_spec(ExecutionSpec(), ExecutionSpec(mode="baseline"))


@pytest.mark.parametrize("bad, message", [
    (dict(mode="fast"), "mode 'fast'"),
    (dict(device="tpu"), "device 'tpu'"),
    (dict(ops={"matmul": OpSpec()}), "matmul"),
])
def test_bad_spec_names_the_value(bad, message):
    with pytest.raises(ValueError, match=message):
        ExecutionSpec(**bad)


def test_bad_op_spec_names_the_value():
    with pytest.raises(ValueError, match="kv_tile 12"):
        OpSpec(kv_tile=12)
    with pytest.raises(ValueError, match="dtype 'fp8'"):
        OpSpec(dtype="fp8")


def test_quant_presets_round_trip_and_pin_their_hash():
    spec = ExecutionSpec.default("consistent", "cuda", quant="fp8+fp8_kv")
    linear, attention = spec.op("linear"), spec.op("attention")
    assert (linear.weight, linear.act, attention.kv) == (FP8_WEIGHT, FP8_ACT, FP8_KV)
    assert linear.weight.block == (128, 128) and linear.act.block == (1, 128) and attention.kv.block is None
    assert spec.op("lm_head").weight is None and linear.dtype == "bfloat16"
    again = ExecutionSpec.from_json(spec.to_json())
    assert again == spec and again.hash() == spec.hash() and isinstance(again.op("linear").act.block, tuple)
    # a preset's contract is pinned too: the engine and the trainer of two builds must agree on it
    assert spec.hash() == "028dd83afc1fa748"
    # a rule without an amax ceiling keeps the JSON it had before the field existed
    assert ExecutionSpec.default("consistent", "cuda", quant="fp8").hash() == "93c07d923db5e153"
    assert "amax_ceil" not in ExecutionSpec.default("consistent", "cuda", quant="fp8").to_json()
    w4a4 = ExecutionSpec.default("consistent", "cuda", quant="nvfp4_w4a4")
    assert (w4a4.op("linear").weight, w4a4.op("linear").act) == (NVFP4_WEIGHT, NVFP4_ACT)
    assert ExecutionSpec.default(quant="fp8") == ExecutionSpec().with_quant("fp8")


def test_every_preset_and_quant_field_changes_the_hash():
    presets = [ExecutionSpec.default("consistent", "cuda", quant=p) for p in QUANT_PRESETS]
    variants = [ExecutionSpec(ops={"linear": OpSpec(act=q)}) for q in (
        FP8_ACT, replace(FP8_ACT, scale_apply="divide"), replace(FP8_ACT, scale_dtype="ue8m0"),
        replace(FP8_ACT, block=(1, 64)), replace(FP8_ACT, amax_floor=0.0), replace(FP8_ACT, amax_ceil=448.0))]
    variants.append(ExecutionSpec(ops={"linear": OpSpec(router_placement="down_proj_input")}))
    hashes = {s.hash() for s in [ExecutionSpec.default("consistent", "cuda"), ExecutionSpec(), *presets, *variants]}
    assert len(hashes) == 2 + len(presets) + len(variants)


@pytest.mark.parametrize("quant, message", [
    ("fp4", "quant preset 'fp4' is unknown"),
    ("fp8+nvfp4_w4a16", "sets linear.weight, which an earlier preset"),
])
def test_bad_quant_preset_names_the_value(quant, message):
    with pytest.raises(ValueError, match=message):
        ExecutionSpec.default("consistent", "cuda", quant=quant)


@pytest.mark.parametrize("fields, message", [
    (dict(format="int8"), "quant format 'int8' is unknown"),
    (dict(scale_dtype="e4m3"), "scale_dtype 'e4m3' does not go with format 'fp8_e4m3'"),
    (dict(rounding="stochastic"), "rounding 'stochastic'"),
    (dict(saturation="none"), "saturation 'none'"),
    (dict(scale_domain="per_token"), "per_token and per_tensor take block None"),
    (dict(block=(1, 0)), r"block \(1, 0\) must be \(rows, cols\) of positive ints"),
    (dict(amax_floor=-1.0), "amax_floor -1.0"),
    (dict(amax_ceil=1e-5), "amax_ceil 1e-05 must be above amax_floor"),
    (dict(format="nvfp4", block=(1, 32), scale_dtype="e4m3"), r"block \(1, 32\) does not go with format 'nvfp4'"),
])
def test_bad_quant_spec_names_the_value(fields, message):
    with pytest.raises(ValueError, match=message):
        QuantSpec(**fields)


def test_quantised_tensors_only_where_an_op_has_them():
    with pytest.raises(ValueError, match=r"ops\['rmsnorm'\].weight is set"):
        ExecutionSpec(ops={"rmsnorm": OpSpec(weight=FP8_WEIGHT)})
    with pytest.raises(ValueError, match=r"ops\['linear'\].kv is set"):
        ExecutionSpec(ops={"linear": OpSpec(kv=FP8_KV)})
    with pytest.raises(ValueError, match="router_placement 'before_combine' is unknown"):
        OpSpec(router_placement="before_combine")


def test_attention_rows_are_part_of_the_contract():
    spec = ExecutionSpec.default("consistent", "cuda")
    rows16 = spec.with_op("attention", q_rows=16)
    assert rows16.op("attention").q_rows == 16 and spec.op("attention").q_rows is None
    assert rows16.hash() != spec.hash() and rows16.op("linear") == spec.op("linear")
    with pytest.raises(ValueError, match="q_rows 24 must be a power of two >= 16"):
        spec.with_op("attention", q_rows=24)
    with pytest.raises(ValueError, match="op 'attn' is unknown"):
        spec.with_op("attn", q_rows=16)
    # by name, as the benches' --spec takes them
    assert spec.with_settings(["attention.q_rows=16"]) == rows16
    both = spec.with_settings(["attention.q_rows=16", "attention.kv_tile=64"])
    assert both.op("attention").kv_tile == 64
    assert both.with_settings(["attention.q_rows=null"]).op("attention").q_rows is None
    for bad in ("attention.q_rows", "attention.dtype=bfloat16", "q_rows=16", "attention.q_rows=many"):
        with pytest.raises(ValueError, match="is not op.field=value with an integer field"):
            spec.with_settings([bad])


def test_family_operators_and_module_classes_join_the_spec_only_once_set():
    """ssd.chunk (the Mamba-2 scan's tile) and the module classes (mamba_proj, expert) are absent from a spec's JSON,
    and so from its hash, until set; set, they round-trip and move the hash; by name as the benches' --spec."""
    spec = ExecutionSpec()
    assert spec.op("ssd").chunk == 128 and spec.op("expert") == spec.op("linear")
    chunked = spec.with_settings(["ssd.chunk=64"])
    assert chunked.op("ssd").chunk == 64 and chunked.hash() != spec.hash() and "ssd" in chunked.to_dict()["ops"]
    assert ExecutionSpec.from_json(chunked.to_json()) == chunked
    classed = spec.with_quant("fp8_mamba")
    assert classed.op("mamba_proj").weight == FP8_WEIGHT and classed.op("linear").weight is None
    with pytest.raises(ValueError, match="chunk 48 must be a power of two"):
        spec.with_op("ssd", chunk=48)
    with pytest.raises(ValueError, match="op 'mamba' is unknown: the operators are .* the module classes"):
        spec.with_op("mamba", chunk=64)
    with pytest.raises(ValueError, match="sets mamba_proj.weight, which an earlier preset"):
        classed.with_quant("fp8_mamba")


def test_fp8_indexer_is_its_own_preset_and_composes():
    """fp8_indexer quantises DeepSeek-V4's indexer (query heads and key cache, FP8_INDEX both) and nothing else: off
    in the default specs (whose JSON and hash do not name the indexer), composed with the others by '+'; it
    round-trips and moves the hash. Half of it, or a rule whose scale does not leave the dot, is refused by name."""
    for spec in (ExecutionSpec(), ExecutionSpec.default("consistent", "cuda", quant="fp8+fp8_kv")):
        assert spec.op("indexer").kv is None and "indexer" not in spec.to_dict()["ops"]
    recipe = ExecutionSpec.default("consistent", "cuda", quant="fp8+fp8_kv+fp8_indexer")
    assert (recipe.op("indexer").act, recipe.op("indexer").kv) == (FP8_INDEX, FP8_INDEX)
    assert FP8_INDEX.scale_domain == "per_token" and FP8_INDEX.scale_dtype == "ue8m0"
    assert recipe.op("attention").kv == FP8_KV and recipe.op("linear").act == FP8_ACT
    assert ExecutionSpec.from_json(recipe.to_json()) == recipe
    assert recipe.hash() != ExecutionSpec.default("consistent", "cuda", quant="fp8+fp8_kv").hash()
    with pytest.raises(ValueError, match=r"ops\['indexer'\] quantises act alone"):
        ExecutionSpec(ops={"indexer": OpSpec(act=FP8_INDEX)})
    with pytest.raises(ValueError, match=r"ops\['indexer'\].kv is fp8_e4m3 per_block"):
        ExecutionSpec(ops={"indexer": OpSpec(act=FP8_INDEX, kv=FP8_ACT)})
    with pytest.raises(ValueError, match="sets indexer.act, which an earlier preset"):
        ExecutionSpec.default(quant="fp8_indexer+fp8_indexer")
