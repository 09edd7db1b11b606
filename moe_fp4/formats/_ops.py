"""Container-level conversions, written once for both implementations.

Every kernel module exposes a Triton launcher ``name`` and its pure-torch twin ``name_ref`` with the
same signature on plain tensors; ``_pick`` chooses one and these functions wrap the result in the
containers. ``moe_fp4.formats.conversions`` (validated, dispatching by device) and ``moe_fp4.formats.reference`` (always
the twins) are thin layers over this module.
"""

from __future__ import annotations

import math

import torch

from moe_fp4.formats import kernel_ops
from moe_fp4.formats.containers import FP8BlockTensor, MXFP4Tensor, NVFP4Tensor
from moe_fp4.kernels import fp8 as _fp8
from moe_fp4.kernels import mxfp4 as _mxfp4
from moe_fp4.kernels import nvfp4 as _nvfp4
from moe_fp4.kernels import transpose as _transpose
from moe_fp4.kernels.numerics import Rounding


def _pick(module, name: str, use_triton: bool):
    """-> ``module.<name>`` (use_triton) or its twin ``<name>_ref``, through its ``moe_fp4::<name>`` op where it
    has one (:mod:`moe_fp4.formats.kernel_ops`): the same signature and results."""
    return kernel_ops.kernel(module, name, use_triton)


def _rows(x: torch.Tensor) -> torch.Tensor:
    # Not reshape(-1, K): with K = 0 the -1 is ambiguous and torch refuses.
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def quantize_mxfp4(x, use_triton: bool, rounding: Rounding = Rounding.NEAREST, seed: int = 0, step: int = 0,
                   rank: int = 0) -> MXFP4Tensor:
    if isinstance(x, FP8BlockTensor):
        data, scale = _pick(_mxfp4, "quantize_mxfp4_from_fp8", use_triton)(x.data, x.scale)
    elif Rounding(rounding) is Rounding.STOCHASTIC:
        data, scale = _pick(_mxfp4, "quantize_mxfp4_stochastic", use_triton)(_rows(x), seed, step, rank)
    else:
        data, scale = _pick(_mxfp4, "quantize_mxfp4_rowwise", use_triton)(_rows(x))
    return MXFP4Tensor(data, scale, x.shape, x.dtype)


def dequantize_mxfp4(q: MXFP4Tensor, dtype: torch.dtype, use_triton: bool) -> torch.Tensor:
    return _pick(_mxfp4, "dequantize_mxfp4", use_triton)(q.data, q.scale, dtype).view(q.shape)


def quantize_nvfp4(x, tensor_scale, use_triton: bool, rounding: Rounding = Rounding.NEAREST,
                   seed: int = 0, step: int = 0, rank: int = 0) -> NVFP4Tensor:
    if isinstance(x, FP8BlockTensor):
        data, scale, s_t = _pick(_nvfp4, "quantize_nvfp4_from_fp8", use_triton)(x.data, x.scale, tensor_scale,
                                                                                rounding, seed, step, rank)
    else:
        data, scale, s_t = _pick(_nvfp4, "quantize_nvfp4", use_triton)(_rows(x), tensor_scale, rounding, seed, step,
                                                                        rank)
    return NVFP4Tensor(data, scale, s_t, x.shape, x.dtype)


def nvfp4_to_fp8(q: NVFP4Tensor, use_triton: bool) -> FP8BlockTensor:
    data, scale = _pick(_nvfp4, "nvfp4_to_fp8_rowwise", use_triton)(q.data, q.scale, q.tensor_scale)
    return FP8BlockTensor(data, scale, q.shape, q.dtype)


def nvfp4_to_fp8_colwise(q: NVFP4Tensor, use_triton: bool) -> FP8BlockTensor:
    data, scale = _pick(_nvfp4, "nvfp4_to_fp8_colwise", use_triton)(q.data, q.scale, q.tensor_scale)
    return FP8BlockTensor(data, scale, torch.Size((q.k, q.m)), q.dtype)


def dequantize_nvfp4(q: NVFP4Tensor, dtype: torch.dtype, use_triton: bool) -> torch.Tensor:
    return _pick(_nvfp4, "dequantize_nvfp4", use_triton)(q.data, q.scale, q.tensor_scale, dtype).view(q.shape)


def quantize_fp8(x: torch.Tensor, use_triton: bool) -> FP8BlockTensor:
    data, scale = _pick(_fp8, "quantize_fp8_rowwise", use_triton)(_rows(x))
    return FP8BlockTensor(data, scale, x.shape, x.dtype)


def quantize_fp8_and_mxfp4(x: torch.Tensor, use_triton: bool) -> tuple[FP8BlockTensor, MXFP4Tensor]:
    (fd, fs), (md, ms) = _pick(_fp8, "quantize_fp8_and_mxfp4", use_triton)(_rows(x))
    return FP8BlockTensor(fd, fs, x.shape, x.dtype), MXFP4Tensor(md, ms, x.shape, x.dtype)


def dequantize_fp8(t: FP8BlockTensor, dtype: torch.dtype) -> torch.Tensor:
    # One elementwise multiply: torch's own kernels run it at bandwidth, no Triton twin needed.
    return _fp8.dequantize_fp8_ref(t.data, t.scale, dtype).view(t.shape)


def mxfp4_to_fp8(q: MXFP4Tensor, use_triton: bool) -> FP8BlockTensor:
    data, scale = _pick(_fp8, "mxfp4_to_fp8_rowwise", use_triton)(q.data, q.scale)
    return FP8BlockTensor(data, scale, q.shape, q.dtype)


def mxfp4_to_fp8_colwise(q: MXFP4Tensor, use_triton: bool, rows: torch.Tensor | None = None) -> FP8BlockTensor:
    data, scale = _pick(_transpose, "mxfp4_to_fp8_colwise", use_triton)(q.data, q.scale, rows=rows)
    return FP8BlockTensor(data, scale, torch.Size((q.k, q.m if rows is None else rows.shape[0])), q.dtype)


def fp8_to_fp8_colwise(t: FP8BlockTensor, use_triton: bool) -> FP8BlockTensor:
    data, scale = _pick(_transpose, "fp8_to_fp8_colwise", use_triton)(t.data, t.scale)
    return FP8BlockTensor(data, scale, torch.Size((t.k, t.m)), t.dtype)
