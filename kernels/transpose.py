"""Row -> column conversions for the weight-gradient GEMM: pure-torch references.

dW = dY^T X contracts over tokens, so X must be quantized in 1x128 tiles *along tokens*. These
functions take X stored row-wise ([M tokens, K]) and return X^T ([K, M]) in FP8 1x128 tiles along M.
"""

from __future__ import annotations

import torch

from moe_fp4.kernels.fp8 import m_major
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
    unpack_nibbles,
)

# floor(log2(|value|)) of the E2M1 magnitudes 0.5, 1, 1.5, 2, 3, 4, 6 (code 0, the zero, gets a
# sentinel far below any scale so it never sets a maximum).
_E2M1_FLOOR_LOG2 = (-(1 << 20), -1, 0, 0, 1, 1, 2, 2)
# E4M3's largest value is 1.75 * 2^8. Every E2M1 significand is 1 or 1.5 (<= 1.75), so for a column
# whose largest value is m * 2^e the FP8 scale ceil(log2(amax / 448)) is exactly e - 8.
_E4M3_MAX_LOG2 = 8
_MIN_SHIFT = -149


def mxfp4_to_fp8_colwise_ref(data: torch.Tensor, scale: torch.Tensor):
    """Scaling-aware MXFP4 row -> FP8 column conversion, in one pass on the codes.

    data: uint8 [M, K/2], scale: uint8 [M, K/32] (M tokens, any M)
    -> (data float8_e4m3fn [K, M], scale float32 [K, ceil(M/128)] M-major (strides (1, K))).

    For each column k and each tile of 128 tokens (the last may be short): the true amax of the
    decoded values gives S = clamp(floor(log2(amax)) - 8, -126, 127); each element is re-encoded as
    RNE_E4M3(c * 2^(E - S)). Bit-identical to dequantize -> transpose -> quantize 1x128 along tokens.
    Elements of NaN blocks become the NaN byte 0x7F and take no part in the amax.
    """
    m, half_k = data.shape
    k = 2 * half_k
    codes = unpack_nibbles(data)                                             # [M, K]
    e = (scale.to(torch.int32) - E8M0_BIAS).repeat_interleave(MXFP4_BLOCK, dim=1)
    nan = (scale == E8M0_NAN).repeat_interleave(MXFP4_BLOCK, dim=1)
    floor_log2 = torch.tensor(_E2M1_FLOOR_LOG2, dtype=torch.int32, device=data.device)[(codes & 7).long()]
    elog = torch.where(nan, torch.full_like(e, -(1 << 20)), e + floor_log2).t()  # [K, M]
    tiles = -(-m // FP8_TILE)
    padded = torch.full((k, tiles * FP8_TILE), -(1 << 20), dtype=torch.int32, device=data.device)
    padded[:, :m] = elog
    s = (padded.view(k, tiles, FP8_TILE).amax(dim=-1) - _E4M3_MAX_LOG2).clamp(FP8_EXP_MIN, FP8_EXP_MAX)
    s_elem = s.repeat_interleave(FP8_TILE, dim=1)[:, :m]                     # [K, M]
    v = decode_e2m1(codes).t() * exp2_int((e.t() - s_elem).clamp(min=_MIN_SHIFT))
    v = torch.where(nan.t(), torch.full_like(v, float("nan")), v)
    return encode_e4m3(v).contiguous(), m_major(exp2_int(s))
