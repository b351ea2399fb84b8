"""Stacked projections on the GPU: q/k/v and gate/up as one GEMM each, QK-norm and RoPE of q and k as one
launch. On consistent CUDA they must be a speed-up only: the model's hidden states equal, bit for bit,
those of the same weights run layer by layer (a column's bits do not depend on the GEMM's N; the fused
norm and rope kernel rounds as the two kernels do). Negative control: a planted GEMM that reduces K
another way below 2048 columns (tests/planted.py) gives the k/v and o projections other bits than the
stacked qkv GEMM, and the comparison sees it. (cuBLAS, the baseline, gave the same bits stacked or not
on these shapes on the H200, so it cannot serve as the control.)"""
import pytest
import torch

from onepath.models import dense
from onepath.models.batch import ForwardBatch
from onepath.models.dense import DenseDecoder
from onepath.numerics.spec import ExecutionSpec
from tests.planted import SplitKBelowWideOps
from tests.tiny import random_prompts, tiny_config, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, vocab_size=1000)


def hidden_states(mode: str, stacked: bool, monkeypatch, lengths=(1, 37, 300, 5), ops_factory=None):
    with monkeypatch.context() as m:
        m.setattr(dense, "stack_projections", lambda ops, sizes: stacked and ops.spec.device == "cuda")
        if ops_factory is None:
            model = tiny_model(mode, seed=4, std=0.05, device="cuda", max_positions=1024, **SHAPE)
        else:
            model = DenseDecoder(tiny_config(**SHAPE), ops_factory(ExecutionSpec.default(mode, "cuda")), 1024)
            model.init_weights(4, std=0.05)
    assert hasattr(model.model.layers[0].self_attn, "qkv_proj") == stacked
    gen = torch.Generator().manual_seed(11)
    prompts = [random_prompts(gen, 1, low=n, high=n)[0] for n in lengths]
    batch, num_blocks = ForwardBatch.for_sequences(prompts, 16, device="cuda")
    with torch.no_grad():
        return model(batch, model.make_cache(num_blocks=num_blocks, block_size=16))


def test_stacked_projections_keep_the_bits_gpu(monkeypatch):
    for lengths in ((1, 37, 300, 5), (1,), (129, 2)):
        assert torch.equal(hidden_states("consistent", True, monkeypatch, lengths),
                           hidden_states("consistent", False, monkeypatch, lengths)), lengths


def test_negative_control_n_dependent_gemm_moves_bits_gpu(monkeypatch):
    for lengths in ((1, 37, 300, 5), (129, 2)):
        stacked, unstacked = (hidden_states("consistent", s, monkeypatch, lengths, SplitKBelowWideOps)
                              for s in (True, False))
        assert not torch.equal(stacked, unstacked), lengths
