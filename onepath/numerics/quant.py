"""The quantisers of the ExecutionSpec's low-precision formats, in torch: the same bits on CPU and CUDA.

Every step is one IEEE FP32 operation in the order written (a reordered or fused step moves codes);
constants enter as tensors, since torch computes `2688.0 / t` as reciprocal(t) * 2688 and its CUDA
kernels compute `t / 448.0` as t * (1/448):

Block FP8 (E4M3, max 448), per block of QuantSpec.block (activations 1x128 along K, weights 128x128):
    amax  = max(max|x_blk|, amax_floor)           floor 1e-4, as DeepGEMM: a zero block gets scale 1e-4/448,
                                                  finite and normal, so 1/scale never overflows to inf
            then min(amax, amax_ceil)             when QuantSpec.amax_ceil is set (FP8_KV: 448 * 2^7):
                                                  larger values saturate through the clamp below
    scale = amax / 448                            ue8m0: then 2^ceil(log2 scale), exact, from its bits
    y     = x * (1 / scale)  or  x / scale        QuantSpec.scale_apply
    q     = e4m3_rne(clamp(y, -448, 448))         clamp first: torch's cast has made NaN above 464 (2.11,
                                                  CUDA; 2.13 on CPU saturates) where Triton saturates
    dequantize: q * scale
The clamp never binds for finite x under the amax rule (|y| exceeds 448 by a few FP32 ulps at most,
which the cast rounds to 448): it keeps the rule total for any scale, e.g. a fixed KV-cache scale.

NVFP4, Transformer Engine's formulation in its kernel's op order (E2M1 codes {0, .5, 1, 1.5, 2, 3, 4, 6}):
    A     = max|x| over the tensor (outer_scale per_tensor) or the row (per_token)
    s_enc = min(2688 / A, FLT_MAX)                2688 = 448 * 6; A = 0 gives FLT_MAX
    s_dec = 1 / s_enc                             ~ A / 2688: the outer scale g, computed as TE does
    s_blk = e4m3_rne(min(vec_max * (s_enc * fl32(1/6)), 448))      vec_max = max|x| over 16 along K
    e     = min(1 / (s_blk * s_dec), FLT_MAX)     s_blk = 0 gives FLT_MAX: such a block's codes saturate
                                                  (to +-6, as TE's) and dequantise to 0 all the same
    code  = e2m1_rne(clamp(x * e, -6, 6))         ties to the even code: 0.25->0, 0.75->1, 1.25->1,
                                                  1.75->2, 2.5->2, 3.5->4, 5->4
    dequantize: (E2M1[code] * s_blk) / s_enc      the product is exact in FP32 and in BF16 (<= 6 bits,
                                                  2^-10..2688): the emulated GEMM takes it as its BF16
                                                  operand and applies the outer scales in its epilogue

Rules both formats share:
- Ragged edges (K not a multiple of 128 or 16, N not of 128): the last block holds what is left; its
  amax is over those elements alone, which equals zero-padding the tensor to whole blocks (DeepGEMM
  and TE pad), so a GEMM that pads K with zeros sees the same scales.
- Non-finite input: a block (FP8) or outer-scale domain (NVFP4: the tensor or the row) holding +-inf
  or NaN gets scale NaN (and s_enc NaN) and codes 0, so it dequantises to NaN and the failure shows in
  the log-probs and the diff gates. Not an error: checking would cost a device-to-host sync per call
  (and break CUDA graphs); not saturated: a scale from an infinite amax means nothing.
- The sign is kept: -0 and negatives that round to zero give the negative zero code (FP8 0x80,
  E2M1 8); TE's Python reference maps an exact -0.0 to code 0.
- Storage: FP8 codes as torch.float8_e4m3fn, scales FP32 (ue8m0 scales are FP32 powers of two);
  NVFP4 codes unpacked, one uint8 per element (bit 3 the sign), block scales float8_e4m3fn, s_enc FP32.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from onepath.numerics.spec import FP8_ACT, NVFP4_WEIGHT, QuantSpec

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FLT_MAX = torch.finfo(torch.float32).max
NVFP4_BLOCK = 16
# Code i's magnitude is E2M1_GRID[i]; codes 8..15 are the negatives (8 = -0).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Between codes i and i+1; a magnitude's code counts the midpoints it passes. A tie goes to the even
# code, so a midpoint after an even code is passed only when exceeded, after an odd one when reached.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass(frozen=True)
class FP8Tensor:
    """codes: float8_e4m3fn, the input's shape. scales: FP32, one per block: [*lead, ceil(K/cols)] for
    blocks of one row, [ceil(R/rows), ceil(K/cols)] for 2-D blocks of an [R, K] tensor."""
    codes: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]  # (rows, cols) as applied: per_token is (1, K), per_tensor (R, K)
    rule: QuantSpec | None = None  # the rule the codes were written by, where known (a KV cache: the spec's kv)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """codes * scale in FP32, then one rounding to dtype."""
        k = self.codes.shape[-1]
        codes = self.codes.reshape(-1, k).float()
        scales = self.scales.reshape(-(-codes.shape[0] // self.block[0]), -(-k // self.block[1]))
        return (codes * _expand(scales, self.block, codes.shape)).reshape(self.codes.shape).to(dtype)


@functools.lru_cache(maxsize=None)
def _e2m1_values(device: torch.device) -> torch.Tensor:
    """The E2M1 value of each code 0..15 (bit 3: sign), made once per device: no host-to-device copy
    happens inside a forward (a CUDA graph capture refuses one)."""
    return torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), device=device)


@dataclass(frozen=True)
class NVFP4Tensor:
    """codes: uint8 E2M1 codes 0..15, the input's shape, unpacked. scales: float8_e4m3fn, [*lead, ceil(K/16)].
    encode_scale: FP32 s_enc = 2688 / amax, shape [] (per tensor) or [*lead, 1] (per token)."""
    codes: torch.Tensor
    scales: torch.Tensor
    encode_scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32, outer: bool = True) -> torch.Tensor:
        """(E2M1[code] * s_blk) / s_enc in FP32, then one rounding to dtype; outer=False leaves out
        the division by s_enc: code * s_blk, exact in BF16, the emulated GEMM's operand."""
        values = _e2m1_values(self.codes.device)
        k = self.codes.shape[-1]
        scales = self.scales.float().reshape(-1, self.scales.shape[-1])
        blocks = values[self.codes.long()].reshape(-1, k) * _expand(scales, (1, NVFP4_BLOCK), (scales.shape[0], k))
        blocks = blocks.reshape(self.codes.shape)
        return (blocks / self.encode_scale if outer else blocks).to(dtype)


def quantize(x: torch.Tensor, q: QuantSpec) -> FP8Tensor | NVFP4Tensor:
    return quantize_fp8(x, q) if q.format == "fp8_e4m3" else quantize_nvfp4(x, q)


def quantize_fp8(x: torch.Tensor, q: QuantSpec = FP8_ACT) -> FP8Tensor:
    """x [..., K] (2-D blocks: a weight [N, K]) -> FP8Tensor, by the block-FP8 rule above."""
    if q.format != "fp8_e4m3":
        raise ValueError(f"quantize_fp8 got a {q.format!r} QuantSpec: use quantize(x, q)")
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    block = {"per_block": q.block, "per_token": (1, max(k, 1)), "per_tensor": (max(x2.shape[0], 1), max(k, 1))}
    block = block[q.scale_domain]
    if block[0] > 1 and x.dim() != 2 and q.scale_domain == "per_block":
        raise ValueError(f"quantize_fp8: {block} blocks need a 2-D weight [N, K], got shape {tuple(x.shape)}")
    amax, finite = _block_amax(x2, block)
    amax = torch.maximum(amax, torch.full_like(amax, q.amax_floor))
    if q.amax_ceil is not None:
        amax = torch.minimum(amax, torch.full_like(amax, q.amax_ceil))
    scale = amax / torch.full_like(amax, E4M3_MAX)
    if q.scale_dtype == "ue8m0":
        scale = _pow2_ceil(scale)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    if q.scale_apply == "divide":
        y = x2 / _expand(scale, block, x2.shape)
    else:
        y = x2 * _expand(torch.reciprocal(scale), block, x2.shape)
    y = torch.where(_expand(finite, block, x2.shape), y, torch.zeros_like(y))
    scales = scale.reshape(*x.shape[:-1], scale.shape[1]) if block[0] == 1 else scale
    return FP8Tensor(e4m3(y).reshape(x.shape), scales, block, q)


def quantize_nvfp4(x: torch.Tensor, q: QuantSpec = NVFP4_WEIGHT) -> NVFP4Tensor:
    """x [..., K] -> NVFP4Tensor, by TE's rule above, with an outer scale per tensor or per row."""
    if q.format != "nvfp4":
        raise ValueError(f"quantize_nvfp4 got a {q.format!r} QuantSpec: use quantize(x, q)")
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    block = (1, NVFP4_BLOCK)
    vec_max, vec_finite = _block_amax(x2, block)
    if q.outer_scale == "per_token":
        amax, finite = vec_max.amax(1, keepdim=True), vec_finite.all(1, keepdim=True)
    else:
        amax, finite = vec_max.amax().reshape(1, 1), vec_finite.all().reshape(1, 1)
    s_enc = (torch.full_like(amax, E4M3_MAX * E2M1_MAX) / amax).clamp(max=FLT_MAX)
    s_dec = torch.reciprocal(s_enc)
    s_blk = e4m3(vec_max * (s_enc * torch.full_like(s_enc, 1 / 6)))
    e = torch.reciprocal(s_blk.float() * s_dec).clamp(max=FLT_MAX)
    codes = e2m1_rne((x2 * _expand(e, block, x2.shape)).clamp(-E2M1_MAX, E2M1_MAX))

    nan = float("nan")
    codes = torch.where(finite, codes, torch.zeros_like(codes)).reshape(x.shape)
    s_blk = torch.where(finite, s_blk.float(), nan).to(torch.float8_e4m3fn).reshape(*x.shape[:-1], vec_max.shape[1])
    s_enc = torch.where(finite, s_enc, nan)
    s_enc = s_enc.reshape(*x.shape[:-1], 1) if q.outer_scale == "per_token" else s_enc.reshape(())
    return NVFP4Tensor(codes, s_blk, s_enc)


def e4m3(y: torch.Tensor) -> torch.Tensor:
    """FP32 -> float8_e4m3fn, round to nearest even, saturating: clamp to +-448, then torch's RNE cast."""
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_rne(y: torch.Tensor) -> torch.Tensor:
    """y in [-6, 6] -> uint8 E2M1 code, round to nearest even; bit 3 is y's sign bit (so -0 -> 8)."""
    mag = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for i, mid in enumerate(E2M1_MIDPOINTS):
        code += (mag >= mid) if i % 2 else (mag > mid)
    return code + 8 * torch.signbit(y).to(torch.uint8)


def _block_amax(x2: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [R, K] -> (max|x|, all finite) per block, [ceil(R/rows), ceil(K/cols)]; edge blocks are ragged."""
    (r, k), (br, bc) = x2.shape, block
    nr, nc = -(-r // br), -(-k // bc)
    # zero padding: |0| never raises a block's max, and 0 is finite
    blocks = F.pad(x2, (0, nc * bc - k, 0, nr * br - r)).reshape(nr, br, nc, bc)
    return blocks.abs().amax(dim=(1, 3)), torch.isfinite(blocks).all(3).all(1)


def _expand(per_block: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """[ceil(R/rows), ceil(K/cols)] -> [R, K]: each block's value over its elements."""
    return per_block.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


def _pow2_ceil(scale: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 s) for normal FP32 s, from the bits (DeepGEMM's ceil_to_ue8m0): no log2 rounding."""
    bits = scale.view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp.clamp(1, 254) << 23).view(torch.float32)
