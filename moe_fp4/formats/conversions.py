"""Public conversions: validate the input, then run the implementation for its device.

Every function here has a twin with the same signature in :mod:`moe_fp4.formats.reference` (pure torch,
no validation). CUDA tensors run the Triton kernels; CPU tensors run the reference, or the Triton
kernels under the interpreter when ``TRITON_INTERPRET=1`` is set (before triton is imported).
"""

from __future__ import annotations

import os

import torch

from moe_fp4.formats import _ops
from moe_fp4.formats.containers import (
    HIGH_PRECISION_DTYPES,
    FP8BlockTensor,
    MXFP4Tensor,
    NVFP4Tensor,
    check_fp8_scale_values,
    check_values_enabled,
    register_dequantizer,
)
from moe_fp4.kernels import row_sum as _row_sum
from moe_fp4.kernels.numerics import FP8_TILE, MXFP4_BLOCK, Rounding

# Read once, like triton.jit itself, which decides at decoration time whether to interpret.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or _INTERPRET


def conversion_path(device) -> str:
    """What runs the conversions on ``device``: "Triton kernels", "Triton kernels in the interpreter"
    (CPU with TRITON_INTERPRET=1 set before moe_fp4 was imported) or "pure-torch references"."""
    if torch.device(device).type == "cuda":
        return "Triton kernels"
    return "Triton kernels in the interpreter" if _INTERPRET else "pure-torch references"


def _check_high_precision(x, fn: str, multiple: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{fn}: expected a bfloat16/float16/float32 tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{fn}: expected a tensor of shape [..., K], got a 0-d tensor")
    if x.shape[-1] % multiple != 0:
        raise ValueError(f"{fn}: the last dimension K = {x.shape[-1]} must be a multiple of {multiple}")
    if not x.is_contiguous():
        raise ValueError(f"{fn}: the input must be contiguous (got strides {x.stride()}); call .contiguous() first")


def _check_out_dtype(dtype, fn: str) -> None:
    if dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{fn}: output dtype must be bfloat16, float16 or float32, got {dtype}")


def _check_container(t, cls, fn: str) -> None:
    if not isinstance(t, cls):
        raise TypeError(f"{fn}: expected {cls.__name__}, got {type(t).__name__}")


def _check_fp8(t: FP8BlockTensor, fn: str, full_tiles: bool) -> None:
    _check_container(t, FP8BlockTensor, fn)
    if full_tiles and t.k % FP8_TILE != 0:
        raise ValueError(f"{fn}: K = {t.k} must be a multiple of {FP8_TILE} (whole 1x128 tiles)")
    if check_values_enabled(t.scale):
        check_fp8_scale_values(t.scale, f"{fn}: FP8BlockTensor.scale")


def _check_rounding(fn: str, rounding, seed, step, rank) -> Rounding:
    try:
        rounding = Rounding(rounding)
    except ValueError:
        raise ValueError(f"{fn}: rounding must be one of {', '.join(r.value for r in Rounding)}, got {rounding!r}") \
            from None
    for name, v in (("seed", seed), ("step", step), ("rank", rank)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < (2**64 if name == "seed" else 2**32):
            raise TypeError(f"{fn}: {name} must be an int in [0, 2^{64 if name == 'seed' else 32}), got {v!r}")
    return rounding


def quantize_mxfp4(x: torch.Tensor | FP8BlockTensor, rounding: str | Rounding = "nearest", seed: int = 0,
                   step: int = 0, rank: int = 0) -> MXFP4Tensor:
    """Quantize to MXFP4 in 32-element blocks along the last dimension.

    x: bf16/fp16/fp32 [..., K] (K % 32 == 0, contiguous), or an FP8BlockTensor [M, K] (K % 128 == 0),
    which is converted directly on its codes (no BF16/FP32 tensor is formed)
    -> MXFP4Tensor (data uint8 [M, K/2], scale uint8 [M, K/32]) of x's logical shape and dtype.
    rounding: "nearest" (ties to even), or "stochastic" (bf16/fp16/fp32 input): unbiased, from 16 Philox
    bits per element of (seed, step, rank, element offset), reproducible (``kernels.numerics.random_bits``
    and ``encode_e2m1_stochastic``; a Triton kernel on CUDA, bit-identical to the reference).
    """
    rounding = _check_rounding("quantize_mxfp4", rounding, seed, step, rank)
    if isinstance(x, FP8BlockTensor):
        if rounding is Rounding.STOCHASTIC:
            raise ValueError("quantize_mxfp4: stochastic rounding takes a bf16/fp16/fp32 tensor, not FP8BlockTensor")
        _check_fp8(x, "quantize_mxfp4", full_tiles=True)
    else:
        _check_high_precision(x, "quantize_mxfp4", MXFP4_BLOCK)
    return _ops.quantize_mxfp4(x, _use_triton(x.data if isinstance(x, FP8BlockTensor) else x), rounding, seed, step,
                               rank)


@register_dequantizer
def dequantize_mxfp4(q: MXFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q: MXFP4Tensor [M, K] -> dtype tensor of q.shape (exact in float32; NaN blocks give NaN; a value
    past dtype's largest finite magnitude saturates to it, docs/formats.md)."""
    _check_container(q, MXFP4Tensor, "dequantize_mxfp4")
    _check_out_dtype(dtype, "dequantize_mxfp4")
    return _ops.dequantize_mxfp4(q, dtype, use_triton=_use_triton(q.data))


def quantize_fp8(x: torch.Tensor) -> FP8BlockTensor:
    """Quantize to FP8 E4M3 in 1x128 tiles along the last dimension with power-of-two scales.

    x: bf16/fp16/fp32 [..., K] (K % 128 == 0, contiguous)
    -> FP8BlockTensor (data float8_e4m3fn [M, K], scale float32 [M, K/128] M-major).
    """
    _check_high_precision(x, "quantize_fp8", FP8_TILE)
    return _ops.quantize_fp8(x, use_triton=_use_triton(x))


@register_dequantizer
def dequantize_fp8(t: FP8BlockTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """t: FP8BlockTensor [M, K] -> dtype tensor of t.shape (data * scale, exact in float32; a value past
    dtype's largest finite magnitude saturates to it, docs/formats.md)."""
    _check_fp8(t, "dequantize_fp8", full_tiles=False)
    _check_out_dtype(dtype, "dequantize_fp8")
    return _ops.dequantize_fp8(t, dtype)


def mxfp4_to_fp8(q: MXFP4Tensor) -> FP8BlockTensor:
    """Direct MXFP4 -> FP8 row-wise: q [M, K] (K % 128 == 0) -> FP8BlockTensor [M, K].

    Each 1x128 tile (four MXFP4 blocks) gets S = max(E) - 6. Exact for blocks within 14 binades of
    the tile's largest block; blocks further below round (RNE) into E4M3 subnormals or to signed zero.
    """
    _check_container(q, MXFP4Tensor, "mxfp4_to_fp8")
    if q.k % FP8_TILE != 0:
        raise ValueError(f"mxfp4_to_fp8: K = {q.k} must be a multiple of {FP8_TILE} (whole 1x128 tiles)")
    return _ops.mxfp4_to_fp8(q, use_triton=_use_triton(q.data))


def mxfp4_to_fp8_colwise(q: MXFP4Tensor, rows: torch.Tensor | None = None) -> FP8BlockTensor:
    """Scaling-aware row -> column conversion: q [M, K] (any M) -> FP8BlockTensor [K, M] holding q^T,
    quantized in 1x128 tiles along M (the last tile may be short) from each column's true amax.
    Bit-identical to dequantize -> transpose -> quantize_fp8 along tokens.

    rows: optional int32/int64 [M'] indices of q's rows -> [K, M'] of the rows q[rows], read in place
    (no gathered copy), e.g. a token's MXFP4 row once for each of its k expert rows. Checked in range
    here (a device sync); moe_fp4's layer passes its own routing's rows to the kernel directly.
    """
    _check_container(q, MXFP4Tensor, "mxfp4_to_fp8_colwise")
    if rows is not None:
        if not isinstance(rows, torch.Tensor) or rows.dtype not in (torch.int32, torch.int64) or rows.dim() != 1:
            raise TypeError(f"mxfp4_to_fp8_colwise: rows must be a 1-D int32/int64 tensor, got "
                            f"{getattr(rows, 'dtype', type(rows))} {tuple(getattr(rows, 'shape', ()))}")
        if rows.device != q.data.device:
            raise ValueError(f"mxfp4_to_fp8_colwise: rows is on {rows.device}, q on {q.data.device}")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= q.m):
            raise ValueError(f"mxfp4_to_fp8_colwise: rows must index q's {q.m} rows, got values in "
                             f"[{int(rows.min())}, {int(rows.max())}]")
    return _ops.mxfp4_to_fp8_colwise(q, use_triton=_use_triton(q.data), rows=rows)


def quantize_fp8_and_mxfp4(x: torch.Tensor) -> tuple[FP8BlockTensor, MXFP4Tensor]:
    """Fused FP8 row-wise + MXFP4 quantization of one input, for a tensor that feeds an FP8 GEMM now
    and is saved for backward: x bf16/fp16/fp32 [..., K] (K % 128 == 0, contiguous)
    -> (FP8BlockTensor [M, K], MXFP4Tensor [M, K]), each identical to its standalone quantization.
    """
    _check_high_precision(x, "quantize_fp8_and_mxfp4", FP8_TILE)
    return _ops.quantize_fp8_and_mxfp4(x, use_triton=_use_triton(x))


def fp8_to_fp8_colwise(t: FP8BlockTensor) -> FP8BlockTensor:
    """FP8 row -> column conversion for the FP8 baseline's weight gradient: t [M, K] (K % 128 == 0,
    any M) -> FP8BlockTensor [K, M] holding t^T in 1x128 tiles along M. Bit-identical to dequantize ->
    transpose -> quantize_fp8 along tokens.
    """
    _check_fp8(t, "fp8_to_fp8_colwise", full_tiles=True)
    return _ops.fp8_to_fp8_colwise(t, use_triton=_use_triton(t.data))


def quantize_nvfp4(x: torch.Tensor | FP8BlockTensor, tensor_scale: torch.Tensor | None = None,
                   rounding: str | Rounding = "nearest", seed: int = 0, step: int = 0, rank: int = 0) -> NVFP4Tensor:
    """Quantize to NVFP4 in 16-element blocks along the last dimension (rules: ``moe_fp4.kernels.nvfp4``).

    x: bf16/fp16/fp32 [..., K] (K % 16 == 0, contiguous), or an FP8BlockTensor [M, K] (K % 128 == 0),
    quantized from its exact values on the codes (rule 5: the same bytes as quantizing its float32
    dequantization, without forming it); tensor_scale: float32 0-d on x's device, a positive float32
    normal (default: max(amax / 2688, 2^-126) of x's finite values)
    -> NVFP4Tensor (data uint8 [M, K/2], scale float8_e4m3fn [M, K/16], tensor_scale) of x's shape and
    dtype. rounding, seed, step, rank: as for :func:`quantize_mxfp4` (stochastic rounding of the
    elements; the scales are the same). Triton kernels on CUDA (the tensor scale in one pass, the blocks
    in another), bit-identical to the pure-torch reference.
    """
    from moe_fp4.kernels import nvfp4

    rounding = _check_rounding("quantize_nvfp4", rounding, seed, step, rank)
    if isinstance(x, FP8BlockTensor):
        _check_fp8(x, "quantize_nvfp4", full_tiles=True)
        dev = x.data.device
    else:
        _check_high_precision(x, "quantize_nvfp4", nvfp4.NVFP4_BLOCK)
        dev = x.device
    if tensor_scale is not None:
        if not isinstance(tensor_scale, torch.Tensor) or tensor_scale.dtype != torch.float32 or tensor_scale.dim():
            raise TypeError(f"quantize_nvfp4: tensor_scale must be a float32 0-d tensor, got "
                            f"{getattr(tensor_scale, 'dtype', type(tensor_scale))}")
        if tensor_scale.device != dev:
            raise ValueError(f"quantize_nvfp4: tensor_scale on {tensor_scale.device}, x on {dev}")
        if check_values_enabled(tensor_scale):
            v = float(tensor_scale)
            if not (v >= nvfp4.NVFP4_TENSOR_SCALE_MIN and v < float("inf")):
                raise ValueError(f"quantize_nvfp4: tensor_scale must be a finite float32 normal > 0, got {v!r}")
    return _ops.quantize_nvfp4(x, tensor_scale, _use_triton(x.data if isinstance(x, FP8BlockTensor) else x),
                               rounding, seed, step, rank)


@register_dequantizer
def dequantize_nvfp4(q: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q: NVFP4Tensor -> dtype tensor of q.shape: e2m1 * e4m3 * s_t in float32, rounded once to dtype and
    saturated at its largest finite magnitude; NaN blocks give NaN. A Triton kernel on CUDA, bit-identical
    to the pure-torch reference."""
    _check_container(q, NVFP4Tensor, "dequantize_nvfp4")
    _check_out_dtype(dtype, "dequantize_nvfp4")
    return _ops.dequantize_nvfp4(q, dtype, _use_triton(q.data))


def _check_nvfp4_tiles(q, fn: str) -> None:
    _check_container(q, NVFP4Tensor, fn)
    if q.k % FP8_TILE != 0:
        raise ValueError(f"{fn}: K = {q.k} must be a multiple of {FP8_TILE} (whole 1x128 tiles)")


def nvfp4_to_fp8(q: NVFP4Tensor) -> FP8BlockTensor:
    """NVFP4 -> FP8 row-wise for the FP8 GEMMs: q [M, K] (K % 128 == 0) -> FP8BlockTensor [M, K]: the FP8
    1x128 quantization (power-of-two scale per tile, RNE) of q's float32 values, in one pass (rule 6 of
    ``moe_fp4.kernels.nvfp4``). Not exact in general: each element moves by at most half an E4M3 step,
    2^-4 of its value in E4M3's normal range (how often, on real activations: bench/RESULTS.md)."""
    _check_nvfp4_tiles(q, "nvfp4_to_fp8")
    return _ops.nvfp4_to_fp8(q, use_triton=_use_triton(q.data))


def nvfp4_to_fp8_colwise(q: NVFP4Tensor) -> FP8BlockTensor:
    """NVFP4 row -> FP8 column conversion for a weight gradient: q [M, K] (any M) -> FP8BlockTensor
    [K, M] holding q^T in 1x128 tiles along M (the last tile may be short). Bit-identical to dequantize
    (float32) -> transpose -> quantize_fp8 along tokens; one Triton pass on CUDA."""
    _check_container(q, NVFP4Tensor, "nvfp4_to_fp8_colwise")
    return _ops.nvfp4_to_fp8_colwise(q, use_triton=_use_triton(q.data))


def gather_sum(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """rows: bf16/fp16/fp32 [N, H] (columns contiguous); slots: int32/int64 [M, S], an entry outside [0, N)
    empty -> rows.dtype [M, H]: out[m] = the float32 sum of rows[slots[m, 0]], ..., rows[slots[m, S-1]] in
    that order, rounded once (NaN canonical). The MoE combine's and the dispatch gradient's sums over a
    token's expert rows: each row read once, no atomics (``moe_fp4.kernels.row_sum``); one Triton pass on
    CUDA, bit-identical to its pure-torch twin. float64 rows (the routing's exact tests) go to the twin. Rows
    whose columns are strided (a gradient autograd hands over as a view) are made contiguous first."""
    if rows.dim() == 2 and rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return _ops._pick(_row_sum, "gather_sum", _use_triton(rows) and rows.dtype != torch.float64)(rows, slots)


__all__ = ["conversion_path", "dequantize_fp8", "dequantize_mxfp4", "dequantize_nvfp4", "fp8_to_fp8_colwise",
           "gather_sum", "mxfp4_to_fp8", "mxfp4_to_fp8_colwise", "nvfp4_to_fp8", "nvfp4_to_fp8_colwise", "quantize_fp8",
           "quantize_fp8_and_mxfp4", "quantize_mxfp4", "quantize_nvfp4"]
