import pytest

from onepath.numerics.spec import ExecutionSpec, OpSpec, check_same_spec


def test_json_round_trip_and_stable_hash():
    spec = ExecutionSpec(mode="consistent", ops={"attention": OpSpec(kv_tile=32)})
    again = ExecutionSpec.from_json(spec.to_json())
    assert again == spec and again.hash() == spec.hash()
    assert again.op("attention").kv_tile == 32 and again.op("linear") == OpSpec()
    # sha256 of canonical JSON: the same in every process (no PYTHONHASHSEED), pinned here
    assert ExecutionSpec().hash() == "d30793c88272e8bf"
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
