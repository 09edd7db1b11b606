"""Pure-torch twins of the public conversions, same signatures, no input validation.

These define "correct" for the Triton kernels: each kernel is tested bit for bit against its twin
here. They run on any device. ``moe_fp4.quantize_mxfp4`` and friends validate their input and then
call either these or the Triton launchers.
"""

from __future__ import annotations

import torch

from moe_fp4.formats import FP8BlockTensor, MXFP4Tensor
from moe_fp4.kernels.fp8 import dequantize_fp8_ref, mxfp4_to_fp8_rowwise_ref, quantize_fp8_rowwise_ref
from moe_fp4.kernels.mxfp4 import dequantize_mxfp4_ref, quantize_mxfp4_from_fp8_ref, quantize_mxfp4_rowwise_ref
from moe_fp4.kernels.transpose import mxfp4_to_fp8_colwise_ref


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def quantize_mxfp4(x: torch.Tensor | FP8BlockTensor) -> MXFP4Tensor:
    """x: bf16/fp16/fp32 [..., K] or FP8BlockTensor [M, K] -> MXFP4Tensor of the same logical shape."""
    if isinstance(x, FP8BlockTensor):
        data, scale = quantize_mxfp4_from_fp8_ref(x.data, x.scale)
        return MXFP4Tensor(data, scale, x.shape, x.dtype)
    data, scale = quantize_mxfp4_rowwise_ref(_rows(x))
    return MXFP4Tensor(data, scale, x.shape, x.dtype)


def dequantize_mxfp4(q: MXFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q: MXFP4Tensor [M, K] -> dtype tensor of q.shape."""
    return dequantize_mxfp4_ref(q.data, q.scale, dtype).view(q.shape)


def quantize_fp8(x: torch.Tensor) -> FP8BlockTensor:
    """x: bf16/fp16/fp32 [..., K] -> FP8BlockTensor [M, K] with 1x128 power-of-two scales."""
    data, scale = quantize_fp8_rowwise_ref(_rows(x))
    return FP8BlockTensor(data, scale, x.shape, x.dtype)


def dequantize_fp8(t: FP8BlockTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """t: FP8BlockTensor [M, K] -> dtype tensor of t.shape."""
    return dequantize_fp8_ref(t.data, t.scale, dtype).view(t.shape)


def mxfp4_to_fp8(q: MXFP4Tensor) -> FP8BlockTensor:
    """q: MXFP4Tensor [M, K] (K % 128 == 0) -> FP8BlockTensor [M, K], row-wise 1x128 tiles."""
    data, scale = mxfp4_to_fp8_rowwise_ref(q.data, q.scale)
    return FP8BlockTensor(data, scale, q.shape, q.dtype)


def mxfp4_to_fp8_colwise(q: MXFP4Tensor) -> FP8BlockTensor:
    """q: MXFP4Tensor [M, K] -> FP8BlockTensor [K, M] holding q^T in 1x128 tiles along M."""
    data, scale = mxfp4_to_fp8_colwise_ref(q.data, q.scale)
    return FP8BlockTensor(data, scale, torch.Size((q.k, q.m)), q.dtype)
