"""Containers and bad input: every error names the condition it expected."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe_fp4
from moe_fp4.kernels.fp8 import empty_m_major


def _mx(m=2, k=64, **over):
    args = dict(data=torch.zeros(m, k // 2, dtype=torch.uint8), scale=torch.full((m, k // 32), 127, dtype=torch.uint8),
                shape=torch.Size((m, k)), dtype=torch.bfloat16)
    args.update(over)
    return moe_fp4.MXFP4Tensor(**args)


def _f8(m=2, k=256, **over):
    scale = empty_m_major(m, -(-k // 128), "cpu")
    scale.fill_(1.0)
    args = dict(data=torch.zeros(m, k, dtype=torch.float8_e4m3fn), scale=scale, shape=torch.Size((m, k)),
                dtype=torch.bfloat16)
    args.update(over)
    return moe_fp4.FP8BlockTensor(**args)


def test_containers_are_frozen_and_restore_leading_shape():
    x = torch.randn(2, 3, 64)
    q = moe_fp4.quantize_mxfp4(x)
    assert (q.m, q.k) == (6, 64) and q.shape == x.shape and q.dtype == torch.float32
    assert q.to("cpu").shape == q.shape and q.device.type == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'data'"):
        q.data = None
    f = moe_fp4.quantize_fp8(torch.randn(2, 3, 128))
    assert f.to("cpu").scale.t().is_contiguous()


@pytest.mark.parametrize("fn", [moe_fp4.quantize_mxfp4, moe_fp4.quantize_fp8])
def test_quantize_rejects_wrong_dtype(fn):
    with pytest.raises(TypeError, match="bfloat16/float16/float32"):
        fn(torch.ones(2, 128, dtype=torch.int32))
    with pytest.raises(TypeError, match="bfloat16/float16/float32"):
        fn(torch.ones(2, 128, dtype=torch.float64))
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        fn([1.0] * 128)


def test_quantize_rejects_bad_last_dim():
    with pytest.raises(ValueError, match="multiple of 32"):
        moe_fp4.quantize_mxfp4(torch.ones(2, 48))
    with pytest.raises(ValueError, match="multiple of 128"):
        moe_fp4.quantize_fp8(torch.ones(2, 64))
    with pytest.raises(ValueError, match="0-d"):
        moe_fp4.quantize_mxfp4(torch.tensor(1.0))
    with pytest.raises(ValueError, match="multiple of 128"):
        moe_fp4.mxfp4_to_fp8(moe_fp4.quantize_mxfp4(torch.ones(2, 96)))


@pytest.mark.parametrize("fn", [moe_fp4.quantize_mxfp4, moe_fp4.quantize_fp8])
def test_quantize_rejects_non_contiguous(fn):
    with pytest.raises(ValueError, match="contiguous"):
        fn(torch.ones(256, 4).t())


def test_fp8_input_to_mxfp4_needs_whole_tiles():
    col = moe_fp4.mxfp4_to_fp8_colwise(moe_fp4.quantize_mxfp4(torch.randn(100, 32)))  # [32, 100]: short tile
    with pytest.raises(ValueError, match="multiple of 128"):
        moe_fp4.quantize_mxfp4(col)
    assert moe_fp4.dequantize_fp8(col).shape == (32, 100)  # dequantize handles the short tile


def test_dequantize_rejects_bad_output_dtype_and_wrong_container():
    q = moe_fp4.quantize_mxfp4(torch.ones(1, 128))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        moe_fp4.dequantize_mxfp4(q, torch.int8)
    with pytest.raises(TypeError, match="expected MXFP4Tensor"):
        moe_fp4.dequantize_mxfp4(torch.ones(1, 128))
    with pytest.raises(TypeError, match="expected FP8BlockTensor"):
        moe_fp4.dequantize_fp8(q)
    with pytest.raises(TypeError, match="expected MXFP4Tensor"):
        moe_fp4.mxfp4_to_fp8_colwise(moe_fp4.quantize_fp8(torch.ones(1, 128)))


def test_fused_fp8_and_mxfp4_quantization_rejects_bad_input():
    fn = moe_fp4.quantize_fp8_and_mxfp4
    # K = 96: whole MXFP4 blocks, but not whole FP8 tiles
    with pytest.raises(ValueError, match="quantize_fp8_and_mxfp4: the last dimension K = 96 must be a multiple of 128"):
        fn(torch.ones(2, 96))
    for dtype in (torch.float64, torch.int32, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match=f"quantize_fp8_and_mxfp4: expected a bfloat16/float16/float32 tensor, "
                                            f"got {dtype}"):
            fn(torch.ones(2, 128).to(dtype))
    with pytest.raises(ValueError,
                       match=r"quantize_fp8_and_mxfp4: the input must be contiguous \(got strides \(1, 4\)\)"):
        fn(torch.ones(128, 4).t())
    with pytest.raises(TypeError, match="quantize_fp8_and_mxfp4: expected a torch.Tensor, got list"):
        fn([1.0] * 128)
    with pytest.raises(ValueError, match="quantize_fp8_and_mxfp4: expected a tensor of shape \\[..., K\\], got a 0-d"):
        fn(torch.tensor(1.0))


def test_fp8_to_fp8_colwise_rejects_bad_input_and_takes_a_short_last_tile(references):
    # On the reference conversion behind the public function's checks (``references``): the kernel equals
    # it bit for bit, short tiles included, in test_kernels.py / test_fp8_colwise.py.
    from helpers import same_bits

    from moe_fp4.kernels.fp8 import quantize_fp8_rowwise_ref

    fn = moe_fp4.fp8_to_fp8_colwise
    # K must be whole 1x128 tiles: K = 64, and a column-wise tensor whose last tile is short (K = 100)
    with pytest.raises(ValueError, match=r"fp8_to_fp8_colwise: K = 64 must be a multiple of 128 \(whole 1x128 tiles\)"):
        fn(_f8(k=64))
    short = moe_fp4.mxfp4_to_fp8_colwise(moe_fp4.quantize_mxfp4(torch.randn(100, 32)))    # [32, 100]
    with pytest.raises(ValueError, match="fp8_to_fp8_colwise: K = 100 must be a multiple of 128"):
        fn(short)
    with pytest.raises(TypeError, match="fp8_to_fp8_colwise: expected FP8BlockTensor, got MXFP4Tensor"):
        fn(moe_fp4.quantize_mxfp4(torch.ones(2, 128)))
    with pytest.raises(TypeError, match="fp8_to_fp8_colwise: expected FP8BlockTensor, got Tensor"):
        fn(torch.ones(2, 128))
    f = _f8()
    f.scale[0, 0] = 3.0
    with pytest.raises(ValueError, match="fp8_to_fp8_colwise: FP8BlockTensor.scale: every scale must be a positive "
                                         "power of two"):
        fn(f)
    # M = 130 rows: the output's last 1x128 tile along M holds 2 columns. The oracle: dequantize,
    # transpose, quantize along tokens in pure torch (short tile allowed).
    g = moe_fp4.formats.reference.quantize_fp8(torch.randn(130, 128, generator=torch.Generator().manual_seed(3)))
    col = fn(g)
    data, scale = quantize_fp8_rowwise_ref(g.dequantize(torch.float32).t().contiguous())
    assert col.shape == (128, 130) and col.scale.shape == (128, 2)
    assert same_bits(col.data, data) and torch.equal(col.scale, scale)


def test_dequantize_nvfp4_checks_its_dtype_and_container():
    q = moe_fp4.quantize_nvfp4(torch.randn(2, 128, generator=torch.Generator().manual_seed(4)))
    for dtype in (torch.float64, torch.int8, torch.float8_e4m3fn, "bfloat16"):
        with pytest.raises(TypeError, match=f"dequantize_nvfp4: output dtype must be bfloat16, float16 or float32, "
                                            f"got {dtype}"):
            moe_fp4.dequantize_nvfp4(q, dtype)
    with pytest.raises(TypeError, match="dequantize_nvfp4: expected NVFP4Tensor, got MXFP4Tensor"):
        moe_fp4.dequantize_nvfp4(moe_fp4.quantize_mxfp4(torch.ones(2, 128)))
    exact = moe_fp4.dequantize_nvfp4(q, torch.float32)
    for dtype in (torch.bfloat16, torch.float16):     # each dtype: the float32 values rounded once
        got = moe_fp4.dequantize_nvfp4(q, dtype)
        assert got.dtype == dtype and torch.equal(got, exact.to(dtype))


def test_mxfp4_container_validation():
    with pytest.raises(TypeError, match="data must be uint8"):
        _mx(data=torch.zeros(2, 32, dtype=torch.int8))
    with pytest.raises(TypeError, match="scale must be uint8"):
        _mx(scale=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="multiple of 32"):
        _mx(data=torch.zeros(2, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"scale shape \(2, 3\) must be \[M, K/32\]"):
        _mx(scale=torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        _mx(data=torch.zeros(32, 2, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match="must share a device"):
        _mx(scale=torch.zeros(2, 2, dtype=torch.uint8, device="meta"))
    with pytest.raises(ValueError, match="does not match the stored"):
        _mx(shape=torch.Size((3, 64)))
    with pytest.raises(TypeError, match="original dtype"):
        _mx(dtype=torch.int32)


def test_fp8_container_validation():
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        _f8(data=torch.zeros(2, 256, dtype=torch.float8_e5m2))
    with pytest.raises(TypeError, match="scale must be float32"):
        _f8(scale=torch.ones(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"must be \[M, ceil\(K/128\)\]"):
        _f8(scale=empty_m_major(2, 3, "cpu"))
    with pytest.raises(ValueError, match="M-major"):
        _f8(scale=torch.ones(2, 2))  # row-major: strides (2, 1)
    with pytest.raises(ValueError, match="must share a device"):
        _f8(scale=empty_m_major(2, 2, "meta"))


@pytest.mark.parametrize("bad", [0.75, 3.0, -1.0, 0.0, float("nan"), float("inf"), 2.0**-127, 2.0**-140])
def test_fp8_scales_must_be_powers_of_two_in_range(bad):
    f = _f8()
    f.scale[1, 1] = bad
    with pytest.raises(ValueError, match="power of two"):
        moe_fp4.dequantize_fp8(f)
    with pytest.raises(ValueError, match="power of two"):
        moe_fp4.quantize_mxfp4(f)


def test_nan_scale_byte_rejected_where_nan_is_not_allowed():
    x = torch.ones(2, 64)
    assert moe_fp4.quantize_mxfp4(x).check_finite() is not None
    x[1, 40] = float("nan")
    with pytest.raises(ValueError, match="0xFF"):
        moe_fp4.quantize_mxfp4(x).check_finite()
