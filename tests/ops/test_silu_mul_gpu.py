"""The Triton silu_mul kernel on the GPU (BF16, model widths): batch invariance, determinism and values.

Probe rows are computed alone, then embedded at random positions of random batches of M rows for every M in
MS (tests/ops/batch_probes.py): each copy must give the probe's bits (torch.equal), every launch twice the same
bits. Stock
F.silu(g) * u is elementwise with no batch-dependent dispatch: no negative control exists."""
import pytest
import torch

from onepath.ops import silu_mul as SM
from onepath.ops.cuda import silu_mul as kernels
from tests.ops.batch_probes import BF16, MS, gen, places, randn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("width", [3072, 11008])
def test_silu_mul_batch_invariant_deterministic_close(width):
    # Stock F.silu(g) * u is elementwise with no batch-dependent dispatch: no negative control exists.
    g = gen(width)
    probes = randn(g, 2, 2 * width, scale=4)  # [gate | up], as one fused projection produces them
    alone = [kernels.silu_mul(p[None, :width], p[None, width:])[0] for p in probes]
    for m in MS:
        fused = randn(g, m, 2 * width, scale=4)
        at = places(g, m, 2)
        for i, row in enumerate(at):
            fused[row] = probes[i]
        gate, up = fused[:, :width], fused[:, width:]
        out = kernels.silu_mul(gate, up)
        assert torch.equal(out, kernels.silu_mul(gate, up)), f"silu_mul not deterministic: I {width}, M {m}"
        assert torch.equal(out, kernels.silu_mul(gate.contiguous(), up.contiguous())), "views vs copies"
        for i, row in enumerate(at):
            assert torch.equal(out[row], alone[i]), f"silu_mul: I {width}, M {m}, row {row}"
        torch.testing.assert_close(out, SM.reference(gate, up), **BF16)
