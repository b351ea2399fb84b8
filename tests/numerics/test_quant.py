"""The quantisers of onepath/numerics/quant.py against a float64 reference of the stated rules, code for code.

The reference is written apart from quant.py (none of its helpers): a python loop over blocks, E4M3
and E2M1 rounding from frexp / nearest-grid-point in float64, codes built from the values' bits by
hand. Each FP32 step of a rule is done exactly in float64 and then rounded to FP32 (`f32`): for
+ - * / of FP32 operands that double rounding is innocuous (53 >= 2 * 24 + 2), so it is the FP32 op.
Inputs: random tensors of awkward shapes with block scales spread over 2^-30..2^30, and adversarial
ones: exact ties (RNE), zeros and -0, all-zero blocks, FP32 and BF16 subnormals, values above
448/464 and near FLT_MAX, +-inf, NaN, ragged K.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import replace

import pytest
import torch

from onepath.numerics.quant import FP8Tensor, quantize, quantize_fp8, quantize_nvfp4
from onepath.numerics.spec import FP8_ACT, FP8_KV, FP8_WEIGHT, NVFP4_ACT, NVFP4_WEIGHT

FLT_MAX = 3.4028234663852886e38
FP8_RULES = {"fp32_mul": FP8_ACT, "ue8m0_mul": replace(FP8_ACT, scale_dtype="ue8m0"),
             "fp32_div": replace(FP8_ACT, scale_apply="divide"),
             "ue8m0_div": replace(FP8_ACT, scale_dtype="ue8m0", scale_apply="divide")}
NAN = float("nan")


# ---- float64 reference ---------------------------------------------------------------------------

def f32(t: torch.Tensor) -> torch.Tensor:
    """Round float64 to the nearest FP32 value (ties to even, overflow to inf), kept in float64."""
    return t.float().double()


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value to v (|v| <= 448), ties to even, sign kept: 3 mantissa bits, the binade
    floor(log2|v|) clamped at -6 (below 2^-6 the subnormal step 2^-9)."""
    _, e = torch.frexp(v.abs())  # |v| = m * 2^e, m in [0.5, 1)
    step = torch.exp2((torch.clamp(e - 1, min=-6) - 3).double())
    return torch.copysign(torch.round(v.abs() / step) * step, v)  # torch.round: half to even


def e4m3_bits(v: torch.Tensor) -> torch.Tensor:
    """E4M3 values (float64, exact) -> their uint8 codes: sign | exponent (bias 7) | 3 mantissa bits;
    NaN -> 0x7F."""
    mag = v.abs().nan_to_num(0.0)
    _, e = torch.frexp(mag)
    normal = mag >= 2.0 ** -6
    exponent = torch.where(normal, e - 1 + 7, torch.zeros_like(e))
    mantissa = torch.where(normal, mag / torch.exp2((e - 1).double()) * 8 - 8, mag / 2.0 ** -9)
    assert torch.equal(mantissa, mantissa.round()) and bool((exponent <= 15).all())
    bits = exponent * 8 + mantissa.long() + 128 * torch.signbit(v).long()
    return torch.where(v.isnan(), 0x7F, bits).to(torch.uint8)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """y (|y| <= 6) -> E2M1 code: the nearest grid point's index, on a tie the even index; + 8 if negative."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    dist = (y.abs()[..., None] - grid).abs()
    nearest = dist == dist.min(-1, keepdim=True).values
    even = nearest & (torch.arange(8) % 2 == 0)
    index = torch.where(nearest.sum(-1) > 1, even.long().argmax(-1), nearest.long().argmax(-1))
    return (index + 8 * torch.signbit(y).long()).to(torch.uint8)


def reference_fp8(x: torch.Tensor, block: tuple[int, int], ue8m0=False, divide=False, floor=1e-4, ceil=None):
    """x [R, K] -> (codes uint8 [R, K], scales float64 [ceil(R/rows), ceil(K/cols)])."""
    x = x.double()
    (r, k), (br, bc) = x.shape, block
    codes = torch.zeros(r, k, dtype=torch.uint8)
    scales = torch.zeros(-(-r // br), -(-k // bc), dtype=torch.float64)
    for i in range(0, r, br):
        for j in range(0, k, bc):
            xb = x[i:i + br, j:j + bc]
            if not torch.isfinite(xb).all():
                scales[i // br, j // bc] = NAN  # codes stay 0
                continue
            amax = max(xb.abs().max(), f32(torch.tensor(floor, dtype=torch.float64)))
            if ceil is not None:
                amax = min(amax, f32(torch.tensor(ceil, dtype=torch.float64)))
            scale = f32(amax / 448)
            if ue8m0:
                mant, e = torch.frexp(scale)
                scale = torch.exp2((e - 1 if mant == 0.5 else e).double())
            y = f32(xb / scale) if divide else f32(xb * f32(1 / scale))
            codes[i:i + br, j:j + bc] = e4m3_bits(round_e4m3(y.clamp(-448, 448)))
            scales[i // br, j // bc] = scale
    return codes, scales


def reference_nvfp4(x: torch.Tensor, per_token: bool):
    """x [R, K] -> (codes uint8 [R, K], block scales uint8 E4M3 codes [R, ceil(K/16)], s_enc float64 [R or 1])."""
    x = x.double()
    r, k = x.shape
    nb = -(-k // 16)
    codes = torch.zeros(r, k, dtype=torch.uint8)
    scale_bits = torch.zeros(r, nb, dtype=torch.uint8)
    s_encs = []
    for rows in ([slice(i, i + 1) for i in range(r)] if per_token else [slice(0, r)]):
        dom = x[rows]
        if not torch.isfinite(dom).all():
            scale_bits[rows] = 0x7F
            s_encs.append(NAN)
            continue
        s_enc = torch.clamp(f32(2688 / dom.abs().max()), max=FLT_MAX)  # 2688 / 0 = inf -> FLT_MAX
        s_dec = f32(1 / s_enc)
        mult = f32(s_enc * f32(torch.tensor(1 / 6, dtype=torch.float64)))
        for j in range(0, k, 16):
            xb = dom[:, j:j + 16]
            s_blk = round_e4m3(torch.clamp(f32(xb.abs().amax(1, keepdim=True) * mult), max=448))
            e = torch.clamp(f32(1 / f32(s_blk * s_dec)), max=FLT_MAX)  # 1 / 0 = inf -> FLT_MAX
            codes[rows, j:j + 16] = e2m1_codes(f32(xb * e).clamp(-6, 6))
            scale_bits[rows, j // 16] = e4m3_bits(s_blk)[:, 0]
        s_encs.append(float(s_enc))
    return codes, scale_bits, torch.tensor(s_encs, dtype=torch.float64)


# ---- comparisons --------------------------------------------------------------------------------

def assert_fp8_matches(x: torch.Tensor, q, block=None):
    got = quantize_fp8(x, q)
    block = block or q.block
    x2 = x.reshape(-1, x.shape[-1])
    codes, scales = reference_fp8(x2, block, ue8m0=q.scale_dtype == "ue8m0", divide=q.scale_apply == "divide",
                                  floor=q.amax_floor, ceil=q.amax_ceil)
    assert got.codes.shape == x.shape and got.codes.dtype == torch.float8_e4m3fn
    mismatch = got.codes.reshape(x2.shape).view(torch.uint8) != codes
    assert not mismatch.any(), (f"{int(mismatch.sum())} codes differ, first at {mismatch.nonzero()[0].tolist()}: "
                                f"x={x2[mismatch][0].item()!r}")
    assert torch.equal(got.scales.reshape(scales.shape).view(torch.int32), scales.float().view(torch.int32))
    # dequantize: code value * scale, one FP32 rounding
    values = got.codes.float().double().reshape(x2.shape)
    rows, cols = block
    want = f32(values * scales.repeat_interleave(rows, 0)[:x2.shape[0]].repeat_interleave(cols, 1)[:, :x2.shape[1]])
    assert torch.equal(got.dequantize().reshape(x2.shape).view(torch.int32), want.float().view(torch.int32))
    return got


def assert_nvfp4_matches(x: torch.Tensor, q):
    per_token = q.outer_scale == "per_token"
    got = quantize_nvfp4(x, q)
    x2 = x.reshape(-1, x.shape[-1])
    codes, scale_bits, s_enc = reference_nvfp4(x2, per_token)
    assert got.codes.shape == x.shape and got.codes.dtype == torch.uint8
    mismatch = got.codes.reshape(x2.shape) != codes
    assert not mismatch.any(), (f"{int(mismatch.sum())} codes differ, first at {mismatch.nonzero()[0].tolist()}: "
                                f"x={x2[mismatch][0].item()!r}")
    assert torch.equal(got.scales.reshape(scale_bits.shape).view(torch.uint8), scale_bits)
    assert got.encode_scale.shape == ((*x.shape[:-1], 1) if per_token else ())
    assert torch.equal(got.encode_scale.reshape(-1).view(torch.int32), s_enc.float().view(torch.int32))
    # dequantize: (E2M1[code] * s_blk) / s_enc in FP32; code * s_blk alone is exact in BF16
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    values = torch.copysign(grid[(codes & 7).long()], -(codes >> 3).double() + 0.5)
    s_blk = got.scales.float().double().reshape(scale_bits.shape).repeat_interleave(16, 1)[:, :x2.shape[1]]
    operand = values * s_blk
    want = f32(operand / s_enc.reshape(-1, 1))
    assert torch.equal(got.dequantize().reshape(x2.shape).view(torch.int32), want.float().view(torch.int32))
    exact = got.dequantize(torch.bfloat16, outer=False).reshape(x2.shape)
    torch.testing.assert_close(exact.double(), operand, rtol=0, atol=0, equal_nan=True)
    return got


def seed(*key) -> int:
    return zlib.crc32(repr(key).encode())  # not hash(): the same in every process


def spread(*shape, gen, dtype=torch.float32, block=16, lo=-30, hi=30):
    """randn with one power-of-two magnitude per block of `block` along the last dim: scales far apart."""
    k = shape[-1]
    mag = torch.randint(lo, hi, (*shape[:-1], -(-k // block)), generator=gen).repeat_interleave(block, -1)[..., :k]
    return (torch.randn(*shape, generator=gen) * torch.exp2(mag.float())).to(dtype)


# ---- block FP8 --------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", FP8_RULES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 129), (17, 300), (2, 5, 257), (4, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_activations_match_reference_on_random_inputs(rule, shape, dtype):
    gen = torch.Generator().manual_seed(seed(rule, shape))
    assert_fp8_matches(spread(*shape, gen=gen, dtype=dtype, block=128), FP8_RULES[rule])


@pytest.mark.parametrize("rule", ["fp32_mul", "ue8m0_div"])
@pytest.mark.parametrize("shape", [(130, 300), (1, 129), (257, 64), (128, 128)])
def test_fp8_weights_in_128x128_blocks_match_reference(rule, shape):
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = spread(*shape, gen=gen, dtype=torch.bfloat16, block=64, lo=-12, hi=12)
    q = replace(FP8_RULES[rule], block=(128, 128))
    got = assert_fp8_matches(w, q)
    assert got.scales.shape == (-(-shape[0] // 128), -(-shape[1] // 128))


def test_fp8_kv_per_token_and_per_tensor_match_reference():
    gen = torch.Generator().manual_seed(5)
    kv = spread(9, 3, 40, gen=gen, block=40)  # [tokens, heads, head_dim]: one scale per (token, head)
    got = assert_fp8_matches(kv, FP8_KV, block=(1, 40))
    assert got.scales.shape == (9, 3, 1) and got.rule == FP8_KV
    per_tensor = replace(FP8_KV, scale_domain="per_tensor")
    assert assert_fp8_matches(kv, per_tensor, block=(27, 40)).scales.shape == (1, 1)
    # FP32 scales and no ceiling, the rule FP8_KV had before: the same reference, other codes
    fp32 = assert_fp8_matches(kv, replace(FP8_KV, scale_dtype="fp32", amax_ceil=None), block=(1, 40))
    assert not torch.equal(fp32.codes.view(torch.uint8), got.codes.view(torch.uint8))


def test_fp8_kv_scales_are_powers_of_two_up_to_the_ceiling():
    """FP8_KV: every scale is a power of two in 2^-22..2^7 (the floor's 1e-4 / 448 rounded up, the ceiling's
    448 * 2^7 / 448), the amax ceiling binds above 57344 and those values saturate to +-448 * 2^7, while a
    rule without the ceiling (the control) takes them with a larger scale."""
    from onepath.numerics.spec import KV_AMAX_CEIL
    assert KV_AMAX_CEIL == 448 * 2 ** 7
    rows = torch.zeros(6, 128)
    rows[1, :3] = torch.tensor([1e-30, -3e-6, 5e-5])           # below the floor
    rows[2] = torch.randn(128) * 3
    rows[3, :4] = torch.tensor([57344.0, -1e5, 3e9, 1.0])      # above the ceiling: saturate
    rows[4, :2] = torch.tensor([57343.0, 0.5])                  # just under it
    rows[5] = torch.randn(128) * 1e-3
    got = assert_fp8_matches(rows, FP8_KV, block=(1, 128))
    scales = got.scales.flatten()
    mant, exp = torch.frexp(scales)
    assert bool((mant == 0.5).all()), scales                    # powers of two
    assert scales.min() == 2.0 ** -22 and scales.max() == 2.0 ** 7, scales
    assert got.dequantize()[3, :3].tolist() == [57344.0, -57344.0, 57344.0]
    free = assert_fp8_matches(rows, replace(FP8_KV, amax_ceil=None), block=(1, 128))
    assert free.scales[3, 0] == 2.0 ** 23 and free.dequantize()[3, 2] != 57344.0


def _fp8_ties_row() -> torch.Tensor:
    """amax 448 makes the scale exactly 1, so y = x: exact midpoints between E4M3 neighbours."""
    ties = [448.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, 5 * 2.0 ** -10, -3 * 2.0 ** -10,
            248.0, 432.0, 17.0, 0.0, -0.0, 2.0 ** -12, -(2.0 ** -12)]
    return torch.tensor(ties + [0.0] * (128 - len(ties)))


def test_fp8_rounds_ties_to_even():
    x = _fp8_ties_row()[None]
    got = assert_fp8_matches(x, FP8_ACT)
    assert got.scales.item() == 1.0
    want = [448.0, 1.0, 1.25, -1.0, 0.0, 2.0 ** -8, 2.0 ** -8, -(2.0 ** -8), 256.0, 448.0, 16.0, 0.0, -0.0, 0.0, -0.0]
    assert got.codes.float()[0, :len(want)].tolist() == want
    assert got.codes.view(torch.uint8)[0, 12].item() == 0x80 and got.codes.view(torch.uint8)[0, 14].item() == 0x80


def test_fp8_multiply_by_reciprocal_and_divide_give_different_codes():
    """Negative control for the op order: x one ulp above 1.0625 * s, a midpoint once scaled back,
    where x * (1/s) and x / s round to different codes; quant.py and the reference agree under each rule."""
    gen = torch.Generator().manual_seed(0)
    amax = (1 + torch.rand(4096, generator=gen)).float()  # awkward amax in [1, 2): s = amax / 448
    s = amax / torch.full_like(amax, 448.0)
    x = torch.nextafter(torch.full_like(s, 1.0625) * s, torch.full_like(s, 2.0))
    differ = (x * torch.reciprocal(s)).to(torch.float8_e4m3fn).float() != (x / s).to(torch.float8_e4m3fn).float()
    i = int(differ.nonzero()[0])
    row = torch.zeros(1, 128)
    row[0, 0], row[0, 1] = amax[i], x[i]
    by_mul = assert_fp8_matches(row, FP8_RULES["fp32_mul"])
    by_div = assert_fp8_matches(row, FP8_RULES["fp32_div"])
    assert by_mul.codes.view(torch.uint8)[0, 1] != by_div.codes.view(torch.uint8)[0, 1]


def test_fp8_zeros_subnormals_and_large_values():
    f32_sub = [1e-40, -3e-42, 2.0 ** -149, -(2.0 ** -149)]
    bf16_sub = torch.tensor([1e-39, -5e-40, 9.2e-41]).bfloat16().float().tolist()
    assert all(0 < abs(v) < torch.finfo(torch.float32).tiny for v in f32_sub + bf16_sub)
    rows = torch.zeros(8, 300)
    rows[0] = 0.0                                              # all-zero row: floor scale, codes 0
    rows[1] = -0.0                                             # all -0: codes 0x80
    rows[2, :len(f32_sub)] = torch.tensor(f32_sub)              # a group of subnormals only: floor scale
    rows[3, :3] = torch.tensor(bf16_sub)
    rows[3, 3] = 1.0                                           # subnormals beside a normal value
    rows[4, :5] = torch.tensor([449.0, 464.0, 465.0, 1e4, -480.0])  # above the max: the scale takes them
    rows[5, :3] = torch.tensor([FLT_MAX, -FLT_MAX, 1.0])
    rows[5, 128:131] = torch.tensor([3e-5, -9e-5, 1e-5])       # below the 1e-4 floor
    rows[6, 256:] = torch.randn(44)                            # ragged tail group of 44
    rows[7] = torch.randn(300) * 1e3
    for rule in FP8_RULES.values():
        got = assert_fp8_matches(rows, rule)
        assert torch.isfinite(got.scales).all() and (got.scales > 0).all()
        assert torch.equal(got.dequantize()[:2], torch.zeros(2, 300))
        assert (got.codes.view(torch.uint8)[1] == 0x80).all()
    zero_scale = quantize_fp8(rows).scales[0, 0]
    assert zero_scale == torch.tensor(1e-4) / torch.tensor(448.0)  # the floor: finite, normal


def test_fp8_nonfinite_poisons_its_group_only():
    x = torch.randn(4, 300)
    x[0, 3], x[1, 200], x[2, 299], x[3, 0] = math.inf, -math.inf, NAN, NAN
    x[3, 1] = math.inf
    for name, rule in FP8_RULES.items():
        got = assert_fp8_matches(x, rule)
        bad = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]], dtype=torch.bool)
        assert torch.equal(got.scales.isnan(), bad), name
        assert (got.codes.view(torch.uint8).reshape(4, 300)[bad.repeat_interleave(128, 1)[:, :300]] == 0).all()
        deq = got.dequantize()
        assert deq[bad.repeat_interleave(128, 1)[:, :300]].isnan().all()
        assert torch.isfinite(deq[~bad.repeat_interleave(128, 1)[:, :300]]).all()


def test_fp8_ragged_tail_equals_zero_padding():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 300, generator=gen)
    padded = torch.nn.functional.pad(x, (0, 84))
    a, b = quantize_fp8(x), quantize_fp8(padded)
    assert torch.equal(a.scales, b.scales)
    assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8)[:, :300])
    w = torch.randn(130, 300, generator=gen)
    a, b = quantize_fp8(w, FP8_WEIGHT), quantize_fp8(torch.nn.functional.pad(w, (0, 84, 0, 126)), FP8_WEIGHT)
    assert torch.equal(a.scales, b.scales)


def test_fp8_cast_saturates_instead_of_nan():
    """The clamp before the cast: what the rule casts is always in range, whatever torch's cast does."""
    from onepath.numerics.quant import e4m3
    y = torch.tensor([448.0, 449.0, 464.0, 465.0, 480.0, 1e4, FLT_MAX, -465.0, -1e30])
    assert e4m3(y).float().tolist() == [448.0] * 7 + [-448.0] * 2


def test_fp8_weight_blocks_need_a_matrix():
    with pytest.raises(ValueError, match=r"2-D weight \[N, K\]"):
        quantize_fp8(torch.randn(2, 130, 128), FP8_WEIGHT)
    with pytest.raises(ValueError, match="nvfp4"):
        quantize_fp8(torch.randn(2, 16), NVFP4_WEIGHT)


# ---- NVFP4 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("q", [NVFP4_WEIGHT, NVFP4_ACT], ids=["w4a16_per_tensor", "w4a4_per_token"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (9, 40), (2, 3, 48), (16, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_matches_reference_on_random_inputs(q, shape, dtype):
    gen = torch.Generator().manual_seed(seed(q.outer_scale, shape))
    # block magnitudes over 2^-24..2^8: some blocks are so small beside the max that s_blk rounds
    # to an E4M3 subnormal or to 0
    assert_nvfp4_matches(spread(*shape, gen=gen, dtype=dtype, block=16, lo=-24, hi=8), q)


def test_nvfp4_rounds_ties_to_even_code():
    """A block holding 2688 makes s_enc = 1; a block with max 6 then gets s_blk = 1, so y = x."""
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]
    x = torch.tensor([[2688.0] + [0.0] * 15 + ties])
    for q in (NVFP4_WEIGHT, NVFP4_ACT):
        got = assert_nvfp4_matches(x, q)
        assert got.encode_scale.reshape(-1).tolist() == [1.0] and got.scales.float()[0].tolist() == [448.0, 1.0]
        assert got.codes[0, 16:].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 8]


def test_nvfp4_block_scale_folds_one_sixth_into_the_multiplier():
    """TE's op order, s_blk = e4m3(vec_max * (s_enc * fl32(1/6))), against vec_max * s_enc / 6: for
    this (amax, block max) pair (found by search) the first lands above the E4M3 midpoint 1.0625 and
    rounds to 1.125, the second below it, to 1.0. Negative control: the order is pinned."""
    amax, block_max = 1132.030517578125, 2.6847822666168213
    x = torch.tensor([[amax] + [0.0] * 15 + [block_max] + [1.0] * 15])
    got = assert_nvfp4_matches(x, NVFP4_WEIGHT)
    assert got.scales.float()[0, 1].item() == 1.125
    s_enc = f32(2688 / torch.tensor(amax, dtype=torch.float64))
    assert round_e4m3(f32(f32(block_max * s_enc) / 6)).item() == 1.0


def test_nvfp4_zeros_subnormals_and_large_values():
    x = torch.zeros(6, 40)
    x[1] = -0.0                                                 # -0 keeps its sign: code 8
    x[2, :4] = torch.tensor([1e-40, -3e-42, 2.0 ** -149, 1e-45])  # a row of FP32 subnormals: s_enc = FLT_MAX
    x[3, :3] = torch.tensor([FLT_MAX, -1e38, 1.0])             # s_enc tiny; the 1.0 block's s_blk rounds to 0
    x[3, 16:19] = torch.tensor([1e-3, -2e-3, 3e-3])
    x[4] = torch.randn(40) * 1e3
    x[4, 32:] = 0.0                                             # an all-zero block (ragged: 8 elements)
    x[5, :3] = torch.tensor([449.0, 465.0, -1e4])
    x[5, 16:20] = torch.tensor([1e-39, -1e-39, 1e-3, 0.0])       # subnormals beside normals
    for q in (NVFP4_WEIGHT, NVFP4_ACT):
        got = assert_nvfp4_matches(x, q)
        assert (got.codes[0] == 0).all() and (got.codes[1] == 8).all()
        assert torch.equal(got.dequantize()[:2], torch.zeros(2, 40))
    per_row = quantize_nvfp4(x, NVFP4_ACT)
    assert per_row.encode_scale[0].item() == per_row.encode_scale[2].item() == FLT_MAX
    assert per_row.scales.float()[3, 1].item() == 0.0 and per_row.dequantize()[3, 16:19].eq(0).all()


def test_nvfp4_nonfinite_poisons_its_outer_domain():
    x = torch.randn(4, 40)
    x[1, 7], x[2, 39] = math.inf, NAN
    per_token = assert_nvfp4_matches(x, NVFP4_ACT)
    assert per_token.encode_scale.isnan().reshape(-1).tolist() == [False, True, True, False]
    assert per_token.dequantize()[1:3].isnan().all() and torch.isfinite(per_token.dequantize()[[0, 3]]).all()
    assert (per_token.codes[1:3] == 0).all()
    per_tensor = assert_nvfp4_matches(x, NVFP4_WEIGHT)
    assert per_tensor.encode_scale.isnan() and per_tensor.dequantize().isnan().all()


def test_nvfp4_ragged_tail_equals_zero_padding():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 40, generator=gen)
    a, b = quantize_nvfp4(x, NVFP4_ACT), quantize_nvfp4(torch.nn.functional.pad(x, (0, 8)), NVFP4_ACT)
    assert torch.equal(a.codes, b.codes[:, :40]) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert torch.equal(a.encode_scale, b.encode_scale)


def test_quantize_dispatches_on_format():
    x = torch.randn(2, 32)
    assert isinstance(quantize(x, FP8_ACT), FP8Tensor)
    assert torch.equal(quantize(x, NVFP4_ACT).codes, quantize_nvfp4(x, NVFP4_ACT).codes)
    with pytest.raises(ValueError, match="fp8_e4m3"):
        quantize_nvfp4(x, FP8_ACT)
