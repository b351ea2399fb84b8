"""The GPU tests' probe harness: probe rows computed alone, then embedded at random positions of random batches of
M rows for every M in MS; each copy must give the probe's bits (torch.equal), every launch twice the same bits.
Shared by tests/ops/test_{rmsnorm, silu_mul, rope, logprobs}_gpu.py; max_batch_drift by the CPU tests."""
import torch

MS = (1, 2, 7, 64, 100, 1000, 4096)
# torch's default BF16 tolerance: kernel and reference may round one intermediate differently.
BF16 = dict(rtol=1.6e-2, atol=1e-5)
EPS = 1e-6


def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(g, *shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


def places(g, m, k):
    """min(k, m) distinct random rows of an m-row batch."""
    return torch.randperm(m, generator=g, device="cuda")[:min(k, m)].tolist()


def rows_alone_differ(fn, inputs, rows):
    """How many of `rows` get other bits alone (an M = 1 launch) than in the full batch."""
    as_tuple = lambda out: out if isinstance(out, tuple) else (out,)
    full = as_tuple(fn(*inputs))
    differ = 0
    for r in rows:
        alone = as_tuple(fn(*(x[r:r + 1] for x in inputs)))
        differ += any(not torch.equal(a[0], f[r]) for a, f in zip(alone, full))
    return differ


def max_batch_drift(fn, rows, gen, sizes=(1, 3, 16, 17, 50, 129, 700)):
    """fn(batch) for a fixed probe row placed at random positions in random batches; returns the
    largest |difference| from the probe alone, asserting nothing."""
    alone = fn(rows)
    worst = 0.0
    for m in sizes:
        batch = torch.randn(m, *rows.shape[1:], generator=gen) * 4
        pos = int(torch.randint(0, m, (1,), generator=gen))
        batch[pos] = rows[0]
        worst = max(worst, (fn(batch)[pos] - alone[0]).abs().max().item())
    return worst
