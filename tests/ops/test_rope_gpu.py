"""The Triton rope kernel on the GPU (BF16, Qwen3 heads): batch invariance, determinism, and torch eager's bits.

Probe rows are computed alone, then embedded at random positions of random batches of M rows for every M in
MS (tests/ops/batch_probes.py): each copy must give the probe's bits (torch.equal), every launch twice the same
bits. Stock
rope is elementwise as well: no negative control exists."""
import pytest
import torch

from onepath.ops import rope as RP
from onepath.ops.cuda import rope as kernels
from tests.ops.batch_probes import MS, gen, places, randn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_rope_batch_invariant_and_equal_to_torch():
    # Unfused products (enable_fp_fusion=False) are torch eager's arithmetic: the bits equal the
    # reference's. Stock rope is elementwise as well: no negative control exists.
    heads, dim, max_pos = 16, 128, 8192
    g = gen(11)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device="cuda", dtype=torch.float32) / dim))
    angles = torch.arange(max_pos, device="cuda", dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = angles.cos(), angles.sin()
    probes = randn(g, 2, heads, dim, scale=2)
    probe_pos = torch.tensor([5, 4000], device="cuda")
    alone = [kernels.rope(p[None], pos[None], cos, sin)[0] for p, pos in zip(probes, probe_pos)]
    for m in MS:
        qkv = randn(g, m, heads + 8, dim, scale=2)  # q as a strided view of a fused qkv
        positions = torch.randint(0, max_pos, (m,), generator=g, device="cuda")
        at = places(g, m, 2)
        for i, row in enumerate(at):
            qkv[row, :heads], positions[row] = probes[i], probe_pos[i]
        q = qkv[:, :heads]
        out = kernels.rope(q, positions, cos, sin)
        assert torch.equal(out, kernels.rope(q, positions, cos, sin)), f"rope not deterministic: M {m}"
        for i, row in enumerate(at):
            assert torch.equal(out[row], alone[i]), f"rope: M {m}, row {row}"
        assert torch.equal(out, RP.reference(q, cos[positions], sin[positions])), f"rope != torch eager: M {m}"
