"""The all-to-all wire format: one uint8 row per token, values and scales side by side.

| format  | row bytes (hidden H)            | layout                                            |
| ------- | ------------------------------- | ------------------------------------------------- |
| `mxfp4` | H/2 + H/32 (7168: 3808)         | `[E2M1 codes, 2 per byte | E8M0 scale per 32]`      |
| `nvfp4` | H/2 + H/16 + 4 (7168: 4036)     | `[E2M1 codes | E4M3 scale per 16 | float32 tensor scale]` |
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

``mxfp4-sr`` and ``nvfp4-sr`` are the same rows with the E2M1 codes rounded stochastically:
for gradients, unbiased. Their random bits come from (seed, step, rank, element): the seed set by
:func:`seed_stochastic_rounding` (0 by default), the step a counter of stochastic packs in this process
(every rank counts the same exchanges), the rank the sender's. An NVFP4 row carries its sender's tensor
scale, so rows from several ranks decode each with its own.
"""

from __future__ import annotations

import torch

from moe_fp4.formats._ops import _pick
from moe_fp4.formats.choices import Choice
from moe_fp4.formats.containers import HIGH_PRECISION_DTYPES, FP8BlockTensor, MXFP4Tensor, NVFP4Tensor
from moe_fp4.formats.conversions import _use_triton, gather_sum, mxfp4_to_fp8, quantize_fp8, quantize_mxfp4
from moe_fp4.kernels import fp8 as _fp8
from moe_fp4.kernels import mxfp4 as _mxfp4
from moe_fp4.kernels import nvfp4 as _nvfp4
from moe_fp4.kernels import row_sum as _row_sum
from moe_fp4.kernels.fp8 import dequantize_fp8_ref, m_major
from moe_fp4.kernels.numerics import FP8_TILE, MXFP4_BLOCK, Rounding


class WireFormat(Choice):
    """How values (or their gradients) travel between ranks."""

    __parameter__ = "wire format"

    MXFP4 = "mxfp4"  # 4.25 bits per element
    FP8 = "fp8"      # E4M3 in 1x128 tiles with float32 power-of-two scales: 8.25 bits
    BF16 = "bf16"    # bfloat16 (round to nearest even), back to the tensor's dtype on arrival: 16 bits
    NATIVE = "native"  # unchanged, in the tensor's own dtype (float32: 32 bits)
    NVFP4 = "nvfp4"  # E2M1, an E4M3 scale per 16, the sender's float32 tensor scale per row: 4.5 bits + 4 bytes
    MXFP4_SR = "mxfp4-sr"  # mxfp4 rows, the codes rounded stochastically (gradients)
    NVFP4_SR = "nvfp4-sr"  # nvfp4 rows, the codes rounded stochastically (gradients)


class OutputFormat(Choice):
    """What the receiving side returns."""

    __parameter__ = "output"

    BF16 = "bf16"    # the input's float dtype
    FP8 = "fp8"      # FP8BlockTensor (direct MXFP4 -> FP8 for an MXFP4 wire)
    MXFP4 = "mxfp4"  # MXFP4Tensor (as received for an MXFP4 wire)


# Block the hidden size must be a multiple of, per wire format.
HIDDEN_MULTIPLE = {WireFormat.MXFP4: MXFP4_BLOCK, WireFormat.FP8: FP8_TILE, WireFormat.BF16: 1, WireFormat.NATIVE: 1,
                   WireFormat.NVFP4: _nvfp4.NVFP4_BLOCK, WireFormat.MXFP4_SR: MXFP4_BLOCK,
                   WireFormat.NVFP4_SR: _nvfp4.NVFP4_BLOCK}
# Wire formats that send the values unquantized (no scales).
UNQUANTIZED = (WireFormat.BF16, WireFormat.NATIVE)
# Stochastically rounded formats: for gradients only (configs reject them for values), and the
# nearest-rounding format whose rows they share.
STOCHASTIC = {WireFormat.MXFP4_SR: WireFormat.MXFP4, WireFormat.NVFP4_SR: WireFormat.NVFP4}
# The formats a layer's dispatch (values into the expert GEMMs) can travel in: NVFP4 rows are converted
# to FP8 1x128 on arrival (nvfp4_to_fp8, each row with its sender's tensor scale).
DISPATCH_FORMATS = (WireFormat.MXFP4, WireFormat.FP8, WireFormat.BF16, WireFormat.NATIVE, WireFormat.NVFP4)

_SR = {"seed": 0, "step": 0}


def seed_stochastic_rounding(seed: int) -> None:
    """Seed the stochastic wire formats' random bits (an int in [0, 2^64)) and restart their step count:
    a run that calls this with the same seed before the same exchanges sends the same bytes."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise TypeError(f"seed_stochastic_rounding: seed must be an int in [0, 2^64), got {seed!r}")
    _SR["seed"], _SR["step"] = seed, 0


def _next_sr_step() -> tuple[int, int]:
    """-> (seed, step) for the next stochastic pack; steps count from 0 and wrap at 2^32."""
    step = _SR["step"]
    _SR["step"] = (step + 1) % 2**32
    return _SR["seed"], step


def base_format(fmt: WireFormat) -> WireFormat:
    """The format whose rows ``fmt`` sends (mxfp4-sr -> mxfp4, nvfp4-sr -> nvfp4, others themselves)."""
    fmt = WireFormat(fmt)
    return STOCHASTIC.get(fmt, fmt)


def wire_dtype(fmt: WireFormat, dtype: torch.dtype) -> torch.dtype | None:
    """The element dtype an unquantized wire carries for tensors of ``dtype`` (None if quantized)."""
    fmt = WireFormat(fmt)
    if fmt is WireFormat.BF16:
        return torch.bfloat16
    return dtype if fmt is WireFormat.NATIVE else None


def row_bytes(fmt: WireFormat, hidden: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes per row on the wire for ``hidden`` values of ``dtype`` (dtype matters for native only)."""
    fmt = base_format(fmt)
    if fmt is WireFormat.MXFP4:
        return hidden // 2 + hidden // MXFP4_BLOCK
    if fmt is WireFormat.NVFP4:
        return hidden // 2 + hidden // _nvfp4.NVFP4_BLOCK + 4
    if fmt is WireFormat.FP8:
        return hidden + 4 * (hidden // FP8_TILE)
    return hidden * wire_dtype(fmt, dtype).itemsize


def views(wire: torch.Tensor, fmt: WireFormat, hidden: int, dtype: torch.dtype = torch.bfloat16):
    """wire: uint8 [N, >= row_bytes] -> the payload columns as typed, row-strided views:
    mxfp4 (codes uint8 [N, H/2], scales uint8 [N, H/32]); nvfp4 (codes uint8 [N, H/2], scales uint8
    [N, H/16 + 4]: the E4M3 bytes, then the 4 bytes of the float32 tensor scale); fp8 (codes
    float8_e4m3fn [N, H], scales float32 [N, H/128]); bf16 (values bfloat16 [N, H], None); native
    (values dtype [N, H], None); the -sr formats as their rows'. The row stride must suit the widest
    view (a multiple of 4 bytes for fp8 scales, of the itemsize for the unquantized ones)."""
    fmt = base_format(fmt)
    if fmt is WireFormat.MXFP4:
        half = hidden // 2
        return wire[:, :half], wire[:, half:half + hidden // MXFP4_BLOCK]
    if fmt is WireFormat.NVFP4:
        half = hidden // 2
        return wire[:, :half], wire[:, half:half + hidden // _nvfp4.NVFP4_BLOCK + 4]
    if fmt is WireFormat.FP8:
        codes = wire[:, :hidden].view(torch.float8_e4m3fn)
        return codes, wire[:, hidden:hidden + 4 * (hidden // FP8_TILE)].view(torch.float32)
    values = wire_dtype(fmt, dtype)
    return wire[:, :hidden * values.itemsize].view(values), None


def _float_rows(x) -> torch.Tensor:
    if isinstance(x, (MXFP4Tensor, FP8BlockTensor, NVFP4Tensor)):
        return x.dequantize(x.dtype).reshape(x.m, x.k)
    return x


def _pack_stochastic_or_nvfp4(x, fmt: WireFormat, out: torch.Tensor, rank: int) -> torch.Tensor:
    """pack for nvfp4, mxfp4-sr and nvfp4-sr: the quantizer writes straight into the rows (a kernel on
    CUDA). FP8 rows go to NVFP4 on their codes (rule 5 of kernels.nvfp4); MXFP4 rows, and FP8 rows for
    mxfp4-sr, are decoded to floats first."""
    hidden = x.k if isinstance(x, (MXFP4Tensor, FP8BlockTensor, NVFP4Tensor)) else x.shape[1]
    dst = views(out, fmt, hidden)
    nb = hidden // _nvfp4.NVFP4_BLOCK
    # The stochastic formats take the next step of the random bits' counter; nvfp4 rounds to nearest.
    seed, step = _next_sr_step() if fmt in STOCHASTIC else (0, 0)
    rounding = Rounding.STOCHASTIC if fmt in STOCHASTIC else Rounding.NEAREST
    if isinstance(x, NVFP4Tensor) and fmt is WireFormat.NVFP4:
        dst[0].copy_(x.data)                                   # already in the wire's format: copied
        dst[1][:, :nb].copy_(x.scale.view(torch.uint8))
        s_t = x.tensor_scale
    elif isinstance(x, FP8BlockTensor) and fmt is not WireFormat.MXFP4_SR:
        s_t = _pick(_nvfp4, "quantize_nvfp4_from_fp8", _use_triton(x.data))(
            x.data, x.scale, None, rounding, seed, step, rank, out=(dst[0], dst[1][:, :nb]))[2]
    else:
        rows = _float_rows(x)
        tri = _use_triton(rows)
        if fmt is WireFormat.MXFP4_SR:
            _pick(_mxfp4, "quantize_mxfp4_stochastic", tri)(rows, seed, step, rank, out=dst)
            return out
        s_t = _pick(_nvfp4, "quantize_nvfp4", tri)(rows, None, rounding, seed, step, rank,
                                                   out=(dst[0], dst[1][:, :nb]))[2]
    dst[1][:, nb:].copy_(s_t.reshape(1).view(torch.uint8).expand(dst[1].shape[0], 4))
    return out


def pack(x, fmt: WireFormat, out: torch.Tensor | None = None, rank: int = 0) -> torch.Tensor:
    """x: float [N, H] (contiguous), FP8BlockTensor, MXFP4Tensor or NVFP4Tensor [N, H] -> uint8 [N, B]
    wire rows.

    A float input is quantized into the rows in one pass; a container of the wire's own format is
    copied as is (no re-quantization); other containers are converted directly (FP8 <-> MXFP4, FP8 ->
    nvfp4 / nvfp4-sr on the codes) or, otherwise, decoded and quantized again. ``out``: an existing uint8
    [N, >= B] buffer (the EP layer appends routing data after column B); without it a new [N, B] buffer is returned
    (for an unquantized wire whose dtype x already has: a view of x, no copy). ``rank``: the sender's
    rank in the exchange's group, one of the stochastic formats' random-bit counters.
    """
    fmt = WireFormat(fmt)
    if isinstance(x, NVFP4Tensor) and base_format(fmt) is not WireFormat.NVFP4:
        return pack(_float_rows(x), fmt, out, rank)        # decoded, then as a float tensor
    containers = (MXFP4Tensor, FP8BlockTensor, NVFP4Tensor)
    n, hidden = (x.m, x.k) if isinstance(x, containers) else x.shape
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
    if fmt in STOCHASTIC or fmt is WireFormat.NVFP4:
        return _pack_stochastic_or_nvfp4(x, fmt, out, rank)
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
    FP8 -> MXFP4, NVFP4 -> bf16 / FP8, each NVFP4 row with its sender's tensor scale); a copy into
    contiguous containers where they agree.
    """
    fmt, output = base_format(fmt), OutputFormat(output)
    if dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"unpack: dtype must be bfloat16, float16 or float32, got {dtype}")
    n = wire.shape[0]
    d, s = views(wire, fmt, hidden, dtype)
    tri = _use_triton(wire)
    if fmt is WireFormat.NVFP4:
        nb = hidden // _nvfp4.NVFP4_BLOCK
        # Each row decodes with its sender's tensor scale (bytes to float32 through a contiguous copy:
        # the wire's rows need not be 4-byte aligned there).
        s_t = s[:, nb:].contiguous().view(torch.float32).reshape(n)
        if output is OutputFormat.FP8:
            # One pass, rule 6 of kernels.nvfp4: the FP8 1x128 quantization of the float32 values.
            fd, fs = _pick(_nvfp4, "nvfp4_to_fp8_rowwise", tri)(d, s[:, :nb].view(torch.float8_e4m3fn), s_t)
            return FP8BlockTensor(fd, fs, (n, hidden), dtype)
        rows = _pick(_nvfp4, "dequantize_nvfp4", tri)(d, s[:, :nb].view(torch.float8_e4m3fn), s_t, dtype)
        return rows if output is OutputFormat.BF16 else quantize_mxfp4(rows)
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


def unpack_sum(wire: torch.Tensor, fmt: WireFormat, hidden: int, slots: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """wire: uint8 [N, >= B] received rows; slots: int64 [M, S], an entry outside [0, N) empty -> dtype [M, H]:
    out[m] = the float32 sum of the rows slots[m, :] picks, as ``unpack(wire, fmt, hidden, BF16, dtype)`` decodes
    them, rounded once: bit for bit ``gather_sum(unpack(...), slots)``. FP8 rows are decoded inside the sum's
    pass (``kernels.row_sum.gather_sum_fp8``) and an unquantized wire of ``dtype`` is read in place: no decoded
    [N, H] copy written and read again. MXFP4 and NVFP4 rows decode first (for MXFP4 that is the faster path)."""
    base = base_format(fmt)
    if base is WireFormat.FP8:
        d, s = views(wire, base, hidden)
        return _pick(_row_sum, "gather_sum_fp8", _use_triton(wire))(d, s, slots, dtype)
    if base in UNQUANTIZED and wire_dtype(base, dtype) == dtype:
        return gather_sum(views(wire, base, hidden, dtype)[0], slots)
    return gather_sum(unpack(wire, fmt, hidden, OutputFormat.BF16, dtype), slots)


__all__ = ["DISPATCH_FORMATS", "HIDDEN_MULTIPLE", "STOCHASTIC", "UNQUANTIZED", "OutputFormat", "WireFormat",
           "base_format", "pack", "row_bytes", "seed_stochastic_rounding", "unpack", "unpack_sum", "views",
           "wire_dtype"]
