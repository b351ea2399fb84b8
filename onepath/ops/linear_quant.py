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
baseline: the same quantisers, then one library GEMM over all rows: block FP8 on CUDA by the library's blockwise
FP8 GEMM on the codes (torch._scaled_mm, the fast path FP8 engines run), elsewhere on the dequantised operands.
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
from onepath.ops.grouped_mm import stock_grouped, stock_grouped_fits
from onepath.ops.host import capturing, to_device
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


def prepared_weight(weight: torch.Tensor, q: QuantSpec, operand_dtype: torch.dtype, dequantized: bool = False,
                    library_k: bool = False):
    """The weight as the GEMM takes it: an FP8Tensor, or (code * s_blk in operand_dtype, s_dec) for NVFP4;
    stacked expert weights [G, N, K] are quantised expert by expert (quantize_experts). `dequantized`: the
    FP8 codes times their scales in operand_dtype instead (the baseline's stock grouped GEMM takes them).
    `library_k`: an FP8 weight [N, K] widened to scaled_mm_k(K) columns (zero codes, unit scales) as the library's
    blockwise GEMM needs them (fp8_library_cuda).
    From the parameter's cache while its version and storage are unchanged. A stale cache is rewritten
    in place, so a CUDA graph captured on it reads the new weights (refresh_quantized does it eagerly)."""
    key = (q, operand_dtype, dequantized, library_k, weight._version, weight.data_ptr(), tuple(weight.shape),
           weight.device)
    use_cache = getattr(weight, "quant_cache", True)
    hit = getattr(weight, "_quantized", None) if use_cache else None
    if hit is not None and (hit[0] == key or capturing(weight)):
        # while capturing, the graph reads the cache's storage; refresh_quantized keeps it current
        return hit[1]
    with torch.no_grad():
        prepared = quantize_experts(weight.detach(), q) if weight.dim() == 3 else quantize(weight.detach(), q)
        if isinstance(prepared, NVFP4Tensor):
            prepared = (prepared.dequantize(operand_dtype, outer=False), torch.reciprocal(prepared.encode_scale))
        elif dequantized:
            per_expert = [expert(prepared, g) for g in range(weight.shape[0])] if weight.dim() == 3 else [prepared]
            prepared = (torch.stack([q.dequantize(operand_dtype) for q in per_expert]).reshape(weight.shape),)
        elif library_k and weight.dim() == 2:
            prepared = widened(prepared, scaled_mm_k(weight.shape[1]))
        if hit is not None and hit[0][:4] == key[:4] and _copy_into(hit[1], prepared):
            prepared = hit[1]
    if use_cache:
        weight._quantized = (key, prepared)
    return prepared


def quantize_experts(weight: torch.Tensor, q: QuantSpec) -> FP8Tensor | NVFP4Tensor:
    """Stacked expert weights [G, N, K], each expert quantised alone as quantize(weight[g], q) would:
    FP8 codes [G, N, K] with scales [G, ceil(N/r), ceil(K/128)]; NVFP4 codes [G, N, K], block scales
    [G, N, ceil(K/16)] and an outer scale s_enc [G] (an expert's own amax). Blocks of whole rows never
    straddle two experts, so their FP8 codes come from one call over [G * N, K]."""
    g, n, k = weight.shape
    if q.format == "fp8_e4m3" and n % q.block[0] == 0:
        flat = quantize(weight.reshape(g * n, k), q)
        return FP8Tensor(flat.codes.reshape(g, n, k), flat.scales.reshape(g, n // q.block[0], -1), flat.block, flat.rule)
    parts = [quantize(w, q) for w in weight.unbind(0)]
    if q.format == "fp8_e4m3":
        return FP8Tensor(torch.stack([p.codes for p in parts]), torch.stack([p.scales for p in parts]),
                         parts[0].block, parts[0].rule)
    return NVFP4Tensor(torch.stack([p.codes for p in parts]), torch.stack([p.scales for p in parts]),
                       torch.stack([p.encode_scale for p in parts]))


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
                prepared_weight(t, *hit[0][:4])


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


# (N, K) -> None where torch._scaled_mm took the blockwise layout at that weight shape, else why not: the library's
# refusal, or its products off the dequantised GEMM's (wrong_products); decided at the first eager call (the engine
# warms a graph's forward up before it captures it)
_SCALED_MM_REFUSED: dict[tuple[int, int], str | None] = {}
SCALED_MM_ROWS = 16  # the library call's rows are padded to a multiple of this: its outer-dim-major activation
#                      scales then have 16-byte aligned columns whatever the batch
# The library reads the weight's scales [K/128, N/128] by column, each column K/128 FP32 values long: where K/128 is
# not a multiple of 4 the columns do not start 16-byte aligned and its products come out wrong, with no error
# (K = 1152, 2304, 2816 on an H100, torch 2.11: bench/results/linear/scaled-mm-k-blocks-h100.txt). Such a K is
# widened with zero codes to a multiple of SCALED_MM_K: the weight once, in its prepared copy; the activations per call.
SCALED_MM_K = 512


def scaled_mm_k(k: int) -> int:
    """The K the library's blockwise FP8 GEMM is called with for a reduction of k: k itself where k / 128 is a
    multiple of 4 or k is not a multiple of 128 (the library refuses that one), else k rounded up to SCALED_MM_K."""
    return k if k % 128 or (k // 128) % 4 == 0 else -(-k // SCALED_MM_K) * SCALED_MM_K


def widened(q: FP8Tensor, k: int) -> FP8Tensor:
    """q [R, K'] with k >= K' columns: zero codes and unit scales past K' (they add nothing to a product)."""
    extra = k - q.codes.shape[-1]
    if extra == 0:
        return q
    codes = F.pad(q.codes.view(torch.uint8), (0, extra)).view(q.codes.dtype)
    scales = F.pad(q.scales, (0, -(-k // q.block[1]) - q.scales.shape[-1]), value=1.0)
    return FP8Tensor(codes, scales, q.block, q.rule)


# The library's first product at a weight shape is held to the dequantised GEMM's within this share of the latter's
# largest value (the FP8 accumulation order and the output's rounding move it well under 1 %); past it the shape
# is refused, as the library's wrong products at K / 128 not a multiple of 4 would have been.
SCALED_MM_TOLERANCE = 0.05


def wrong_products(out: torch.Tensor, qa: FP8Tensor, w: FP8Tensor) -> tuple[bool, str | None]:
    """(decided, reason): out (the library's product of qa and w) against the dequantised GEMM's: within
    SCALED_MM_TOLERANCE of its largest value (True, None), past it (True, the refusal's reason), or undecided where
    that product is all zeros (a zero input tells nothing: the next call decides)."""
    want = dequantized_gemm(widened(qa, w.codes.shape[1]), w).float()
    top = float(want.abs().max())
    if not top > 0:
        return False, None
    err = float((out.float() - want).abs().max()) / top
    return True, None if err <= SCALED_MM_TOLERANCE else (
        f"wrong products: max |difference| {err:.3g} of the dequantised GEMM's largest value at the first call")


def fp8_library_cuda(op: OpSpec, x, x2, qw, bias, out_dtype):
    """baseline on CUDA, the fast path FP8 engines run: the library's blockwise FP8 GEMM (torch._scaled_mm with
    1x128 activation scales, outer-dim major, and 128x128 weight scales: cuBLAS's DeepSeek-style kernel, whose
    tiles and split follow the shape) on the codes, the activations quantised by the Triton quantiser (the same
    codes as every path), the rows padded with zero codes to a multiple of SCALED_MM_ROWS and K widened to
    scaled_mm_k(K) (qw may come widened already: prepared_weight's library_k). A weight shape the library refuses
    (K not a multiple of 128, say), or whose first product is off the dequantised GEMM's (wrong_products, checked
    at the first eager call with a nonzero product), takes the dequantised GEMM, once decided for good (the reason in
    _SCALED_MM_REFUSED)."""
    from onepath.ops.cuda.quant import quantize_fp8
    qa = quantize_fp8(x2, op.act)
    (m, k), n = qa.codes.shape, qw.codes.shape[0]
    wide = scaled_mm_k(k)
    key = (n, wide)
    if _SCALED_MM_REFUSED.get(key) is None and op.act.block == (1, 128) and qw.block == (128, 128):
        pad = -m % SCALED_MM_ROWS
        codes = qa.codes
        if pad or wide != k:
            codes = qa.codes.new_zeros(m + pad, wide)
            codes[:m, :k] = qa.codes
        scales = qa.scales.new_ones(-(-wide // 128), m + pad).t()  # outer-dim major, written once
        scales[:m, :qa.scales.shape[1]] = qa.scales
        try:
            w = widened(qw, wide)
            out = torch._scaled_mm(codes, w.codes.t(), scale_a=scales, scale_b=w.scales.t(), out_dtype=out_dtype)[:m]
        except (RuntimeError, NotImplementedError) as e:
            if capturing(x2):
                raise
            _SCALED_MM_REFUSED[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        else:
            if key not in _SCALED_MM_REFUSED and not capturing(x2):
                decided, reason = wrong_products(out, qa, w)
                if decided:
                    _SCALED_MM_REFUSED[key] = reason
            if _SCALED_MM_REFUSED.get(key) is None:
                return out if bias is None else (out.float() + bias.float()).to(out_dtype)
    return dequantized_gemm(widened(qa, qw.codes.shape[1]), qw, bias).to(out_dtype)


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
    ("baseline", "cuda"): fp8_library_cuda,
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
    qw = prepared_weight(weight, op.weight, operand_dtype, library_k=fmt == "fp8" and backend == ("baseline", "cuda"))
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


def group_of_rows(counts: list[int] | torch.Tensor, m: int, device) -> torch.Tensor:
    """The group of each of m rows packed by group (counts[g] rows each), on the device, with no host sync
    for tensor counts; rows past the counts' sum (a fixed-size buffer's unused tail) get the last group."""
    if not isinstance(counts, torch.Tensor):
        counts = to_device(counts, torch.int64, device)
    ends = torch.cumsum(counts, 0)
    rows = torch.arange(m, device=device, dtype=ends.dtype)
    return torch.searchsorted(ends, rows, right=True).clamp_(max=counts.shape[0] - 1)


def expert(q: FP8Tensor, g: int) -> FP8Tensor:
    """Expert g's weight of stacked FP8 expert weights (quantize_experts)."""
    return FP8Tensor(q.codes[g], q.scales[g], q.block, q.rule)


def per_group_rows(fn, m: int, counts: list[int] | torch.Tensor, n: int, device) -> torch.Tensor:
    """fn(rows, g) -> FP32 [len(rows), n] for each group's rows (a slice of 0..m, packed by group, the
    counts read on the host); rows past the counts' sum come out zero."""
    counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
    out = torch.zeros(m, n, dtype=torch.float32, device=device)
    start = 0
    for g, c in enumerate(counts):
        if c:
            out[start:start + c] = fn(slice(start, start + c), g)
        start += c
    return out


def grouped_fp8_cuda(op: OpSpec, x, x2, qw, counts, out_dtype):
    from onepath.ops.cuda.linear_grouped_fp8 import linear_grouped_fp8
    from onepath.ops.cuda.quant import quantize_fp8
    qa = attached_quantized(x, op.act)
    return linear_grouped_fp8(qa if qa is not None else quantize_fp8(x2, op.act), qw, counts, out_dtype)


def grouped_fp8_cpu(op: OpSpec, x, x2, qw, counts, out_dtype):
    qa = quantize(x2, op.act)  # per row: each group's rows get the codes they would get alone
    rows = lambda r, g: fp8_gemm(FP8Tensor(qa.codes[r], qa.scales[r], qa.block, qa.rule), expert(qw, g))
    return per_group_rows(rows, x2.shape[0], counts, qw.codes.shape[1], x2.device).to(out_dtype)


def grouped_fp8_library(op: OpSpec, x, x2, qw, counts, out_dtype):
    (w,) = qw  # the dequantised weights
    a = quantize(x2, op.act).dequantize(w.dtype)
    return per_group_rows(lambda r, g: F.linear(a[r], w[g]).float(), x2.shape[0], counts, w.shape[1],
                          x2.device).to(out_dtype)


def grouped_fp8_stock(op: OpSpec, x, x2, qw, counts, out_dtype):
    (w,) = qw  # the dequantised weights, in x's dtype: torch's grouped GEMM takes BF16
    a = quantize(x2, op.act).dequantize(w.dtype)
    if not stock_grouped_fits(a, w):
        return grouped_fp8_library(op, x, x2, qw, counts, out_dtype)
    return stock_grouped(a, w, counts).to(out_dtype)


def grouped_nvfp4_cuda(op: OpSpec, a_op, w_op, counts):
    from onepath.ops.cuda.linear_grouped import linear_grouped
    return linear_grouped(a_op, w_op, counts, out_dtype=torch.float32)


def grouped_nvfp4_cpu(op: OpSpec, a_op, w_op, counts):
    return per_group_rows(lambda r, g: nvfp4_cpu(op, a_op[r], w_op[g]), a_op.shape[0], counts, w_op.shape[1],
                          a_op.device)


def grouped_nvfp4_library(op: OpSpec, a_op, w_op, counts):
    return per_group_rows(lambda r, g: F.linear(a_op[r], w_op[g]).float(), a_op.shape[0], counts, w_op.shape[1],
                          a_op.device)


def grouped_nvfp4_stock(op: OpSpec, a_op, w_op, counts):
    if not stock_grouped_fits(a_op, w_op):
        return grouped_nvfp4_library(op, a_op, w_op, counts)
    return stock_grouped(a_op, w_op, counts).float()


# (mode, device) -> the grouped block-FP8 GEMM (op, x, x2 [M, K], prepared experts, counts, out_dtype) -> [M, N]
GROUPED_FP8 = {
    ("consistent", "cuda"): grouped_fp8_cuda,
    ("consistent", "cpu"): grouped_fp8_cpu,
    ("baseline", "cuda"): grouped_fp8_stock,
    ("baseline", "cpu"): grouped_fp8_library,
}
# (mode, device) -> the grouped NVFP4 GEMM on the dequantised operands (op, a_op, w_op [G, N, K], counts) -> FP32 acc
GROUPED_NVFP4 = {
    ("consistent", "cuda"): grouped_nvfp4_cuda,
    ("consistent", "cpu"): grouped_nvfp4_cpu,
    ("baseline", "cuda"): grouped_nvfp4_stock,
    ("baseline", "cpu"): grouped_nvfp4_library,
}


def grouped_quant_linear(spec: ExecutionSpec, x: torch.Tensor, weight: torch.Tensor, counts: list[int] | torch.Tensor,
                         out_dtype: torch.dtype, name: str = "linear") -> torch.Tensor:
    """quant_linear's forward values for x [M, K], rows packed by group (counts[g] rows each), against the
    stacked expert weights [G, N, K]: each row the bits quant_linear gives it against its expert's weight
    alone (the same quantisers, per row; the consistent GEMMs' rows do not depend on the other rows). On
    consistent CUDA one launch reads tensor counts on the device (no host sync: a CUDA graph holds it);
    the baseline on CUDA runs torch's grouped GEMM on the dequantised operands (BF16: NVFP4's are exact
    in it, FP8's rounded to it); the CPU loops over the groups. Rows past the counts' sum may be left
    unwritten."""
    op = spec.op(name)
    fmt = check_formats(op, name)
    backend = spec.mode, spec.device
    operand_dtype = x.dtype if spec.device == "cuda" else torch.float32
    x2 = x.reshape(-1, x.shape[-1])
    if fmt == "fp8":
        qw = prepared_weight(weight, op.weight, operand_dtype, dequantized=spec.mode == "baseline")
        return GROUPED_FP8[backend](op, x, x2, qw, counts, out_dtype)
    w_op, s_dec = prepared_weight(weight, op.weight, operand_dtype)
    scale = s_dec[group_of_rows(counts, x2.shape[0], x.device)]  # each row's expert's outer scale
    if fmt == "w4a4":
        qa = quantize(x2, op.act)
        a_op, scale = qa.dequantize(operand_dtype, outer=False), torch.reciprocal(qa.encode_scale) * scale[:, None]
    else:
        a_op, scale = x2.to(operand_dtype), scale[:, None]
    return (GROUPED_NVFP4[backend](op, a_op, w_op, counts) * scale).to(out_dtype)


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
