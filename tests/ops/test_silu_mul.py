import torch

from onepath.ops import silu_mul as S
from tests.ops.batch_probes import max_batch_drift


def test_silu_mul_batch_invariant_with_negative_control(consistent, baseline, gen):
    width = 37  # odd width: a probe row lands in the SIMD tail for some batch sizes
    g = _tail_sensitive_values(width, gen)
    u = torch.randn(1, width, generator=gen)
    pair = torch.cat([g, u], dim=1)
    # gate and up as separate contiguous tensors, as the MLP's projections produce them
    run = lambda spec: (lambda t: S.silu_mul(spec, t[:, :width].contiguous(), t[:, width:].contiguous()))
    assert max_batch_drift(run(consistent), pair, gen, sizes=range(1, 40)) == 0.0
    assert max_batch_drift(run(baseline), pair, gen, sizes=range(1, 40)) > 0.0


def _tail_sensitive_values(n, gen):
    """Values whose stock F.silu differs between the SIMD body and the scalar tail."""
    x = torch.randn(20000, generator=gen) * 4
    body = torch.nn.functional.silu(x)
    tail = torch.cat([torch.nn.functional.silu(x[i:i + 1].clone()) for i in range(x.numel())])
    picked = x[body != tail][:n]
    assert picked.numel() == n, "this CPU's silu has no body/tail difference to probe"
    return picked[None]
