"""Gathered row sums: the MoE layer's combine and the dispatch's gradient (sums over a token's expert rows),
as one Triton kernel, its launcher, and the pure-torch reference with the same signature.

``gather_sum(rows, slots)``: rows [N, H], slots int [M, S] -> out [M, H] with

    out[m] = round(0 + rows[slots[m, 0]] + rows[slots[m, 1]] + ... + rows[slots[m, S-1]])

summed in float32 from left to right, rounded once to rows' dtype; a slot outside [0, N) is empty (adds
nothing). This replaces ``torch.zeros(M, H, float32).index_add_(0, dst, rows.float()).to(dtype)``: each row
of ``rows`` is read once and each output row written once, with no float32 [M, H] buffer to zero and cast,
and no atomics, so the result does not depend on the order in which the GPU's threads arrive. With each
output's slots in ascending row order the sum is index_add_'s sequential one (as on CPU) bit for bit.

``gather_sum_fp8(data, scale, slots, dtype)`` takes the rows as they arrive on an FP8 wire (1x128 codes and
float32 scales, strided views of the wire buffer) and decodes them in registers: the same bits as decoding the
rows to ``dtype`` first (``dequantize_fp8_ref``) and summing those, without writing and reading the decoded
[N, H] rows (the combine's and the dispatch gradient's sums when those exchanges are FP8). MXFP4 rows have no
such kernel: decoding them inside the sum is slower than ``dequantize_mxfp4`` (a Triton kernel) followed by
``gather_sum`` (bench/RESULTS.md).

The decode saturates, as every decode does (numerics.to_output: a row value past dtype's largest finite
magnitude becomes it); the sum does not: a float32 sum past dtype's range rounds to Inf, as index_add_'s does.
NaN results are the canonical NaN of the output dtype (numerics.NAN_BITS) in both twins: the GPU's float32
addition keeps one operand's NaN payload, and float32 -> bf16 conversions differ in what they keep.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_fp4.kernels.fp8 import dequantize_fp8_ref
from moe_fp4.kernels.numerics import FP8_TILE, with_canonical_nan
from moe_fp4.kernels.triton_numerics import e4m3_to_f32_bits, f32_to_out_bits, in_bits_to_f32_bits, tl_dtype

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The twin also sums float64 rows (in float64): the routing's exact-gradient tests run in float64.
_REF_DTYPES = _FLOAT_DTYPES + (torch.float64,)
_INDEX_DTYPES = (torch.int32, torch.int64)
# The integer type the output's bits are stored as.
_BITS_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _check_inputs(name: str, rows: torch.Tensor, slots: torch.Tensor, dtypes=_FLOAT_DTYPES) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise ValueError(f"{name}: rows must be a 2-D tensor [N, H], got {getattr(rows, 'shape', type(rows))}")
    if rows.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}: rows must be one of {names}, got {rows.dtype}")
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        raise ValueError(f"{name}: rows' columns must be contiguous (stride 1), got strides {rows.stride()}")
    if not isinstance(slots, torch.Tensor) or slots.dim() != 2:
        raise ValueError(f"{name}: slots must be a 2-D tensor [M, S], got {getattr(slots, 'shape', type(slots))}")
    if slots.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name}: slots must be int32 or int64, got {slots.dtype}")
    if slots.device != rows.device:
        raise ValueError(f"{name}: rows on {rows.device} and slots on {slots.device}")


def gather_sum_ref(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """rows: bf16/fp16/fp32 [N, H] (columns contiguous, any row stride); slots: int32/int64 [M, S], any
    strides, an entry outside [0, N) empty -> rows.dtype [M, H], out[m] = the float32 sum over j = 0..S-1 of
    rows[slots[m, j]] from left to right, rounded once (NaN canonical). float64 rows (this twin only) are
    summed in float64."""
    _check_inputs("gather_sum_ref", rows, slots, _REF_DTYPES)
    n, h = rows.shape
    m, s = slots.shape
    acc_dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    acc = torch.zeros(m, h, dtype=acc_dtype, device=rows.device)
    if n == 0 or m == 0 or h == 0:
        return acc.to(rows.dtype)
    idx = slots.long()
    valid = (idx >= 0) & (idx < n)
    idx = torch.where(valid, idx, 0)
    for j in range(s):
        x = rows.index_select(0, idx[:, j]).to(acc_dtype)
        # where, not a product: an empty slot over a NaN or Inf row must add 0, not NaN
        acc = acc + torch.where(valid[:, j, None], x, 0.0)
    if acc_dtype == torch.float64:
        return acc
    return with_canonical_nan(acc.to(rows.dtype), torch.isnan(acc))


@triton.jit
def _gather_sum_kernel(x_ptr, sc_ptr, s_ptr, o_ptr, M, N, H, S, stride_x, stride_sc, stride_sc1, stride_sm, stride_ss,
                       stride_o, IN_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    # one program: BLOCK_M output rows x BLOCK_H columns; each slot's row chunk gathered and added in turn.
    # IN_DTYPE tl.float8e4nv: x holds E4M3 codes and sc their float32 1x128 tile scales, decoded here as
    # dequantize_fp8_ref does; BLOCK_H divides 128, so a program's columns lie in one tile and each row's
    # scale is loaded once per program, not once per element (bench/tools/ep_sums.py). Otherwise IN_DTYPE is
    # OUT_DTYPE (the rows' dtype).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < M
    cmask = cols < H
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    for j in range(S):
        idx = tl.load(s_ptr + rows64 * stride_sm + j * stride_ss, mask=rmask, other=-1).to(tl.int64)
        ok = rmask & (idx >= 0) & (idx < N)
        m2 = ok[:, None] & cmask[None, :]
        if IN_DTYPE == tl.float8e4nv:
            # masked-off codes load 0 under scale 1: +0, which adds nothing
            b = tl.load(x_ptr + idx[:, None] * stride_x + cols[None, :], mask=m2, other=0).to(tl.int32)
            tile = (tl.program_id(1) * BLOCK_H) // 128   # 128: FP8_TILE
            sc = tl.load(sc_ptr + idx * stride_sc + tile * stride_sc1, mask=ok, other=1.0)
            v = e4m3_to_f32_bits(b).to(tl.float32, bitcast=True) * sc[:, None]   # exact: sc is a power of two
            nan = tl.full(v.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
            # v rounded to the output dtype and saturated, as a decode to that dtype gives it
            dec = in_bits_to_f32_bits(f32_to_out_bits(v, False, OUT_DTYPE), OUT_DTYPE).to(tl.float32, bitcast=True)
            acc += tl.where((b & 0x7F) == 0x7F, nan, dec)
        else:
            acc += tl.load(x_ptr + idx[:, None] * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    # the sums' bits, NaN canonical, rounded without saturation (a sum's overflow is Inf)
    bits = f32_to_out_bits(acc, acc != acc, OUT_DTYPE, SATURATE=False)
    if OUT_DTYPE != tl.float32:
        bits = bits.to(tl.int16)
    tl.store(o_ptr + rows64[:, None] * stride_o + cols[None, :], bits, mask=rmask[:, None] & cmask[None, :])


def gather_sum(rows: torch.Tensor, slots: torch.Tensor, block_m: int = 16, block_h: int = 256,
               num_warps: int = 4) -> torch.Tensor:
    """As :func:`gather_sum_ref` (the same arguments and result, bit for bit), in one Triton kernel."""
    _check_inputs("gather_sum", rows, slots)
    n, h = rows.shape
    m, s = slots.shape
    out = torch.empty(m, h, dtype=rows.dtype, device=rows.device)
    if m == 0 or h == 0:
        return out
    if n == 0 or s == 0:
        return out.zero_()
    bits = out.view(_BITS_OF[rows.dtype])   # stored as bits: the canonical NaN written as an integer
    grid = (triton.cdiv(m, block_m), triton.cdiv(h, block_h))
    _gather_sum_kernel[grid](rows, rows, slots, bits, m, n, h, s, rows.stride(0), 0, 0, slots.stride(0),
                             slots.stride(1), out.stride(0), IN_DTYPE=tl_dtype(rows.dtype),
                             OUT_DTYPE=tl_dtype(rows.dtype), BLOCK_M=block_m, BLOCK_H=block_h, num_warps=num_warps)
    return out


def _check_fp8_rows(name: str, data: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, dtype) -> int:
    """-> H. data: bytes [N, H] (columns contiguous), scale: float32 [N, H/128], slots: int [M, S]."""
    if not isinstance(data, torch.Tensor) or data.dim() != 2 or data.element_size() != 1:
        raise ValueError(f"{name}: data must be a 2-D tensor of bytes [N, H], got "
                         f"{getattr(data, 'dtype', type(data))} {tuple(getattr(data, 'shape', ()))}")
    n, h = data.shape
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != (n, h // FP8_TILE):
        raise ValueError(f"{name}: scale must be torch.float32 [{n}, {h // FP8_TILE}] for data "
                         f"{tuple(data.shape)}, got {getattr(scale, 'dtype', type(scale))} "
                         f"{tuple(getattr(scale, 'shape', ()))}")
    if h % FP8_TILE:
        raise ValueError(f"{name}: H = {h} must be a multiple of {FP8_TILE}")
    if data.shape[1] > 1 and data.stride(1) != 1:
        raise ValueError(f"{name}: data's columns must be contiguous (stride 1), got strides {data.stride()}")
    for what, t in (("data", data), ("scale", scale)):
        if t.device != slots.device:
            raise ValueError(f"{name}: {what} on {t.device} and slots on {slots.device}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: dtype must be bfloat16, float16 or float32, got {dtype}")
    if not isinstance(slots, torch.Tensor) or slots.dim() != 2 or slots.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name}: slots must be an int32 or int64 tensor [M, S], got "
                         f"{getattr(slots, 'dtype', type(slots))} {tuple(getattr(slots, 'shape', ()))}")
    return h


def gather_sum_fp8_ref(data: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor,
                       dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """data: float8_e4m3fn or uint8 [N, H] FP8 codes, scale: float32 [N, H/128] (one per 1x128 tile), any row
    strides (the scales' any layout: row-major on the wire, M-major from the quantizer); slots: int32/int64 [M, S]
    -> dtype [M, H]: :func:`gather_sum_ref` of the rows decoded to dtype."""
    _check_fp8_rows("gather_sum_fp8_ref", data, scale, slots, dtype)
    rows = dequantize_fp8_ref(data.contiguous().view(torch.float8_e4m3fn), scale.contiguous(), dtype)
    return gather_sum_ref(rows, slots)


def gather_sum_fp8(data: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor,
                   dtype: torch.dtype = torch.bfloat16, block_m: int = 32, block_h: int = 128,
                   num_warps: int = 4) -> torch.Tensor:
    """As :func:`gather_sum_fp8_ref` (bit for bit), in one Triton kernel: the codes decoded in registers.
    ``block_h`` must divide 128 (a program's columns in one scale tile)."""
    h = _check_fp8_rows("gather_sum_fp8", data, scale, slots, dtype)
    if block_h > FP8_TILE or FP8_TILE % block_h:
        raise ValueError(f"gather_sum_fp8: block_h must divide {FP8_TILE}, got {block_h}")
    n, m, s = data.shape[0], *slots.shape
    out = torch.empty(m, h, dtype=dtype, device=data.device)
    if m == 0 or h == 0:
        return out
    if n == 0 or s == 0:
        return out.zero_()
    grid = (triton.cdiv(m, block_m), triton.cdiv(h, block_h))
    _gather_sum_kernel[grid](data.view(torch.uint8), scale, slots, out.view(_BITS_OF[dtype]), m, n, h, s,
                             data.stride(0), scale.stride(0), scale.stride(1), slots.stride(0), slots.stride(1),
                             out.stride(0), IN_DTYPE=tl_dtype(torch.float8_e4m3fn), OUT_DTYPE=tl_dtype(dtype),
                             BLOCK_M=block_m, BLOCK_H=block_h, num_warps=num_warps)
    return out
