"""The all-to-all wire format: one uint8 row per token, values and scales side by side.

| format  | row bytes (hidden H)            | layout                                            |
| ------- | ------------------------------- | ------------------------------------------------- |
| `mxfp4` | H/2 + H/32 (7168: 3808)         | `[E2M1 codes, 2 per byte | E8M0 scale per 32]`      |
| `fp8`   | H + 4 H/128 (7168: 7392)        | `[E4M3 codes | float32 power-of-two scale per 128]` |
| `bf16`  | 2 H (7168: 14336)               | the values rounded to bfloat16 (nearest even)      |
| `native`| H * itemsize (7168 fp32: 28672) | the values in the tensor's own dtype, unchanged    |

So data and scales travel in ONE collective per exchange. :func:`pack` quantizes straight into the
row layout (one Triton pass: the quantizers write through strided views of the wire buffer), and
:func:`unpack` converts the received rows into the wanted output in one pass (the converters read
the same strided views). On CPU without ``TRITON_INTERPRET=1`` the pure-torch twins run instead.

A wire format means what it says: ``bf16`` puts bfloat16 on the wire whatever the tensor's dtype (a
float32 tensor is rounded to bfloat16 and comes back as float32 holding those values); ``native``
passes the tensor's own dtype through (for bfloat16 tensors the two send the same bytes).
"""

from __future__ import annotations

import enum

import torch

from moe_fp4._ops import _pick
from moe_fp4.api import _use_triton, mxfp4_to_fp8, quantize_fp8, quantize_mxfp4
from moe_fp4.formats import HIGH_PRECISION_DTYPES, FP8BlockTensor, MXFP4Tensor
from moe_fp4.kernels import fp8 as _fp8
from moe_fp4.kernels import mxfp4 as _mxfp4
from moe_fp4.kernels.fp8 import dequantize_fp8_ref, m_major
from moe_fp4.kernels.numerics import FP8_TILE, MXFP4_BLOCK


class WireFormat(str, enum.Enum):
    """How values (or their gradients) travel between ranks."""

    MXFP4 = "mxfp4"  # 4.25 bits per element
    FP8 = "fp8"      # E4M3 in 1x128 tiles with float32 power-of-two scales: 8.25 bits
    BF16 = "bf16"    # bfloat16 (round to nearest even), back to the tensor's dtype on arrival: 16 bits
    NATIVE = "native"  # unchanged, in the tensor's own dtype (float32: 32 bits)


class OutputFormat(str, enum.Enum):
    """What the receiving side returns."""

    BF16 = "bf16"    # the input's float dtype
    FP8 = "fp8"      # FP8BlockTensor (direct MXFP4 -> FP8 for an MXFP4 wire)
    MXFP4 = "mxfp4"  # MXFP4Tensor (as received for an MXFP4 wire)


# Block the hidden size must be a multiple of, per wire format.
HIDDEN_MULTIPLE = {WireFormat.MXFP4: MXFP4_BLOCK, WireFormat.FP8: FP8_TILE, WireFormat.BF16: 1, WireFormat.NATIVE: 1}
# Wire formats that send the values unquantized (no scales).
UNQUANTIZED = (WireFormat.BF16, WireFormat.NATIVE)


def wire_dtype(fmt: WireFormat, dtype: torch.dtype) -> torch.dtype | None:
    """The element dtype an unquantized wire carries for tensors of ``dtype`` (None if quantized)."""
    fmt = WireFormat(fmt)
    if fmt is WireFormat.BF16:
        return torch.bfloat16
    return dtype if fmt is WireFormat.NATIVE else None


def row_bytes(fmt: WireFormat, hidden: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes per row on the wire for ``hidden`` values of ``dtype`` (dtype matters for native only)."""
    fmt = WireFormat(fmt)
    if fmt is WireFormat.MXFP4:
        return hidden // 2 + hidden // MXFP4_BLOCK
    if fmt is WireFormat.FP8:
        return hidden + 4 * (hidden // FP8_TILE)
    return hidden * wire_dtype(fmt, dtype).itemsize


def views(wire: torch.Tensor, fmt: WireFormat, hidden: int, dtype: torch.dtype = torch.bfloat16):
    """wire: uint8 [N, >= row_bytes] -> the payload columns as typed, row-strided views:
    mxfp4 (codes uint8 [N, H/2], scales uint8 [N, H/32]); fp8 (codes float8_e4m3fn [N, H], scales
    float32 [N, H/128]); bf16 (values bfloat16 [N, H], None); native (values dtype [N, H], None). The
    row stride must suit the widest view (a multiple of 4 bytes for fp8 scales, of the itemsize for
    the unquantized ones)."""
    fmt = WireFormat(fmt)
    if fmt is WireFormat.MXFP4:
        half = hidden // 2
        return wire[:, :half], wire[:, half:half + hidden // MXFP4_BLOCK]
    if fmt is WireFormat.FP8:
        codes = wire[:, :hidden].view(torch.float8_e4m3fn)
        return codes, wire[:, hidden:hidden + 4 * (hidden // FP8_TILE)].view(torch.float32)
    values = wire_dtype(fmt, dtype)
    return wire[:, :hidden * values.itemsize].view(values), None


def _float_rows(x) -> torch.Tensor:
    if isinstance(x, (MXFP4Tensor, FP8BlockTensor)):
        return x.dequantize().reshape(x.m, x.k)
    return x


def pack(x, fmt: WireFormat, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: float [N, H] (contiguous), FP8BlockTensor [N, H] or MXFP4Tensor [N, H] -> uint8 [N, B] wire rows.

    A float input is quantized into the rows in one pass; a container of the wire's own format is
    copied as is (no re-quantization); other containers are converted directly (FP8 <-> MXFP4).
    ``out``: an existing uint8 [N, >= B] buffer (the EP layer appends routing data after column B);
    without it a new [N, B] buffer is returned (for an unquantized wire whose dtype x already has: a
    view of x, no copy).
    """
    fmt = WireFormat(fmt)
    n, hidden = (x.m, x.k) if isinstance(x, (MXFP4Tensor, FP8BlockTensor)) else x.shape
    dtype = x.dtype
    if fmt in UNQUANTIZED:
        rows = _float_rows(x)
        if out is None:
            return rows.to(wire_dtype(fmt, dtype)).contiguous().view(torch.uint8)
        views(out, fmt, hidden, dtype)[0].copy_(rows)   # copy_ rounds to bfloat16 for the bf16 wire
        return out
    if out is None:
        out = torch.empty(n, row_bytes(fmt, hidden), dtype=torch.uint8,
                          device=x.device if isinstance(x, torch.Tensor) else x.data.device)
    dst = views(out, fmt, hidden)
    if fmt is WireFormat.MXFP4:
        own, other_to_own, kernels, name = MXFP4Tensor, quantize_mxfp4, _mxfp4, "quantize_mxfp4_rowwise"
    else:
        own, other_to_own, kernels, name = FP8BlockTensor, mxfp4_to_fp8, _fp8, "quantize_fp8_rowwise"
    if isinstance(x, (MXFP4Tensor, FP8BlockTensor)):
        x = x if isinstance(x, own) else other_to_own(x)   # direct FP8 <-> MXFP4, no float tensor
        dst[0].copy_(x.data)
        dst[1].copy_(x.scale)
    else:
        _pick(kernels, name, _use_triton(x))(x, out=dst)
    return out


def unpack(wire: torch.Tensor, fmt: WireFormat, hidden: int, output: OutputFormat = OutputFormat.BF16,
           dtype: torch.dtype = torch.bfloat16):
    """wire: uint8 [N, >= B] received rows -> ``output``: dtype [N, H], FP8BlockTensor [N, H] or
    MXFP4Tensor [N, H] (its logical dtype ``dtype``).

    One pass from the strided wire views where the formats differ (MXFP4 -> bf16, MXFP4 -> FP8,
    FP8 -> MXFP4); a copy into contiguous containers where they agree.
    """
    fmt, output = WireFormat(fmt), OutputFormat(output)
    if dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"unpack: dtype must be bfloat16, float16 or float32, got {dtype}")
    n = wire.shape[0]
    d, s = views(wire, fmt, hidden, dtype)
    tri = _use_triton(wire)
    if fmt in UNQUANTIZED:
        rows = d.to(dtype).contiguous()   # bf16 wire -> the tensor's dtype (exact)
        if output is OutputFormat.BF16:
            return rows
        return quantize_fp8(rows) if output is OutputFormat.FP8 else quantize_mxfp4(rows)
    if fmt is WireFormat.MXFP4:
        if output is OutputFormat.BF16:
            return _pick(_mxfp4, "dequantize_mxfp4", tri)(d, s, dtype)
        if output is OutputFormat.FP8:
            fd, fs = _pick(_fp8, "mxfp4_to_fp8_rowwise", tri)(d, s)
            return FP8BlockTensor(fd, fs, (n, hidden), dtype)
        return MXFP4Tensor(d.contiguous(), s.contiguous(), (n, hidden), dtype)
    if output is OutputFormat.BF16:
        return dequantize_fp8_ref(d, s, dtype)
    if output is OutputFormat.FP8:
        # Copy the codes as bytes: a strided float8 copy takes a slower path in torch.
        codes = wire[:, :hidden].contiguous().view(torch.float8_e4m3fn)
        return FP8BlockTensor(codes, m_major(s), (n, hidden), dtype)
    md, ms = _pick(_mxfp4, "quantize_mxfp4_from_fp8", tri)(d.contiguous(), s)
    return MXFP4Tensor(md, ms, (n, hidden), dtype)


__all__ = ["HIDDEN_MULTIPLE", "UNQUANTIZED", "OutputFormat", "WireFormat", "pack", "row_bytes", "unpack", "views",
           "wire_dtype"]
