"""linear, quantised: y = x W^T + b with W (and x) stored by the spec's QuantSpecs, one numeric path for the
engine and the trainer (ops/linear.py calls it where the op's weight/act are set). The quantisers are
onepath/numerics/quant.py's (on CUDA the FP8 activations go through the Triton quantiser of ops/cuda/quant.py,
the same rule, the same codes). The forward GEMM comes from FP8_GEMMS / NVFP4_GEMMS by (mode, device).

Block FP8 W8A8 (ops[op].weight = FP8_WEIGHT 128x128, .act = FP8_ACT 1x128), per 128-wide K block kb:
    partial = sum_k code_a[m, k] * code_w[n, k]           fresh FP32 partial of the block
    acc     = fma(partial, sa[m, kb] * sw[n // 128, kb], acc)   scale product first, one FMA
    y       = round(acc + b)                              bias in FP32, one rounding to the output dtype
  CPU: the partial is summed in float64, where it is exact (e4m3 products are multiples of 2^-18 below
  2^18, 128 of them stay under 2^25: 43 bits < 53), then rounded once to FP32; a row's bits cannot
  depend on M, on the summation order or on its neighbours. The FMA is exact: FP64 with round-to-odd,
  then one rounding to FP32. CUDA: ops/cuda/linear_fp8.py, a fresh tl.dot per K block on the fp8
  codes (Hopper's FP8 MMA rounds its own way: CPU and GPU do not bit-match, each agrees with itself).
NVFP4 W4A16 (weight = NVFP4_WEIGHT) and W4A4 (act = NVFP4_ACT), emulated:
    w_op  = E2M1[code_w] * s_blk_w,  a_op = E2M1[code_a] * s_blk_a (W4A4) or x (W4A16)   exact in BF16
    acc   = a_op @ w_op^T                                FP32 accumulation, the consistent GEMM's order
    y     = round(acc * (s_dec_a[m] * s_dec_w) + b)      s_dec = 1 / s_enc (FP32), W4A16: acc * s_dec_w
  CPU: F.linear on fixed [row_chunk, K] pieces of the operands in FP32 (linear.consistent's rule);
  CUDA: ops/cuda/linear.py on the BF16 operands with FP32 output; the epilogue in FP32 torch ops.
baseline: the same quantisers, then one library GEMM over all rows on the dequantised operands.
Backward is straight-through: linear.reference on the unquantised operands (ops/autograd.py).

The weight's quantised copy is cached on the parameter and rebuilt when its version counter moves
(optimizer steps and the engine's in-place copy_ bump it) or its storage changes; `quant_cache =
False` on a parameter turns that off (re-quantised at every forward: the memory of one copy saved).
A captured CUDA graph reads the cache's storage: a stale cache is rewritten in place (the engine calls
refresh_quantized after a weight update, before the next replay).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onepath.numerics.quant import FP8Tensor, NVFP4Tensor, quantize
from onepath.numerics.spec import ExecutionSpec, OpSpec, QuantSpec
from onepath.ops.host import capturing
from onepath.ops.pinned import row_chunks

FP8_BLOCK_K = 128
# Fused producers: on the CUDA consistent path without autograd, with FP8 W8A8 linears, RMSNorm and SiLU-mul
# also quantise their output by the linears' activation rule in their own launch (ops/cuda/quant_rows.py); the
# FP8Tensor rides on the output (`attach_quantized`) and quant_linear takes it instead of launching the quantiser.
# The codes are the quantiser's, bit for bit: the same rule on the same stored values (docs/ops/linear.md).
FUSED_ACT_QUANT = True


def is_quantised(op: OpSpec) -> bool:
    """Whether the op's weight or activation is stored quantised (ops/linear.py then runs quant_linear)."""
    return op.weight is not None or op.act is not None


def check_formats(op: OpSpec, name: str) -> str:
    """'fp8' (W8A8), 'w4a16' or 'w4a4'; any other weight/act pairing is refused."""
    w, a = op.weight, op.act
    w_fmt, a_fmt = (w.format if w else None), (a.format if a else None)
    if w_fmt == a_fmt == "fp8_e4m3":
        if w.scales_applied != "accumulator" or a.scales_applied != "accumulator" or w.scale_domain != "per_block" \
                or a.scale_domain != "per_block" or w.block[1] != FP8_BLOCK_K or a.block != (1, FP8_BLOCK_K):
            raise ValueError(f"ops[{name!r}]: the FP8 GEMM takes per_block scales applied in the accumulator, "
                             f"weight blocks (r, {FP8_BLOCK_K}) and activation groups (1, {FP8_BLOCK_K}); got weight "
                             f"{w.scale_domain} {w.block}, act {a.scale_domain} {a.block}: use the 'fp8' preset")
        return "fp8"
    if w_fmt == "nvfp4" and a_fmt in (None, "nvfp4"):
        if w.outer_scale != "per_tensor" or (a is not None and a.outer_scale != "per_token"):
            raise ValueError(f"ops[{name!r}]: NVFP4 takes a per_tensor outer scale on the weight and per_token on "
                             "the activation: use the 'nvfp4_w4a16' or 'nvfp4_w4a4' preset")
        return "w4a16" if a is None else "w4a4"
    raise ValueError(f"ops[{name!r}]: weight {w_fmt} with act {a_fmt} is not a supported pairing: use FP8 W8A8 "
                     "(fp8_e4m3 both), NVFP4 W4A16 (weight nvfp4, act None) or W4A4 (nvfp4 both)")


def prepared_weight(weight: torch.Tensor, q: QuantSpec, operand_dtype: torch.dtype):
    """The weight as the GEMM takes it: an FP8Tensor, or (code * s_blk in operand_dtype, s_dec) for NVFP4;
    from the parameter's cache while its version and storage are unchanged. A stale cache is rewritten
    in place, so a CUDA graph captured on it reads the new weights (refresh_quantized does it eagerly)."""
    key = (q, operand_dtype, weight._version, weight.data_ptr(), tuple(weight.shape), weight.device)
    use_cache = getattr(weight, "quant_cache", True)
    hit = getattr(weight, "_quantized", None) if use_cache else None
    if hit is not None and (hit[0] == key or capturing(weight)):
        # while capturing, the graph reads the cache's storage; refresh_quantized keeps it current
        return hit[1]
    with torch.no_grad():
        prepared = quantize(weight.detach(), q)
        if isinstance(prepared, NVFP4Tensor):
            prepared = (prepared.dequantize(operand_dtype, outer=False), torch.reciprocal(prepared.encode_scale))
        if hit is not None and hit[0][:2] == key[:2] and _copy_into(hit[1], prepared):
            prepared = hit[1]
    if use_cache:
        weight._quantized = (key, prepared)
    return prepared


def _tensors(q) -> list[torch.Tensor]:
    return [q.codes, q.scales] if isinstance(q, FP8Tensor) else list(q)


def _copy_into(old, new) -> bool:
    """Write `new` into `old`'s storage when every tensor has the same shape and dtype."""
    pairs = list(zip(_tensors(old), _tensors(new)))
    if not all(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device for a, b in pairs):
        return False
    for a, b in pairs:
        a.copy_(b)
    return True


@torch.no_grad()
def refresh_quantized(module: torch.nn.Module) -> None:
    """Re-quantise every cached weight of `module` whose values changed, into the cache's own storage:
    after an in-place weight update, before a captured graph replays (it does not pass through Python).
    The weights are the parameters and the plain tensors modules hold (a StackedLinear's stacked weight,
    whose views the layers' parameters are)."""
    seen = set()
    for m in module.modules():
        for t in [*m._parameters.values(), *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]:
            hit = getattr(t, "_quantized", None)
            if hit is not None and id(t) not in seen:
                seen.add(id(t))
                prepared_weight(t, *hit[0][:2])


def fused_act_rule(spec: ExecutionSpec, block: int) -> QuantSpec | None:
    """The rule a producer whose launch covers `block` columns of a row quantises its output by for the next
    linear (see FUSED_ACT_QUANT), or None: off, not the CUDA consistent path, autograd on, or no FP8 W8A8 linear."""
    op = spec.op("linear")
    act = op.act
    if not FUSED_ACT_QUANT or spec.mode != "consistent" or spec.device != "cuda" or torch.is_grad_enabled() \
            or act is None or op.weight is None or check_formats(op, "linear") != "fp8" or block % act.block[1]:
        return None
    return act


def attach_quantized(out: torch.Tensor, quantized: FP8Tensor) -> torch.Tensor:
    """out, carrying its quantisation for the next linear (with out's version: an in-place change drops it)."""
    out._fp8_act = (quantized, out._version)
    return out


def attached_quantized(x: torch.Tensor, act: QuantSpec) -> FP8Tensor | None:
    """The FP8Tensor a producer attached to x by `act`, [M, K] with its scales [M, groups], or None."""
    hit = getattr(x, "_fp8_act", None)
    if hit is None or hit[1] != x._version or hit[0].rule != act or hit[0].codes.shape != x.shape:
        return None
    q, k = hit[0], x.shape[-1]
    return FP8Tensor(q.codes.reshape(-1, k), q.scales.reshape(-1, q.scales.shape[-1]), q.block, q.rule)


def fp8_cuda(op: OpSpec, x, x2, qw, bias, out_dtype):
    from onepath.ops.cuda.linear_fp8 import linear_fp8
    from onepath.ops.cuda.quant import quantize_fp8
    qa = attached_quantized(x, op.act)
    return linear_fp8(qa if qa is not None else quantize_fp8(x2, op.act), qw, bias, out_dtype)


def fp8_cpu(op: OpSpec, x, x2, qw, bias, out_dtype):
    return fp8_gemm(quantize(x2, op.act), qw, bias).to(out_dtype)


def fp8_library(op: OpSpec, x, x2, qw, bias, out_dtype):
    return dequantized_gemm(quantize(x2, op.act), qw, bias).to(out_dtype)


def nvfp4_cuda(op: OpSpec, a_op, w_op):
    from onepath.ops.cuda.linear import linear
    return linear(a_op, w_op, out_dtype=torch.float32)


def nvfp4_cpu(op: OpSpec, a_op, w_op):
    return row_chunks(lambda c: F.linear(c, w_op), op.row_chunk, a_op)


def nvfp4_library(op: OpSpec, a_op, w_op):
    return F.linear(a_op, w_op)


# (mode, device) -> the block-FP8 GEMM (op, x, x2 [M, K], prepared weight, bias, out_dtype) -> y [M, N]
FP8_GEMMS = {
    ("consistent", "cuda"): fp8_cuda,
    ("consistent", "cpu"): fp8_cpu,
    ("baseline", "cuda"): fp8_library,
    ("baseline", "cpu"): fp8_library,
}
# (mode, device) -> the NVFP4 GEMM on the dequantised operands (op, a_op, w_op) -> FP32 acc, before the epilogue
NVFP4_GEMMS = {
    ("consistent", "cuda"): nvfp4_cuda,
    ("consistent", "cpu"): nvfp4_cpu,
    ("baseline", "cuda"): nvfp4_library,
    ("baseline", "cpu"): nvfp4_library,
}


def quant_linear(spec: ExecutionSpec, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype, name: str = "linear") -> torch.Tensor:
    """The forward values of a quantised linear (no autograd: linear() wraps it straight-through)."""
    op = spec.op(name)
    fmt = check_formats(op, name)
    backend = spec.mode, spec.device
    operand_dtype = x.dtype if backend == ("consistent", "cuda") else torch.float32
    qw = prepared_weight(weight, op.weight, operand_dtype)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if fmt == "fp8":
        return FP8_GEMMS[backend](op, x, x2, qw, bias, out_dtype).reshape(*lead, weight.shape[0])

    w_op, s_dec = qw
    if fmt == "w4a4":
        qa = quantize(x2, op.act)
        a_op, s_dec = qa.dequantize(operand_dtype, outer=False), torch.reciprocal(qa.encode_scale) * s_dec
    else:
        a_op = x2.to(operand_dtype)
    y = NVFP4_GEMMS[backend](op, a_op, w_op) * s_dec
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).reshape(*lead, weight.shape[0])


def fp8_gemm(qa: FP8Tensor, qw: FP8Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The block-FP8 GEMM of the module docstring on CPU: FP32 [M, N], bias added, not yet rounded."""
    a, w = qa.codes.double(), qw.codes.double()
    (m, k), n = a.shape, w.shape[0]
    sw = qw.scales.repeat_interleave(qw.block[0], 0)[:n]  # [N, K blocks]
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    for kb, start in enumerate(range(0, k, FP8_BLOCK_K)):
        blk = slice(start, start + FP8_BLOCK_K)
        partial = (a[:, blk] @ w[:, blk].T).float()  # exact in float64: one rounding to FP32
        acc = fma(partial, qa.scales[:, kb:kb + 1] * sw[:, kb][None, :], acc)
    return acc if bias is None else acc + bias.float()


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once: the product is exact in FP64, the sum rounded to odd in FP64
    (TwoSum's error says which way), and FP64-to-odd then FP32 rounds as one rounding would (53 >= 24 + 2)."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    bp = s - c
    err = (p - bp) + (c - (s - bp))  # TwoSum: s + err == p + c exactly
    odd = (s.view(torch.int64) & 1) == 1
    toward = torch.nextafter(s, torch.where(err > 0, torch.inf, -torch.inf).double())
    return torch.where((err == 0) | odd | ~torch.isfinite(s), s, toward).float()


def dequantized_gemm(qa: FP8Tensor, qw: FP8Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """baseline: dequantised operands, one library GEMM over all rows (its M-dependent kernel)."""
    return F.linear(qa.dequantize(), qw.dequantize(), None if bias is None else bias.float())
