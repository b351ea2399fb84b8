"""bench/profile_decode.py's bound on a saved profile (no GPU): the decode roofline at the profile's batch and
context, and the step its kernels would take with attention reading the K/V at the HBM peak."""
import pytest

from onepath.bench.profile_decode import add_bound
from onepath.bench.roofline import HBM_PEAK_B_S
from onepath.bench.workloads import model_config


def test_bound_puts_attention_at_the_hbm_peak_and_keeps_the_other_kernels():
    config = model_config("tiny")
    kernels = [dict(name="_paged_attention_kernel", calls=2, gpu_ms_per_step=0.5),
               dict(name="_linear_kernel", calls=9, gpu_ms_per_step=0.25)]
    mode = dict(batch=8, mean_context=100.0, gpu_kernel_ms_per_step=1.0, kernels=kernels)
    result = dict(options=dict(model="tiny"), modes={"consistent": mode, "consistent+fp8": dict(mode)})
    add_bound(result)
    roofline, bound = mode["roofline"], mode["attention_at_peak"]
    # tiny: BF16 K/V of 2 layers x 2 KV heads x 16 dims, K and V, per token
    kv = 8 * 100 * 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    assert roofline["kv_bytes"] == kv and roofline["batch"] == 8
    assert bound["attention_ms"] == 0.5 and bound["other_kernels_ms"] == 0.5
    assert bound["attention_at_peak_ms"] == pytest.approx(kv / HBM_PEAK_B_S * 1e3)
    assert bound["step_ms"] == pytest.approx(0.5 + kv / HBM_PEAK_B_S * 1e3)
    assert bound["of_roofline"] == pytest.approx(roofline["step_seconds_peak"] * 1e3 / bound["step_ms"])
    assert bound["measured_of_roofline"] == pytest.approx(roofline["step_seconds_peak"] * 1e3)
    assert "roofline" not in result["modes"]["consistent+fp8"]  # quantised modes read other bytes: left out


@pytest.mark.parametrize("moe", [False, True])
def test_a_decoder_built_on_meta_has_the_cpu_builds_weights(moe):
    """add_bound counts the weights of a decoder built under torch.device("meta") (no memory): the same names,
    shapes and dtypes as a real build, dense and MoE; nothing of it is on the CPU."""
    import torch

    from onepath.models import build_decoder
    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops import Ops
    from tests.tiny import tiny_config

    config = tiny_config(**(dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
                            if moe else {}))
    ops = Ops(ExecutionSpec.default("baseline", "cpu"))
    real = build_decoder(config, ops, max_positions=2).state_dict()
    with torch.device("meta"):
        meta = build_decoder(config, ops, max_positions=2).state_dict()
    assert {n: (t.shape, t.dtype) for n, t in meta.items()} == {n: (t.shape, t.dtype) for n, t in real.items()}
    assert all(t.device.type == "meta" for t in meta.values())
