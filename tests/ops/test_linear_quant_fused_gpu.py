"""RMSNorm and SiLU-mul quantising their own output for the next FP8 GEMM (ops/linear_quant.FUSED_ACT_QUANT) on
the GPU. Kernels: each fused launch gives the unfused output and the standalone quantiser's codes and scales, bit
for bit, at Qwen3's widths and ragged ones, under every FP8 rule; control: another rule's codes differ. Engine:
with FP8 W8A8 (and FP8 KV) the fused engine generates the unfused engine's tokens and log-probs bit for bit, CUDA
graphs included, and its linears launch the standalone quantiser only for the attention output (one a layer
instead of four); requests alone == inside batches with it on. The unfused engine equals the trainer
(tests/engine/test_engine_quant_gpu.py), so the fused one does."""
from dataclasses import replace

import pytest
import torch

from onepath.numerics.spec import FP8_ACT
from onepath.ops import linear_quant as QL
from tests.engine import test_engine_gpu as dense
from tests.engine.test_engine_quant_gpu import quantised
from tests.tiny import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

RULES = [FP8_ACT, replace(FP8_ACT, scale_dtype="ue8m0"), replace(FP8_ACT, scale_apply="divide")]


def _same(a, b):
    return (a.codes.shape == b.codes.shape and torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
            and torch.equal(a.scales.view(torch.int32), b.scales.view(torch.int32)))


@pytest.mark.parametrize("width", [1024, 2048, 1100, 3072, 6144, 1408])
def test_fused_kernels_equal_kernel_then_quantiser(width):
    from onepath.ops.cuda import rmsnorm, silu_mul
    from onepath.ops.cuda.quant import quantize_fp8
    gen = torch.Generator("cuda").manual_seed(width)
    rand = lambda *s, scale=1.0: (torch.randn(*s, generator=gen, device="cuda") * scale).bfloat16()
    x, r, w = rand(300, width, scale=4.0), rand(300, width), rand(width)
    gate, up = rand(300, width, scale=2.0), rand(300, width, scale=30.0)
    for rule in RULES:
        out, q = rmsnorm.rmsnorm(x, w, 1e-6, rule)
        assert torch.equal(out, rmsnorm.rmsnorm(x, w, 1e-6)) and _same(q, quantize_fp8(out, rule)), rule
        out, s, q = rmsnorm.rmsnorm_residual(x, r, w, 1e-6, rule)
        plain_out, plain_sum = rmsnorm.rmsnorm_residual(x, r, w, 1e-6)
        assert torch.equal(out, plain_out) and torch.equal(s, plain_sum) and _same(q, quantize_fp8(out, rule)), rule
        out, q = silu_mul.silu_mul(gate, up, rule)
        assert torch.equal(out, silu_mul.silu_mul(gate, up)) and _same(q, quantize_fp8(out, rule)), rule
    out, q = rmsnorm.rmsnorm(x, w, 1e-6, RULES[0])
    assert not _same(q, quantize_fp8(out, RULES[1]))


@pytest.mark.parametrize("quant", ["fp8", "fp8+fp8_kv"])
def test_fused_engine_equals_unfused_engine(quant, monkeypatch):
    from onepath.ops.cuda import quant as triton_quant
    m = quantised(quant)("consistent", seed=4)
    prompts = random_prompts(torch.Generator().manual_seed(9), 24, high=300)
    runs, calls = {}, {}
    quantize = triton_quant.quantize_fp8
    for fused in (False, True):
        monkeypatch.setattr(QL, "FUSED_ACT_QUANT", fused)
        count = [0]

        def counted(*a, **kw):
            count[0] += 1
            return quantize(*a, **kw)

        monkeypatch.setattr(triton_quant, "quantize_fp8", counted)
        runs[fused] = [dense.engine(m).generate(prompts, p, request_ids=list(range(24))) for p in dense.PARAMS]
        calls[fused] = count[0]
    for plain, fused in zip(runs[False], runs[True]):
        assert all(dense.same(a, b) for a, b in zip(plain, fused))
    # eager steps call the quantiser from Python: four linears a layer unfused, the attention output's alone fused
    assert calls[True] * 4 == calls[False], calls


def test_alone_equals_batch_fused(monkeypatch):
    monkeypatch.setattr(QL, "FUSED_ACT_QUANT", True)
    monkeypatch.setattr(dense, "model", quantised("fp8"))
    assert all(dense.alone_vs_batches("consistent"))
