"""Pure-torch twins of the public conversions, same signatures, no input validation.

These define "correct" for the Triton kernels: each kernel is tested bit for bit against its twin
here. They run on any device.
"""

from __future__ import annotations

import torch

from moe_fp4.formats import _ops
from moe_fp4.formats.containers import FP8BlockTensor, MXFP4Tensor, NVFP4Tensor
from moe_fp4.kernels.numerics import Rounding


def quantize_mxfp4(x: torch.Tensor | FP8BlockTensor, rounding: str | Rounding = "nearest", seed: int = 0,
                   step: int = 0, rank: int = 0) -> MXFP4Tensor:
    """x: bf16/fp16/fp32 [..., K] or FP8BlockTensor [M, K] -> MXFP4Tensor of the same logical shape."""
    return _ops.quantize_mxfp4(x, False, Rounding(rounding), seed, step, rank)


def dequantize_mxfp4(q: MXFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q: MXFP4Tensor [M, K] -> dtype tensor of q.shape."""
    return _ops.dequantize_mxfp4(q, dtype, use_triton=False)


def quantize_fp8(x: torch.Tensor) -> FP8BlockTensor:
    """x: bf16/fp16/fp32 [..., K] -> FP8BlockTensor [M, K] with 1x128 power-of-two scales."""
    return _ops.quantize_fp8(x, use_triton=False)


def quantize_fp8_and_mxfp4(x: torch.Tensor) -> tuple[FP8BlockTensor, MXFP4Tensor]:
    """x: bf16/fp16/fp32 [..., K] (K % 128 == 0) -> (FP8BlockTensor, MXFP4Tensor) of the same input."""
    return _ops.quantize_fp8_and_mxfp4(x, use_triton=False)


def dequantize_fp8(t: FP8BlockTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """t: FP8BlockTensor [M, K] -> dtype tensor of t.shape."""
    return _ops.dequantize_fp8(t, dtype)


def mxfp4_to_fp8(q: MXFP4Tensor) -> FP8BlockTensor:
    """q: MXFP4Tensor [M, K] (K % 128 == 0) -> FP8BlockTensor [M, K], row-wise 1x128 tiles."""
    return _ops.mxfp4_to_fp8(q, use_triton=False)


def mxfp4_to_fp8_colwise(q: MXFP4Tensor, rows: torch.Tensor | None = None) -> FP8BlockTensor:
    """q: MXFP4Tensor [M, K] -> FP8BlockTensor [K, M] holding q^T in 1x128 tiles along M (of q's rows
    ``rows``, int [M'], when given: [K, M'])."""
    return _ops.mxfp4_to_fp8_colwise(q, use_triton=False, rows=rows)


def fp8_to_fp8_colwise(t: FP8BlockTensor) -> FP8BlockTensor:
    """t: FP8BlockTensor [M, K] -> FP8BlockTensor [K, M] holding t^T in 1x128 tiles along M."""
    return _ops.fp8_to_fp8_colwise(t, use_triton=False)


def quantize_nvfp4(x: torch.Tensor | FP8BlockTensor, tensor_scale: torch.Tensor | None = None,
                   rounding: str | Rounding = "nearest", seed: int = 0, step: int = 0, rank: int = 0) -> NVFP4Tensor:
    """x: bf16/fp16/fp32 [..., K] (K % 16 == 0) or FP8BlockTensor [M, K] -> NVFP4Tensor of the same logical
    shape."""
    return _ops.quantize_nvfp4(x, tensor_scale, False, Rounding(rounding), seed, step, rank)


def dequantize_nvfp4(q: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q: NVFP4Tensor [M, K] -> dtype tensor of q.shape."""
    return _ops.dequantize_nvfp4(q, dtype, False)


def nvfp4_to_fp8(q: NVFP4Tensor) -> FP8BlockTensor:
    """q: NVFP4Tensor [M, K] (K % 128 == 0) -> FP8BlockTensor [M, K], row-wise 1x128 tiles."""
    return _ops.nvfp4_to_fp8(q, use_triton=False)


def nvfp4_to_fp8_colwise(q: NVFP4Tensor) -> FP8BlockTensor:
    """q: NVFP4Tensor [M, K] -> FP8BlockTensor [K, M] holding q^T in 1x128 tiles along M."""
    return _ops.nvfp4_to_fp8_colwise(q, use_triton=False)
