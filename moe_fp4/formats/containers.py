"""The quantized formats: MXFP4 (storage and transport), FP8 1x128 (GEMM operands) and NVFP4 (optional
storage and transport like MXFP4, with an E4M3 scale per 16 elements and a float32 scale per tensor;
its Triton kernels, quantize, dequantize and NVFP4 <-> FP8 1x128, are in kernels/nvfp4.py).

All three are frozen dataclasses whose ``__post_init__`` checks every structural invariant (dtypes,
shapes, devices, strides). These checks are cheap and never synchronise with the GPU. Checks on
*values* (scales are powers of two, no NaN scale where NaN is not allowed) read the data, so they
live in :func:`check_fp8_scale_values`, which the public conversion functions call on CPU tensors
always and on CUDA tensors when ``MOE_FP4_CHECK_VALUES=1`` (never under torch.compile), and
:func:`check_mxfp4_finite`, behind ``MXFP4Tensor.check_finite()``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from moe_fp4.kernels.numerics import (
    E8M0_NAN,
    FP8_EXP_MAX,
    FP8_EXP_MIN,
    FP8_TILE,
    MXFP4_BLOCK,
)
from moe_fp4.kernels.nvfp4 import NVFP4_BLOCK

HIGH_PRECISION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# The dequantization functions live once, with the other conversions (moe_fp4.formats.conversions,
# which imports this module). They register themselves here when that module loads (``import
# moe_fp4`` loads it), so that ``.dequantize()`` reaches them without this module importing upward.
_DEQUANTIZERS: dict[str, Callable] = {}


def register_dequantizer(fn: Callable) -> Callable:
    """Decorator for the conversions module's ``dequantize_*`` functions (keyed by name)."""
    _DEQUANTIZERS[fn.__name__] = fn
    return fn


def _dequantizer(name: str) -> Callable:
    fn = _DEQUANTIZERS.get(name)
    if fn is None:
        raise RuntimeError(f"{name} is not registered: import moe_fp4 (or moe_fp4.formats) before dequantizing")
    return fn


def _fail(cls, msg: str):
    raise cls(msg)


def check_values_enabled(t: torch.Tensor) -> bool:
    """Value checks (which read the data) run on CPU always, on GPUs only when asked for, and never inside
    torch.compile or on fake tensors (a compiled region and an op's fake read no value on the host; the checks
    run where the conversion is called eagerly)."""
    if torch.compiler.is_compiling() or torch._subclasses.fake_tensor.is_fake(t):
        return False
    return t.device.type != "cuda" or os.environ.get("MOE_FP4_CHECK_VALUES", "0") == "1"


def _check_data_and_scale(t, data_dtype, data_desc: str, scale_dtype, scale_desc: str):
    """Checks both containers share: tensors, dtypes, 2-D, one device. -> (data, scale)."""
    what, d, s = type(t).__name__, t.data, t.scale
    if not isinstance(d, torch.Tensor) or not isinstance(s, torch.Tensor):
        _fail(TypeError, f"{what}: data and scale must be torch.Tensors")
    if d.dtype != data_dtype:
        _fail(TypeError, f"{what}: data must be {data_desc}, got {d.dtype}")
    if s.dtype != scale_dtype:
        _fail(TypeError, f"{what}: scale must be {scale_desc}, got {s.dtype}")
    if d.dim() != 2 or s.dim() != 2:
        _fail(ValueError, f"{what}: data and scale must be 2-D, got {tuple(d.shape)} and {tuple(s.shape)}")
    if d.device != s.device:
        _fail(ValueError, f"{what}: data on {d.device} but scale on {s.device}; they must share a device")
    return d, s


def _check_logical(shape, dtype, m: int, k: int, what: str) -> torch.Size:
    shape = torch.Size(shape)
    if len(shape) == 0:
        _fail(ValueError, f"{what}: logical shape must have at least one dimension, got {tuple(shape)}")
    if shape[-1] != k or math.prod(shape) != m * k:
        _fail(ValueError, f"{what}: logical shape {tuple(shape)} does not match the stored [M={m}, K={k}] "
                          f"(need shape[-1] == K and prod(shape) == M*K)")
    if dtype not in HIGH_PRECISION_DTYPES:
        _fail(TypeError, f"{what}: original dtype must be one of bfloat16/float16/float32, got {dtype}")
    return shape


def _check_packed_e2m1(t, block: int, scale_dtype, scale_desc: str) -> tuple[int, int]:
    """The checks MXFP4Tensor and NVFP4Tensor share: uint8 data [M, K/2] of two E2M1 codes a byte, one
    scale per ``block`` elements [M, K/block], both row-major; sets the checked logical shape -> (M, K)."""
    what = type(t).__name__
    d, s = _check_data_and_scale(t, torch.uint8, "uint8 (two E2M1 codes per byte)", scale_dtype, scale_desc)
    m, half_k = d.shape
    k = 2 * half_k
    if k % block != 0:
        _fail(ValueError, f"{what}: K = 2 * data.shape[1] = {k} must be a multiple of {block}")
    if tuple(s.shape) != (m, k // block):
        _fail(ValueError, f"{what}: scale shape {tuple(s.shape)} must be [M, K/{block}] = {(m, k // block)}")
    if not d.is_contiguous() or not s.is_contiguous():
        _fail(ValueError, f"{what}: data and scale must be contiguous (row-major)")
    object.__setattr__(t, "shape", _check_logical(t.shape, t.dtype, m, k, what))
    return m, k


class _PackedE2M1:
    """Shape accessors of a container whose ``data`` is uint8 [M, K/2], two E2M1 codes a byte."""

    @property
    def m(self) -> int:
        return self.data.shape[0]

    @property
    def k(self) -> int:
        return 2 * self.data.shape[1]

    @property
    def device(self) -> torch.device:
        return self.data.device


@dataclass(frozen=True)
class MXFP4Tensor(_PackedE2M1):
    """A tensor quantized to MXFP4 along its last dimension.

    data:  uint8 [M, K/2], row-major; element 2i in the low nibble, 2i+1 in the high nibble
           (the layout of ``torch.float4_e2m1fn_x2``). E2M1 codes: bit 3 sign, bits 0-2 magnitude.
    scale: uint8 [M, K/32], row-major E8M0: byte b means 2^(b-127); 0xFF marks a block that held
           NaN or Inf (it decodes to NaN).
    shape: the logical shape to restore ([..., K], prod(shape[:-1]) == M).
    dtype: the dtype the tensor had before quantization (restored by default on dequantize).
    """

    data: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        _check_packed_e2m1(self, MXFP4_BLOCK, torch.uint8, "uint8 (E8M0 bytes)")

    @property
    def nbytes(self) -> int:
        """Bytes of storage: K/2 data bytes + K/32 scale bytes per row (4.25 bits per element)."""
        return self.data.numel() + self.scale.numel()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """-> tensor of ``self.shape`` in ``dtype`` (default: the original dtype)."""
        return _dequantizer("dequantize_mxfp4")(self, self.dtype if dtype is None else dtype)

    def to(self, device) -> "MXFP4Tensor":
        return MXFP4Tensor(self.data.to(device), self.scale.to(device), self.shape, self.dtype)

    def rows(self, start: int, stop: int) -> "MXFP4Tensor":
        """-> MXFP4Tensor [stop - start, K] of rows start..stop-1 of the [M, K] view (views, no copy)."""
        return MXFP4Tensor(self.data[start:stop], self.scale[start:stop], (stop - start, self.k), self.dtype)

    def check_finite(self) -> "MXFP4Tensor":
        """Raise ValueError if any block is NaN (scale byte 0xFF); return self. Reads the scales
        (a device sync on GPU): for inputs that must not carry NaN, e.g. received from another rank."""
        check_mxfp4_finite(self.scale)
        return self


@dataclass(frozen=True)
class FP8BlockTensor:
    """A tensor quantized to FP8 E4M3 in 1x128 tiles along its last dimension.

    data:  float8_e4m3fn [M, K], row-major.
    scale: float32 [M, ceil(K/128)], a power of two 2^S (S in [-126, 127]) per tile, stored M-major
           (strides (1, M)): the layout ``torch.nn.functional.scaled_mm`` takes for
           ``ScalingType.BlockWise1x128``, so a GEMM consumes it without a copy. The value of a tile
           element is ``data * scale``. A short last tile (K % 128 != 0) is allowed; it appears in the
           column-wise (transposed) tensors whose K is a token count.
    shape: the logical shape to restore ([..., K]).
    dtype: the dtype of the tensor before quantization (restored by default on dequantize).
    """

    data: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        d, s = _check_data_and_scale(self, torch.float8_e4m3fn, "float8_e4m3fn",
                                     torch.float32, "float32 (power-of-two values)")
        m, k = d.shape
        tiles = -(-k // FP8_TILE)
        if tuple(s.shape) != (m, tiles):
            _fail(ValueError, f"FP8BlockTensor: scale shape {tuple(s.shape)} must be [M, ceil(K/128)] = {(m, tiles)}")
        if not d.is_contiguous():
            _fail(ValueError, "FP8BlockTensor: data must be contiguous (row-major)")
        if not s.t().is_contiguous():
            _fail(ValueError, f"FP8BlockTensor: scale must be M-major (strides (1, M), i.e. scale.t() contiguous), "
                              f"got strides {s.stride()}")
        object.__setattr__(self, "shape", _check_logical(self.shape, self.dtype, m, k, "FP8BlockTensor"))

    @property
    def m(self) -> int:
        return self.data.shape[0]

    @property
    def k(self) -> int:
        return self.data.shape[1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes of storage: K data bytes + 4 bytes per 1x128 tile scale per row."""
        return self.data.numel() + 4 * self.scale.numel()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """-> tensor of ``self.shape`` in ``dtype`` (default: the original dtype)."""
        return _dequantizer("dequantize_fp8")(self, self.dtype if dtype is None else dtype)

    def to(self, device) -> "FP8BlockTensor":
        scale = self.scale.t().contiguous().to(device).t()
        return FP8BlockTensor(self.data.to(device), scale, self.shape, self.dtype)

    def rows(self, start: int, stop: int) -> "FP8BlockTensor":
        """-> FP8BlockTensor [stop - start, K] of rows start..stop-1 of the [M, K] view. The data is a
        view; the scales are copied (a row range of an M-major scale is not M-major: its stride is M),
        with strides exactly (1, stop - start) as scaled_mm checks them even for one tile."""
        scale = torch.empty(self.scale.shape[1], stop - start, dtype=self.scale.dtype, device=self.scale.device).t()
        scale.copy_(self.scale[start:stop])
        return FP8BlockTensor(self.data[start:stop], scale, (stop - start, self.k), self.dtype)


@dataclass(frozen=True)
class NVFP4Tensor(_PackedE2M1):
    """A tensor quantized to NVFP4 along its last dimension (rules: ``moe_fp4.kernels.nvfp4``).

    data:  uint8 [M, K/2], row-major; two E2M1 codes a byte, element 2i in the low nibble (as MXFP4).
    scale: float8_e4m3fn [M, K/16], row-major: one E4M3 scale per 16 elements; the NaN byte 0x7F marks
           a block that held NaN or Inf.
    tensor_scale: float32 0-d, on the data's device: s_t = max(amax / 2688, 2^-126).
    shape: the logical shape to restore ([..., K]). dtype: the dtype before quantization.
    The value of an element is e2m1 * e4m3 * s_t (4.5 bits an element plus 4 bytes a tensor).
    """

    data: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        _check_packed_e2m1(self, NVFP4_BLOCK, torch.float8_e4m3fn, "float8_e4m3fn (E4M3 block scales)")
        t, d = self.tensor_scale, self.data
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 0:
            _fail(TypeError, f"NVFP4Tensor: tensor_scale must be a float32 0-d tensor, got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
        if t.device != d.device:
            _fail(ValueError, f"NVFP4Tensor: tensor_scale on {t.device} but data on {d.device}")

    @property
    def nbytes(self) -> int:
        """Bytes of storage: K/2 data bytes + K/16 scale bytes per row (4.5 bits an element), + 4."""
        return self.data.numel() + self.scale.numel() + 4

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """-> tensor of ``self.shape`` in ``dtype`` (default: the original dtype)."""
        return _dequantizer("dequantize_nvfp4")(self, self.dtype if dtype is None else dtype)


def check_fp8_scale_values(scale: torch.Tensor, what: str = "FP8BlockTensor.scale") -> None:
    """Raise ValueError unless every scale is a power of two 2^S with S in [-126, 127] (reads the data)."""
    if scale.numel() == 0:
        return
    bits = scale.contiguous().view(torch.int32)
    mant_zero = (bits & 0x7FFFFF) == 0
    exp = ((bits >> 23) & 0xFF) - 127
    ok = mant_zero & (bits >= 0) & (exp >= FP8_EXP_MIN) & (exp <= FP8_EXP_MAX)
    if not bool(ok.all()):
        bad = scale.flatten()[(~ok).flatten().nonzero()[0]].item()
        _fail(ValueError, f"{what}: every scale must be a positive power of two 2^S with S in "
                          f"[{FP8_EXP_MIN}, {FP8_EXP_MAX}]; found {bad!r}")


def check_mxfp4_finite(scale: torch.Tensor, what: str = "MXFP4Tensor.scale") -> None:
    """Raise ValueError if a scale byte is 0xFF (a NaN block), for inputs where NaN is not allowed
    (reads the data)."""
    if scale.numel() and bool((scale == E8M0_NAN).any()):
        _fail(ValueError, f"{what}: holds the E8M0 NaN byte 0xFF, which is not allowed here")


__all__ = ["HIGH_PRECISION_DTYPES", "FP8BlockTensor", "MXFP4Tensor", "NVFP4Tensor", "check_fp8_scale_values",
           "check_mxfp4_finite", "check_values_enabled"]
