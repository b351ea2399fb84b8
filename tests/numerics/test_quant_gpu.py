"""The quantisers on the GPU: the torch rule gives the same bits on CUDA as on the CPU (where
tests/numerics/test_quant.py checks it against the float64 reference), and the Triton FP8 kernel the
same bits as the torch rule, on random and adversarial inputs and for a row alone or in any batch.
What it guards: CUDA-only arithmetic (torch turns division by a Python scalar into a multiply by its
reciprocal there; Triton's default `/` is approximate) and Hopper's own FP32 -> E4M3 cast.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from onepath.numerics.quant import quantize  # noqa: E402
from onepath.numerics.spec import FP8_ACT, FP8_KV, FP8_WEIGHT, NVFP4_ACT, NVFP4_WEIGHT  # noqa: E402

DEVICE = "cuda"
ACT_RULES = [FP8_ACT, replace(FP8_ACT, scale_dtype="ue8m0"), replace(FP8_ACT, scale_apply="divide"),
             replace(FP8_ACT, scale_dtype="ue8m0", scale_apply="divide")]


def _inputs(k: int, rows: int = 64) -> torch.Tensor:
    """Random rows with block magnitudes 2^-30..2^30, then adversarial rows: ties at scale 1, -0,
    subnormals, values past 464, near FLT_MAX, +-inf, NaN."""
    gen = torch.Generator().manual_seed(k)
    mag = torch.randint(-30, 30, (rows, -(-k // 16)), generator=gen).repeat_interleave(16, 1)[:, :k]
    x = torch.randn(rows, k, generator=gen) * torch.exp2(mag.float())
    ties = [448.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, 248.0, 432.0, -0.0, 6.0, 0.25, 2.5, 3.5]
    x[0] = 0.0
    x[0, :len(ties)] = torch.tensor(ties)
    x[1] = -0.0
    x[2, :4] = torch.tensor([1e-40, -3e-42, 2.0 ** -149, 1.0])
    x[3, :4] = torch.tensor([465.0, 1e4, 3.4028234663852886e38, -3e38])
    x[4, 3], x[5, k - 1], x[6, 0] = math.inf, -math.inf, math.nan
    return x


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _same(a, b) -> bool:
    """Codes, scales (and NVFP4's s_enc) equal bit for bit."""
    pairs = [(a.codes, b.codes), (a.scales, b.scales)]
    pairs += [(a.encode_scale, b.encode_scale)] if hasattr(a, "encode_scale") else []
    return all(u.shape == v.shape and torch.equal(_bits(u).cpu(), _bits(v).cpu()) for u, v in pairs)


@pytest.mark.parametrize("k", [300, 4096, 129])
@pytest.mark.parametrize("rule", ACT_RULES + [FP8_KV, NVFP4_WEIGHT, NVFP4_ACT],
                         ids=["fp32_mul", "ue8m0_mul", "fp32_div", "ue8m0_div", "fp8_kv", "nvfp4_w", "nvfp4_a"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_rule_gives_cpu_bits_on_cuda(k, rule, dtype):
    x = _inputs(k).to(dtype)
    assert _same(quantize(x.to(DEVICE), rule), quantize(x, rule))


@pytest.mark.parametrize("shape", [(300, 4096), (129, 300)])
def test_fp8_weight_blocks_give_cpu_bits_on_cuda(shape):
    w = _inputs(shape[1], rows=shape[0]).bfloat16()
    assert _same(quantize(w.to(DEVICE), FP8_WEIGHT), quantize(w, FP8_WEIGHT))


@pytest.mark.parametrize("k", [300, 4096, 7168, 129])
@pytest.mark.parametrize("rule", ACT_RULES, ids=["fp32_mul", "ue8m0_mul", "fp32_div", "ue8m0_div"])
def test_triton_kernel_equals_torch_rule(k, rule):
    pytest.importorskip("triton")
    from onepath.ops.cuda.quant import quantize_fp8

    x = _inputs(k).bfloat16().to(DEVICE)
    assert _same(quantize_fp8(x, rule), quantize(x, rule))
    # a row alone and in batches of every size class: the same bits
    alone = quantize_fp8(x[7:8], rule)
    for m in (2, 33, 1000):
        batch = torch.randn(m, k, device=DEVICE).bfloat16()
        batch[m // 2] = x[7]
        got = quantize_fp8(batch, rule)
        assert torch.equal(_bits(got.codes[m // 2]), _bits(alone.codes[0]))
        assert torch.equal(_bits(got.scales[m // 2]), _bits(alone.scales[0]))


@pytest.mark.parametrize("dim", [128, 64, 72])
@pytest.mark.parametrize("rule", [FP8_KV, replace(FP8_KV, scale_dtype="ue8m0", scale_apply="divide")],
                         ids=["fp8_kv", "ue8m0_div"])
def test_write_kv_fp8_equals_torch_rule(dim, rule):
    """The one-launch FP8 KV write: each token and head's codes and scale in its slot equal the torch rule's
    (quantize, then index-put), adversarial rows included; slots not written keep their contents."""
    pytest.importorskip("triton")
    from onepath.numerics.quant import FP8Tensor
    from onepath.ops.cuda.attention_kv import write_kv_fp8

    heads, blocks, block_size = 8, 40, 16
    x = _inputs(dim, rows=2 * 300 * heads).bfloat16().to(DEVICE).view(2, 300, heads, dim)
    k, v = x[0], x[1]
    slots = torch.randperm(blocks * block_size, device=DEVICE)[:300]

    def cache():
        return FP8Tensor(torch.zeros(blocks, block_size, heads, dim, device=DEVICE).to(torch.float8_e4m3fn),
                         torch.full((blocks, block_size, heads, 1), -1.0, device=DEVICE), (1, dim))

    got = cache(), cache()
    write_kv_fp8(*got, k, v, slots, rule)
    for c, t in zip(got, (k, v)):
        want = cache()
        fp8 = quantize(t, rule)
        want.codes.view(-1, heads, dim)[slots] = fp8.codes
        want.scales.view(-1, heads, 1)[slots] = fp8.scales
        assert _same(c, want)
