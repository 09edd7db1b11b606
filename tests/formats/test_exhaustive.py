"""Exhaustive checks of the element-level rules: every E2M1 code, E8M0 byte, E4M3 byte and RNE tie.

Oracles here are independent of the package's numerics: Python floats, float64 nearest-value
searches, and torch's own float8 casts.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import e4m3_byte_values

import moe_fp4
import moe_fp4.formats.reference
from moe_fp4.kernels.numerics import encode_e2m1, encode_e4m3

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _mx(codes_2d, scale_bytes_2d):
    """Build an MXFP4Tensor from unpacked codes [M, K] and scale bytes [M, K/32]."""
    codes = torch.as_tensor(codes_2d, dtype=torch.uint8)
    data = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = torch.as_tensor(scale_bytes_2d, dtype=torch.uint8)
    return moe_fp4.MXFP4Tensor(data.contiguous(), scale.contiguous(), torch.Size(codes.shape), torch.float32)


def _codes(q: moe_fp4.MXFP4Tensor) -> torch.Tensor:
    return torch.stack([q.data & 0xF, q.data >> 4], dim=-1).flatten(-2)


@pytest.mark.parametrize("position", ["low", "high"])
def test_every_e2m1_code_decodes_in_both_nibbles(position):
    codes = torch.zeros(16, 32, dtype=torch.uint8)
    col = 4 if position == "low" else 5  # element 2i is the low nibble, 2i+1 the high one
    codes[:, col] = torch.arange(16, dtype=torch.uint8)
    out = moe_fp4.dequantize_mxfp4(_mx(codes, torch.full((16, 1), 127)), torch.float32)
    expected = torch.zeros(16, 32)
    expected[:, col] = torch.tensor(E2M1_VALUES)
    assert torch.equal(out, expected)
    assert torch.equal(torch.signbit(out[:, col]), torch.tensor(E2M1_VALUES).signbit())
    byte = _mx(codes, torch.full((16, 1), 127)).data[:, 2]
    expected_byte = torch.arange(16, dtype=torch.uint8) << (0 if position == "low" else 4)
    assert torch.equal(byte, expected_byte)


def test_every_e2m1_code_round_trips_through_quantize():
    # A block holding 6 has E = 0, so every grid value is represented exactly by its own code.
    x = torch.zeros(16, 32)
    x[:, 0] = 6.0
    x[:, 1] = torch.tensor(E2M1_VALUES)
    x[:, 2] = torch.tensor(E2M1_VALUES).flip(0)
    q = moe_fp4.quantize_mxfp4(x)
    assert torch.equal(q.scale, torch.full((16, 1), 127, dtype=torch.uint8))
    assert torch.equal(_codes(q)[:, 1], torch.arange(16, dtype=torch.uint8))
    assert torch.equal(_codes(q)[:, 2], torch.arange(16, dtype=torch.uint8).flip(0))
    assert torch.equal(moe_fp4.dequantize_mxfp4(q, torch.float32), x)


def test_every_e8m0_byte_decodes():
    codes = torch.zeros(256, 32, dtype=torch.uint8)
    codes[:, 0] = 2   # 1.0
    codes[:, 1] = 15  # -6.0
    scale = torch.arange(256, dtype=torch.uint8)[:, None]
    out = moe_fp4.dequantize_mxfp4(_mx(codes, scale), torch.float32)
    for b in range(256):
        if b == 255:
            assert torch.isnan(out[b]).all(), "byte 0xFF is the NaN block: every element decodes to NaN"
            continue
        assert out[b, 0].item() == math.ldexp(1.0, b - 127), b  # byte 0 gives the subnormal 2^-127
        big = -6.0 * math.ldexp(1.0, b - 127)
        # bytes 253 and 254 times 6 exceed float32's range: the decode saturates to -float32's largest
        # finite value (docs/formats.md), never -Inf.
        fmax = torch.finfo(torch.float32).max
        assert out[b, 1].item() == (big if abs(big) < 2.0**128 else -fmax), b
        assert (out[b, 2:] == 0).all()


def test_every_reachable_e8m0_byte_is_chosen_by_rceil():
    """For E in [-127, 126]: amax = 6 * 2^E gives exactly E (no bump), and the next float32 above it
    gives E + 1 (RCEIL: never clip). E = 127 needs amax > 6 * 2^126, beyond float32."""
    for e in range(-127, 127):
        top = 6.0 * math.ldexp(1.0, e)
        if top >= 2.0**128:  # e = 126: 6 * 2^126 is not a float32; use 1.75 * 2^127 (also gives 126)
            top = 1.75 * 2.0**127
        x = torch.zeros(2, 32)
        x[0, 3] = top
        x[1, 3] = torch.nextafter(torch.tensor(top), torch.tensor(math.inf)).item()
        q = moe_fp4.quantize_mxfp4(x)
        expected_e = pow2_exp_of_rceil(top)
        assert q.scale[0, 0].item() == expected_e + 127, e
        if math.isfinite(x[1, 3].item()) and expected_e < 126:
            assert q.scale[1, 0].item() == pow2_exp_of_rceil(x[1, 3].item()) + 127, e
        # RCEIL never clips: the block maximum divided by the scale is at most 6 (float64 check)
        for row in range(2):
            if math.isfinite(x[row, 3].item()):
                assert x[row, 3].item() <= 6.0 * math.ldexp(1.0, q.scale[row, 0].item() - 127), e


def pow2_exp_of_rceil(amax: float) -> int:
    """clamp(smallest E with amax <= 6 * 2^E, -127, 127), with float64 comparisons."""
    e = math.ceil(math.log2(amax / 6.0))
    while amax <= 6.0 * 2.0 ** (e - 1):
        e -= 1
    while amax > 6.0 * 2.0**e:
        e += 1
    return max(-127, min(127, e))


# Each RNE tie of E2M1, written out: (value, expected magnitude, why).
E2M1_TIES = [
    (0.25, 0.0, "halfway 0 | 0.5: 0 has mantissa bit 0"),
    (0.75, 1.0, "halfway 0.5 | 1: 1.0 is even"),
    (1.25, 1.0, "halfway 1 | 1.5: 1.0 is even"),
    (1.75, 2.0, "halfway 1.5 | 2: 2.0 is even"),
    (2.5, 2.0, "halfway 2 | 3: 2.0 is even"),
    (3.5, 4.0, "halfway 3 | 4: 4.0 is even"),
    (5.0, 4.0, "halfway 4 | 6: 4.0 is even"),
]


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("value,expected,why", E2M1_TIES)
def test_e2m1_ties_round_to_even(value, expected, why, sign):
    for source in ("bf16", "fp8"):
        x = torch.zeros(1, 128)
        x[0, 0] = 6.0  # pins the block scale to 2^0
        x[0, 1] = sign * value
        if source == "fp8":  # every tie point is an E4M3 value, so the FP8 tensor holds it exactly
            fp8 = moe_fp4.quantize_fp8(x)
            assert moe_fp4.dequantize_fp8(fp8, torch.float32)[0, 1].item() == sign * value
            q = moe_fp4.quantize_mxfp4(fp8)
        else:
            q = moe_fp4.quantize_mxfp4(x.to(torch.bfloat16))
        got = moe_fp4.dequantize_mxfp4(q, torch.float32)[0, 1]
        assert got.item() == sign * expected, f"{source}: {why}"
        assert got.signbit().item() == (sign < 0), "the sign survives, also when rounding to zero"


def _nearest_even_oracle(values: torch.Tensor, grid: list[float], even: list[bool]) -> torch.Tensor:
    """Round |values| to the nearest of `grid` (ascending, >= 0), ties to the entry marked even;
    saturate above the top. Returns the grid value, float64."""
    g = torch.tensor(grid, dtype=torch.float64)
    a = values.double().abs()
    hi = torch.searchsorted(g, a).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - g[lo], g[hi] - a
    ev = torch.tensor(even)
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & ev[hi] & ~ev[lo])
    out = torch.where(pick_hi, g[hi], g[lo])
    return torch.where(a >= g[-1], g[-1], out)


def test_encode_e2m1_matches_nearest_even_on_a_fine_grid():
    # Every multiple of 2^-12 in [0, 8], both signs: covers each tie and its neighbours.
    v = torch.arange(0, 8 * 4096 + 1, dtype=torch.float32) / 4096
    v = torch.cat([v, -v])
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    expected = _nearest_even_oracle(v, grid, [True, False, True, False, True, False, True, False])
    got = torch.tensor(E2M1_VALUES, dtype=torch.float64)[encode_e2m1(v).long()]
    assert torch.equal(got.abs(), expected)
    assert torch.equal(got.signbit(), v.signbit())


def test_encode_e4m3_matches_nearest_even_into_subnormals():
    # All 127 non-negative finite E4M3 magnitudes, their midpoints, and the values around them.
    mags = e4m3_byte_values()[:127].double()  # bytes 0x00..0x7E
    mids = (mags[:-1] + mags[1:]) / 2
    v = torch.cat([mags, mids, torch.nextafter(mids.float(), torch.tensor(0.0)).double(),
                   torch.nextafter(mids.float(), torch.tensor(1e9)).double()]).float()
    v = torch.cat([v, -v])
    even = [(b & 1) == 0 for b in range(127)]
    expected = _nearest_even_oracle(v, mags.tolist(), even)
    got = encode_e4m3(v).float().double()
    assert torch.equal(got.abs(), expected)
    assert torch.equal(got.signbit(), v.signbit())
    assert encode_e4m3(torch.tensor([1000.0, -1e30])).float().tolist() == [448.0, -448.0], "saturates"
    nan_bytes = encode_e4m3(torch.tensor([math.nan, math.inf, -math.inf])).view(torch.uint8)
    assert nan_bytes.tolist() == [0x7F] * 3, "NaN and Inf become the canonical NaN byte"


# 119 is the largest S for which 448 * 2^S is still a float32, so the FP32 oracle is defined.
@pytest.mark.parametrize("s", [-126, -9, 0, 5, 119])
def test_every_e4m3_byte_through_direct_fp8_to_mxfp4(s):
    """All 256 E4M3 bytes (NaN, +-0, subnormals, 448): alone in a zero block (so the byte sets the
    block scale) and mixed into random blocks; direct path == quantize(dequantize(., fp32))."""
    g = torch.Generator().manual_seed(s + 1000)
    alone = torch.zeros(256, 128, dtype=torch.uint8)
    alone[:, 7] = torch.arange(256, dtype=torch.uint8)
    mixed = torch.randint(0, 256, (256, 128), generator=g, dtype=torch.uint8)
    mixed[mixed == 0x7F] = 0x70  # keep NaN to the controlled rows
    mixed[mixed == 0xFF] = 0xF0
    mixed[:, 40] = torch.arange(256, dtype=torch.uint8)
    data = torch.cat([alone, mixed]).view(torch.float8_e4m3fn)
    scale = torch.full((1, 512), 2.0**s).t()  # [512, 1], M-major
    fp8 = moe_fp4.FP8BlockTensor(data, scale, torch.Size((512, 128)), torch.float32)
    direct = moe_fp4.quantize_mxfp4(fp8)
    # The other side in pure torch (the twins): on CPU only the direct path runs in the interpreter.
    via_fp32 = moe_fp4.formats.reference.quantize_mxfp4(moe_fp4.formats.reference.dequantize_fp8(fp8, torch.float32))
    assert torch.equal(direct.data, via_fp32.data)
    assert torch.equal(direct.scale, via_fp32.scale)
    nan_rows = torch.tensor([0x7F, 0xFF])
    assert (direct.scale[nan_rows, 0] == 0xFF).all() and (direct.scale[256 + nan_rows, 1] == 0xFF).all()
    # -0 (0x80) keeps its sign bit, +0 stays code 0
    assert (_codes(direct)[0x80, 7].item(), _codes(direct)[0x00, 7].item()) == (8, 0)
