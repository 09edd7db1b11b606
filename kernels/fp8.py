"""Row-wise FP8 1x128 producers and FP8 dequantize: pure-torch references.

Functions take and return plain 2-D tensors; ``moe_fp4.api`` wraps them in the containers. FP8
scales come back in the M-major layout of ``FP8BlockTensor`` (strides (1, M)).
"""

from __future__ import annotations

import torch

from moe_fp4.kernels.numerics import (
    E8M0_BIAS,
    E8M0_NAN,
    FP8_EXP_MAX,
    FP8_EXP_MIN,
    FP8_TILE,
    MXFP4_BLOCK,
    decode_e2m1,
    encode_e4m3,
    exp2_int,
    fp8_scale_exponent,
    tile_amax,
    unpack_nibbles,
)

BLOCKS_PER_TILE = FP8_TILE // MXFP4_BLOCK
# float32 can hold 2^e exactly down to e = -149; a shift further down only multiplies E2M1 values
# (at most 6) that end up far below E4M3's smallest subnormal 2^-9 either way.
_MIN_SHIFT = -149


def m_major(scale: torch.Tensor) -> torch.Tensor:
    """scale: float32 [M, T] (any strides) -> the same values with strides (1, M)."""
    return scale.t().contiguous().t()


def _repeat_tiles(t: torch.Tensor, k: int) -> torch.Tensor:
    """t: [M, ceil(K/128)] -> [M, K]: each tile's value repeated over its columns."""
    return t.repeat_interleave(FP8_TILE, dim=1)[:, :k]


def quantize_fp8_rowwise_ref(x: torch.Tensor):
    """x: bf16/fp16/fp32 [M, K] -> (data float8_e4m3fn [M, K], scale float32 [M, ceil(K/128)] M-major).

    Per 1x128 tile (the last one may be short): S = clamp(ceil(log2(amax/448)), -126, 127) over the
    finite values, data = RNE_E4M3(x * 2^-S). NaN and Inf elements become the NaN byte 0x7F; the rest
    of their tile is quantized normally.
    """
    m, k = x.shape
    xf = x.float()
    s = fp8_scale_exponent(tile_amax(xf, FP8_TILE))
    # x * 2^-S is exact except where it falls under float32's normal range, which is far below
    # E4M3's smallest subnormal (2^-9), so the E4M3 rounding is unaffected.
    data = encode_e4m3(xf * _repeat_tiles(exp2_int(-s), k))
    return data, m_major(exp2_int(s))


def dequantize_fp8_ref(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """data: float8_e4m3fn [M, K], scale: float32 [M, ceil(K/128)] -> dtype [M, K] = data * scale
    (exact in float32 unless the product exceeds float32's range, only possible for scales > 2^120)."""
    m, k = data.shape
    return (data.float() * _repeat_tiles(scale, k)).to(dtype)


def mxfp4_to_fp8_rowwise_ref(data: torch.Tensor, scale: torch.Tensor):
    """Direct MXFP4 -> FP8 1x128 row-wise.

    data: uint8 [M, K/2], scale: uint8 [M, K/32], K % 128 == 0
    -> (data float8_e4m3fn [M, K], scale float32 [M, K/128] M-major).

    Per tile: S = clamp(max(E of its finite blocks) - 6, -126, 127), so the largest value
    (at most 6 * 2^Emax) maps to at most 6 * 64 = 384 < 448; q = RNE_E4M3(c * 2^(E - S)).
    Underflow: every block with E >= Emax - 14 (E - S >= -8) converts exactly, since all E2M1 values
    times 2^-8 are multiples of 2^-9, E4M3's subnormal step. Blocks further below the tile maximum
    round to nearest even into E4M3 subnormals or to a zero of the same sign (0.5 * 2^-9 = 2^-10 is
    a tie and goes to zero). Zero codes stay (signed) zero.
    NaN blocks (0xFF) give the NaN byte 0x7F for their 32 elements; a tile of only NaN blocks gets
    S = -126.
    """
    m, half_k = data.shape
    k = 2 * half_k
    e = scale.to(torch.int32) - E8M0_BIAS
    nan_block = scale == E8M0_NAN
    e_finite = torch.where(nan_block, torch.full_like(e, -(1 << 20)), e)
    emax = e_finite.view(m, k // FP8_TILE, BLOCKS_PER_TILE).amax(dim=-1)
    s = (emax - 6).clamp(FP8_EXP_MIN, FP8_EXP_MAX)
    shift = (e - s.repeat_interleave(BLOCKS_PER_TILE, dim=1)).clamp(min=_MIN_SHIFT)
    vals = decode_e2m1(unpack_nibbles(data)).view(m, k // MXFP4_BLOCK, MXFP4_BLOCK)
    v = vals * exp2_int(shift)[..., None]
    v = torch.where(nan_block[..., None], torch.full_like(v, float("nan")), v)
    return encode_e4m3(v.view(m, k)), m_major(exp2_int(s))
