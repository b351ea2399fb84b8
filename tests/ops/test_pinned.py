"""The consistent CPU backend's fixed-shape sums (ops/pinned.py)."""
import torch

from onepath.ops.pinned import tiled_sum, tree_sum


def test_tiled_sum_ignores_trailing_zeros(gen):
    x = torch.randn(5, 37, generator=gen)
    for extra in (0, 1, 11, 27, 100):
        padded = torch.cat([x, torch.zeros(5, extra)], dim=1)
        assert torch.equal(tiled_sum(padded, 16), tiled_sum(x, 16))


def test_tree_sum_close_to_sum(gen):
    x = torch.randn(4, 1001, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(tree_sum(x), x.sum(-1))
