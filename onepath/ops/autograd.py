"""Kernel values forward, plain differentiable math backward (straight-through where quantised).

`apply_kernel(kernel, reference, *inputs)` returns kernel(*inputs). Its backward recomputes
reference(*inputs) under autograd and differentiates that, so the forward bits are the engine's
and the gradient is the textbook one. save_for_backward makes backward refuse to run when an
input (the master weights included) was changed in place after the forward.
"""
from __future__ import annotations

from typing import Callable

import torch


class _KernelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel, reference, *inputs):
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        out = kernel(*inputs)
        return out

    @staticmethod
    def backward(ctx, *grad_outputs):
        inputs = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(needs) for x, needs in zip(inputs, ctx.needs_input_grad[2:])]
            out = ctx.reference(*leaves)
            outs = out if isinstance(out, tuple) else (out,)
            pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
            wanted = [x for x in leaves if x.requires_grad]
            grads = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
        it = iter(grads)
        return (None, None, *(next(it) if x.requires_grad else None for x in leaves))


def apply_kernel(kernel: Callable, reference: Callable, *inputs: torch.Tensor):
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        return _KernelFunction.apply(kernel, reference, *inputs)
    return kernel(*inputs)
