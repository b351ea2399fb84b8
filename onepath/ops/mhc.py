"""mhc: manifold-constrained hyper-connections (DeepSeek-V4's mHC), in FP32.

The residual is N streams per token [T, N, D]. Before a block, `hc_pre` derives from the streams (flattened,
RMS-normalised, one GEMM against `fn`) three sets of weights:
    pre  = sigmoid(mix_pre * scale_0 + base_pre) + hc_eps                     [T, N]
    post = 2 * sigmoid(mix_post * scale_1 + base_post)                        [T, N]
    comb = Sinkhorn(softmax(mix_comb * scale_2 + base_comb) + hc_eps)         [T, N, N]
and collapses the streams into the block's input sum_n pre_n x_n. Sinkhorn-Knopp: the columns normalised,
then (iters - 1) times the rows and the columns, each sum plus hc_eps. After the block, `hc_post` makes the
new streams post_k * out + sum_j comb_jk x_j. `hc_head` collapses the streams once more before the final norm
(its own `fn`, `base` and one scale, pre only).

consistent: the norm and the GEMM are ops.rmsnorm's and ops.lm_head's (a fixed split of the reduced
dimension whatever the number of tokens: the stock kernels pick a split-K count from the batch), sigmoid,
softmax and exp on fixed-shape pieces, and every sum over the streams in stream order, so a token's bits do
not depend on its batch. Sinkhorn's order is fixed (columns first) and its iterations a config constant.
consistent CUDA: the Triton kernels of ops/cuda/mhc.py (the mixing GEMM over a fixed split of the reduced
dimension, the splits added in order; the epilogue, Sinkhorn and the collapse on registers in this order, one
program per token and block of channels; hc_post this file's arithmetic exactly). baseline: the stock ops over
the whole launch (F.linear, torch.softmax, .sum). Results in FP32; the collapse and the new streams are rounded once to the
streams' dtype. Backward: the `reference_*` functions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onepath.numerics.spec import ExecutionSpec
from onepath.ops import linear as _linear
from onepath.ops import rmsnorm as _rmsnorm
from onepath.ops import sigmoid as _sigmoid
from onepath.ops import softmax as _softmax
from onepath.ops.autograd import apply_kernel


def stream_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x summed over `dim` in index order: elementwise adds, no reduction kernel to pick an order."""
    parts = x.unbind(dim)
    acc = parts[0]
    for part in parts[1:]:
        acc = acc + part
    return acc


def _sinkhorn(comb, hc_eps, iters, total):
    comb = comb / (total(comb, -2).unsqueeze(-2) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (total(comb, -1).unsqueeze(-1) + hc_eps)
        comb = comb / (total(comb, -2).unsqueeze(-2) + hc_eps)
    return comb


def _weights(spec, x, fn, norm_eps):
    """The streams flattened, normalised (no weight) and mixed by fn: [T, rows of fn] FP32."""
    flat = x.reshape(x.shape[0], -1).float()
    normed = _rmsnorm.rmsnorm(spec, flat, flat.new_ones(flat.shape[-1]), norm_eps)
    return _linear.linear(spec, normed, fn.float(), op="lm_head")


def consistent_pre(spec, x, fn, base, scale, norm_eps, hc_eps, iters):
    n = x.shape[1]
    mix = _weights(spec, x, fn, norm_eps)
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s = scale.float()
    pre = _sigmoid.sigmoid(spec, pre_w * s[0] + pre_b) + hc_eps
    post = 2 * _sigmoid.sigmoid(spec, post_w * s[1] + post_b)
    comb = _softmax.softmax(spec, (comb_w * s[2] + comb_b).view(-1, n, n)) + hc_eps
    comb = _sinkhorn(comb, hc_eps, iters, stream_sum)
    collapsed = stream_sum(pre.unsqueeze(-1) * x.float(), 1).to(x.dtype)
    return post, comb, collapsed


def reference_pre(x, fn, base, scale, norm_eps, hc_eps, iters):
    n = x.shape[1]
    flat = x.reshape(x.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre_w, post_w, comb_w = F.linear(flat, fn.float()).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax((comb_w * s[2] + comb_b).view(-1, n, n), dim=-1) + hc_eps
    comb = _sinkhorn(comb, hc_eps, iters, lambda t, d: t.sum(dim=d))
    collapsed = (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
    return post, comb, collapsed


def consistent_post(out, x, post, comb):
    mixed = stream_sum(comb.unsqueeze(-1) * x.float().unsqueeze(2), 1)                   # [T, N(k), D]
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(x.dtype)


def reference_post(out, x, post, comb):
    mixed = torch.matmul(comb.transpose(-1, -2), x.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(x.dtype)


def consistent_head(spec, x, fn, base, scale, norm_eps, hc_eps):
    mix = _weights(spec, x, fn, norm_eps)
    pre = _sigmoid.sigmoid(spec, mix * scale.float() + base.float()) + hc_eps
    return stream_sum(pre.unsqueeze(-1) * x.float(), 1).to(x.dtype)


def reference_head(x, fn, base, scale, norm_eps, hc_eps):
    flat = x.reshape(x.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


def cuda_pre(spec, x, fn, base, scale, norm_eps, hc_eps, iters):
    from onepath.ops.cuda.mhc import hc_pre as triton_hc_pre
    return triton_hc_pre(x, fn, base, scale, norm_eps, hc_eps, iters)


def cuda_post(out, x, post, comb):
    from onepath.ops.cuda.mhc import hc_post as triton_hc_post
    return triton_hc_post(out, x, post, comb)


def cuda_head(spec, x, fn, base, scale, norm_eps, hc_eps):
    from onepath.ops.cuda.mhc import hc_head as triton_hc_head
    return triton_hc_head(x, fn, base, scale, norm_eps, hc_eps)


# (mode, device) -> (pre, post, head) kernels; the baseline runs the references over the whole launch
KERNELS = {
    ("consistent", "cpu"): (consistent_pre, consistent_post, consistent_head),
    ("consistent", "cuda"): (cuda_pre, cuda_post, cuda_head),
    ("baseline", "cpu"): (lambda spec, *a: reference_pre(*a), reference_post, lambda spec, *a: reference_head(*a)),
    ("baseline", "cuda"): (lambda spec, *a: reference_pre(*a), reference_post, lambda spec, *a: reference_head(*a)),
}


def hc_pre(spec: ExecutionSpec, x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           norm_eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, N, D]; fn [(2 + N) N, N D]; base [(2 + N) N]; scale [3] -> post [T, N], comb [T, N, N] (FP32),
    the block's input [T, D] in x's dtype."""
    kernel = KERNELS[spec.mode, spec.device][0]
    return apply_kernel(lambda *t: kernel(spec, *t, norm_eps, hc_eps, iters),
                        lambda *t: reference_pre(*t, norm_eps, hc_eps, iters), x, fn, base, scale)


def hc_post(spec: ExecutionSpec, out: torch.Tensor, x: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """The block's output out [T, D] expanded into the streams x [T, N, D] -> new streams [T, N, D]."""
    return apply_kernel(KERNELS[spec.mode, spec.device][1], reference_post, out, x, post, comb)


def hc_head(spec: ExecutionSpec, x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    """The streams x [T, N, D] collapsed once more: fn [N, N D], base [N], scale [1] -> [T, D] in x's dtype."""
    kernel = KERNELS[spec.mode, spec.device][2]
    return apply_kernel(lambda *t: kernel(spec, *t, norm_eps, hc_eps),
                        lambda *t: reference_head(*t, norm_eps, hc_eps), x, fn, base, scale)
