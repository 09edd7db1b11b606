"""Properties of the public conversions on fresh random inputs of many shapes and distributions."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    INPUT_KINDS,
    dequant_transpose_quantize,
    highest,
    in_band,
    lowest,
    make_input,
    pow2_ceil_exponent,
    same_bits,
    same_values,
    sqnr_db,
)

import moe_fp4
from moe_fp4.formats import reference as REF
from moe_fp4.kernels.fp8 import quantize_fp8_rowwise_ref

# Round-trip SQNR floors for N(0, 1) data, set 1.5 dB under what this suite's inputs measure
# (256 x 1024, bf16/fp16/fp32, three seeds): MXFP4 (E2M1, 32-blocks, RCEIL) 18.75-18.79 dB;
# FP8 E4M3 1x128 with power-of-two scales 31.48-31.54 dB. Ceilings 1 dB over: a quantizer that kept
# more precision than its format (or none) measures above them.
MXFP4_GAUSSIAN_SQNR_DB = 17.25
FP8_GAUSSIAN_SQNR_DB = 30.0
MXFP4_GAUSSIAN_SQNR_CEILING_DB = 19.8
FP8_GAUSSIAN_SQNR_CEILING_DB = 32.5

SHAPES_32 = [(1, 32), (3, 64), (17, 96), (2, 5, 128), (64, 256), (33, 384)]
SHAPES_128 = [(1, 128), (3, 256), (17, 384), (2, 3, 128), (130, 256)]
TOKEN_COUNTS = [1, 5, 127, 128, 129, 300]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", INPUT_KINDS)
@pytest.mark.parametrize("shape", SHAPES_128)
def test_direct_fp8_to_mxfp4_equals_quantizing_the_dequantized_values(shape, kind, dtype):
    # The FP8 input and the other side of the equation come from the pure-torch twins: on CPU only the
    # conversion under test runs in the interpreter (the twins' kernels are checked in test_kernels.py).
    x = make_input(shape, kind, dtype, seed=hash((shape, kind)) % 2**31)
    fp8 = REF.quantize_fp8(x)
    direct = moe_fp4.quantize_mxfp4(fp8)
    via_fp32 = REF.quantize_mxfp4(REF.dequantize_fp8(fp8, torch.float32))
    assert same_bits(direct.data, via_fp32.data)
    assert same_bits(direct.scale, via_fp32.scale)
    assert direct.shape == x.shape and direct.dtype == dtype


@pytest.mark.parametrize("kind", INPUT_KINDS)
@pytest.mark.parametrize("shape", SHAPES_128)
def test_mxfp4_to_fp8_is_exact_without_underflow(shape, kind):
    x = make_input(shape, kind, torch.float32, seed=7)
    q = REF.quantize_mxfp4(x)          # input and exact values from the twins: only mxfp4_to_fp8 interpreted
    f = moe_fp4.mxfp4_to_fp8(q)
    e = q.scale.int().view(q.m, -1, 4)
    # No underflow when every block sits within 14 binades of its tile's largest (DESIGN's bound).
    no_underflow = (e.amax(-1, keepdim=True) - e <= 14).all(-1)
    back = moe_fp4.dequantize_fp8(f, torch.float32).reshape(q.m, -1, 128)
    exact = REF.dequantize_mxfp4(q, torch.float32).reshape(q.m, -1, 128)
    assert same_values(back[no_underflow], exact[no_underflow])
    assert f.scale.t().is_contiguous(), "M-major scales, as scaled_mm takes them"
    assert bool(no_underflow.any()), "the input should exercise the exact path"


def test_mxfp4_to_fp8_underflow_rounds_to_nearest_even_and_keeps_zero_codes():
    codes = torch.zeros(1, 128, dtype=torch.uint8)
    codes[0, 0] = 7                  # 6 * 2^E0: sets the tile maximum
    codes[0, 32:39] = torch.arange(1, 8, dtype=torch.uint8)   # 0.5 .. 6 in a low block
    codes[0, 39] = 8 | 3             # -1.5
    codes[0, 40] = 8                 # -0 stays -0
    codes[0, 41] = 0                 # +0 stays +0
    for gap in range(0, 26):         # the low block sits `gap` binades below the top block
        scale = torch.tensor([[130, 130 - gap, 0, 0]], dtype=torch.uint8)
        data = codes[:, 0::2] | (codes[:, 1::2] << 4)
        q = moe_fp4.MXFP4Tensor(data, scale, torch.Size((1, 128)), torch.float32)
        f = moe_fp4.mxfp4_to_fp8(q)
        s = f.scale[0, 0].item()
        assert s == 2.0 ** (130 - 127 - 6)
        exact = moe_fp4.dequantize_mxfp4(q, torch.float32)
        # the oracle: torch's own RNE cast of the exact value divided by the scale
        expected = (exact / s).to(torch.float8_e4m3fn)
        assert same_bits(f.data, expected), gap
        if gap <= 14:
            assert same_values(moe_fp4.dequantize_fp8(f, torch.float32), exact), gap
        zeros = f.data.view(torch.uint8)[0, 40:42].tolist()
        assert zeros == [0x80, 0x00], "zero codes stay zero (a published kernel turns them into +-448)"


@pytest.mark.parametrize("kind", INPUT_KINDS)
@pytest.mark.parametrize("m", TOKEN_COUNTS)
@pytest.mark.parametrize("k", [32, 96, 256])
def test_colwise_equals_dequantize_transpose_quantize(m, k, kind):
    # The MXFP4 input from the pure-torch twin, the definition in pure torch (helpers): on CPU only the
    # column-wise conversion runs in the interpreter.
    x = make_input((m, k), kind, torch.bfloat16, seed=m * 1000 + k)
    q = REF.quantize_mxfp4(x)
    col = moe_fp4.mxfp4_to_fp8_colwise(q)
    data, scale = dequant_transpose_quantize(q)
    assert same_bits(col.data, data)
    assert torch.equal(col.scale, scale)
    assert col.shape == torch.Size((k, m)) and col.scale.shape == (k, -(-m // 128))
    assert col.scale.t().is_contiguous(), "M-major scales, as scaled_mm takes them"


def test_colwise_uses_the_true_column_amax_not_the_row_scales():
    # Token 0 has a huge value in column 0 only; column 1's largest value is small. Taking the max
    # of row scales would give column 1 the huge scale and flush its values; the true amax keeps them.
    x = torch.zeros(128, 32)
    x[0, 0] = 6.0 * 2**20
    x[:, 1] = torch.linspace(-1, 1, 128)
    q = moe_fp4.quantize_mxfp4(x)
    col = moe_fp4.mxfp4_to_fp8_colwise(q)
    assert col.scale[1, 0].item() == 2.0 ** -8  # amax 1.0 -> ceil(log2(1/448)) = -8
    assert same_values(moe_fp4.dequantize_fp8(col, torch.float32)[1], moe_fp4.dequantize_mxfp4(q, torch.float32)[:, 1])


def test_quantize_fp8_scales_match_an_independent_float64_oracle():
    x = make_input((64, 256), "mixed_magnitudes", torch.float32, seed=3)
    data, scale = quantize_fp8_rowwise_ref(x)
    for r in range(0, 64, 7):
        for t in range(2):
            amax = x[r, 128 * t:128 * (t + 1)].abs().max().item()
            assert scale[r, t].item() == 2.0 ** max(-126, pow2_ceil_exponent(amax, 448.0))
    expected = (x / scale.repeat_interleave(128, dim=1)).to(torch.float8_e4m3fn)  # torch's RNE cast
    assert same_bits(data, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_sqnr_gaussian(dtype):
    x = make_input((256, 1024), "gaussian", dtype, seed=11)
    mx = moe_fp4.dequantize_mxfp4(moe_fp4.quantize_mxfp4(x), torch.float32)
    f8 = moe_fp4.dequantize_fp8(moe_fp4.quantize_fp8(x), torch.float32)
    in_band(sqnr_db(x, mx), MXFP4_GAUSSIAN_SQNR_DB, MXFP4_GAUSSIAN_SQNR_CEILING_DB, "mxfp4")
    in_band(sqnr_db(x, f8), FP8_GAUSSIAN_SQNR_DB, FP8_GAUSSIAN_SQNR_CEILING_DB, "fp8")


def test_the_tests_sqnr_fails_on_nan_and_inf():
    """helpers.sqnr_db, in_band and lowest (docs/testing.md): a NaN or Inf result fails, where the
    library's metrics.sqnr_db returns nan, ``nan < floor`` is False and min() drops a nan."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[1, 3] = math.nan
    assert math.isnan(moe_fp4.formats.metrics.sqnr_db(x, y)) and not math.nan < 10.0   # what the helper prevents
    with pytest.raises(AssertionError,
                       match=r"the result is not finite: 1 of 128 values are NaN or Inf \(first at \(1, 3\)"):
        sqnr_db(x, y, "dW2")
    with pytest.raises(AssertionError, match="the reference is not finite"):
        sqnr_db(y, x)
    z = x.clone()
    z[0, 0] = -math.inf
    with pytest.raises(AssertionError, match="the result is not finite"):
        sqnr_db(x, z)
    assert sqnr_db(x, x) == math.inf                # equal finite tensors: inf, as before
    with pytest.raises(AssertionError, match="outside"):
        in_band(math.nan, 10.0)
    with pytest.raises(AssertionError, match="outside"):
        in_band(25.0, 17.0, 19.0)                    # over the ceiling: not quantized as promised
    assert in_band(18.0, 17.0, 19.0) == 18.0
    assert min([20.0, math.nan]) == 20.0             # what lowest prevents
    for fn in (lowest, highest):
        with pytest.raises(AssertionError, match="NaN"):
            fn([20.0, math.nan])
        with pytest.raises(AssertionError, match="nothing was measured"):
            fn([])
    assert lowest([20.0, 18.0]) == 18.0 and highest([20.0, 18.0]) == 20.0


def test_round_trips_for_every_transform_pair():
    x = make_input((3, 7, 256), "outlier_channels", torch.bfloat16, seed=5)
    q = moe_fp4.quantize_mxfp4(x)
    values = moe_fp4.dequantize_mxfp4(q, torch.float32)
    # MXFP4 -> BF16 -> MXFP4 keeps every value (the bits may differ: a block whose largest code is 3
    # comes back with a scale one lower and code 6, the same number).
    assert same_values(moe_fp4.quantize_mxfp4(moe_fp4.dequantize_mxfp4(q)).dequantize(torch.float32), values)
    # MXFP4 -> FP8 -> MXFP4 keeps every value when nothing underflows
    assert same_values(moe_fp4.quantize_mxfp4(moe_fp4.mxfp4_to_fp8(q)).dequantize(torch.float32), values)
    # FP8 -> BF16 -> FP8 keeps every value (power-of-two scales; E4M3 values are exact in BF16)
    f = moe_fp4.quantize_fp8(x)
    f_values = moe_fp4.dequantize_fp8(f, torch.float32)
    assert same_values(moe_fp4.quantize_fp8(moe_fp4.dequantize_fp8(f)).dequantize(torch.float32), f_values)
    # MXFP4 rows -> FP8 columns keeps every value (no column spans more than 14 binades here)
    col = moe_fp4.mxfp4_to_fp8_colwise(q)
    assert same_values(moe_fp4.dequantize_fp8(col, torch.float32).t(), values.reshape(21, 256))
    # shapes and dtypes are restored
    assert q.dequantize().shape == x.shape and q.dequantize().dtype == torch.bfloat16
    assert f.dequantize(torch.float32).shape == x.shape


def test_nan_and_inf_blocks():
    x = torch.randn(4, 128)
    x[0, 3] = math.nan
    x[1, 70] = math.inf
    x[2, 127] = -math.inf
    q = moe_fp4.quantize_mxfp4(x)
    assert q.scale[0].tolist()[0] == 0xFF and q.scale[1].tolist()[2] == 0xFF and q.scale[2].tolist()[3] == 0xFF
    assert (q.scale[3] != 0xFF).all()
    d = moe_fp4.dequantize_mxfp4(q, torch.float32)
    assert torch.isnan(d[0, :32]).all() and torch.isfinite(d[0, 32:]).all()
    # FP8: non-finite elements become NaN, the rest of the tile keeps its finite scale
    f = moe_fp4.quantize_fp8(x)
    fd = moe_fp4.dequantize_fp8(f, torch.float32)
    assert torch.isnan(fd[0, 3]) and torch.isnan(fd[1, 70]) and torch.isnan(fd[2, 127])
    assert torch.isfinite(fd).sum() == 4 * 128 - 3
    # every path keeps NaN blocks NaN: nothing non-finite comes back finite
    for out in (moe_fp4.mxfp4_to_fp8(q), moe_fp4.mxfp4_to_fp8_colwise(q)):
        dd = moe_fp4.dequantize_fp8(out, torch.float32)
        dd = dd if out.shape == q.shape else dd.t()
        assert torch.equal(torch.isnan(dd), torch.isnan(d))
    assert torch.equal(moe_fp4.quantize_mxfp4(f).scale == 0xFF, q.scale == 0xFF)


@pytest.mark.parametrize("shape", [(0, 128), (0, 3, 256), (5, 0, 128)])
def test_zero_sized(shape):
    x = torch.zeros(shape)
    q = moe_fp4.quantize_mxfp4(x)
    f = moe_fp4.quantize_fp8(x)
    assert q.dequantize().shape == x.shape and f.dequantize().shape == x.shape
    assert moe_fp4.mxfp4_to_fp8(q).data.shape == (0, shape[-1])
    assert moe_fp4.mxfp4_to_fp8_colwise(q).data.shape == (shape[-1], 0)
    assert moe_fp4.quantize_mxfp4(f).nbytes == 0


@pytest.mark.parametrize("shape", [(4, 0), (2, 3, 0)])
def test_zero_width(shape):
    """K = 0 (a rank whose slice of the hidden dimension is empty): every conversion returns empty
    containers of the right shapes instead of failing in a reshape."""
    x = torch.zeros(shape, dtype=torch.bfloat16)
    m = math.prod(shape[:-1])
    q, f = moe_fp4.quantize_mxfp4(x), moe_fp4.quantize_fp8(x)
    f2, q2 = moe_fp4.quantize_fp8_and_mxfp4(x)
    assert q.dequantize().shape == x.shape and f.dequantize().shape == x.shape
    assert f2.data.shape == (m, 0) and q2.data.shape == (m, 0)
    assert moe_fp4.mxfp4_to_fp8(q).data.shape == (m, 0)
    assert moe_fp4.mxfp4_to_fp8_colwise(q).data.shape == (0, m)
    assert moe_fp4.fp8_to_fp8_colwise(f).data.shape == (0, m)
    assert moe_fp4.quantize_mxfp4(f).nbytes == 0


def test_all_zero_tensor_gives_exact_zeros():
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    x[1] = -0.0
    q = moe_fp4.quantize_mxfp4(x)
    assert same_bits(q.dequantize(), x)
    assert same_bits(moe_fp4.quantize_fp8(x).dequantize(), x)
    assert same_bits(moe_fp4.mxfp4_to_fp8(q).dequantize(), x)
    assert (moe_fp4.dequantize_fp8(moe_fp4.mxfp4_to_fp8_colwise(q)) == 0).all()


def test_storage_sizes():
    q = moe_fp4.quantize_mxfp4(torch.randn(10, 7168))
    assert q.nbytes == 10 * (7168 // 2 + 7168 // 32)  # 3808 B per token, 4.25 bits per element
    f = moe_fp4.quantize_fp8(torch.randn(10, 7168))
    assert f.nbytes == 10 * (7168 + 4 * 7168 // 128)
