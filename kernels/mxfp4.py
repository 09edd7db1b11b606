"""MXFP4 quantize / dequantize: pure-torch references (the Triton kernels join them here).

Functions take and return plain 2-D tensors; ``moe_fp4.api`` wraps them in the containers.
"""

from __future__ import annotations

import torch

from moe_fp4.kernels.numerics import (
    E8M0_BIAS,
    E8M0_NAN,
    FP8_TILE,
    MX_EXP_MAX,
    MX_EXP_MIN,
    MXFP4_BLOCK,
    ceil_log2_ratio,
    decode_e2m1,
    encode_e2m1,
    exp2_int,
    mx_scale_exponent,
    pack_nibbles,
    unpack_nibbles,
)


def _encode_blocks(v: torch.Tensor, exp: torch.Tensor, nan_block: torch.Tensor):
    """v: float32 [M, K] already scaled by 2^-E; exp: int32 [M, K/32]; nan_block: bool [M, K/32]
    -> (data uint8 [M, K/2], scale uint8 [M, K/32]). NaN blocks get scale 0xFF and zero codes."""
    m, k = v.shape
    codes = encode_e2m1(v).view(m, k // MXFP4_BLOCK, MXFP4_BLOCK)
    codes = torch.where(nan_block[..., None], torch.zeros_like(codes), codes).view(m, k)
    scale = torch.where(nan_block, torch.full_like(exp, E8M0_NAN), exp + E8M0_BIAS).to(torch.uint8)
    return pack_nibbles(codes), scale


def quantize_mxfp4_rowwise_ref(x: torch.Tensor):
    """x: bf16/fp16/fp32 [M, K], K % 32 == 0 -> (data uint8 [M, K/2], scale uint8 [M, K/32]).

    Per 32-block: E = clamp(ceil(log2(amax/6)), -127, 127) (RCEIL: nothing clips), codes =
    RNE_E2M1(x * 2^-E). A block holding NaN or Inf gets scale 0xFF.
    """
    m, k = x.shape
    xf = x.float()
    blocks = xf.view(m, k // MXFP4_BLOCK, MXFP4_BLOCK)
    nan_block = (~torch.isfinite(blocks)).any(dim=-1)
    amax = torch.where(nan_block[..., None], torch.zeros_like(blocks), blocks.abs()).amax(dim=-1)
    exp = mx_scale_exponent(amax)
    # x * 2^-E is exact: the result is at most 6 and 2^-E in [2^-127, 2^127] is representable.
    # (2^127 * x cannot overflow: E = -127 only when amax <= 6 * 2^-127.)
    v = blocks * exp2_int(-exp)[..., None]
    return _encode_blocks(v.view(m, k), exp, nan_block)


def quantize_mxfp4_from_fp8_ref(data: torch.Tensor, scale: torch.Tensor):
    """Direct FP8 1x128 -> MXFP4, on the codes: no dequantized tensor is formed.

    data: float8_e4m3fn [M, K], K % 128 == 0; scale: float32 [M, K/128] powers of two 2^S
    -> (data uint8 [M, K/2], scale uint8 [M, K/32]).

    Per 32-block inside a tile of scale 2^S: E = clamp(S + ceil(log2(max|q| / 6)), -127, 127) and
    codes = RNE_E2M1(q * 2^(S - E)). S - E lies in [-7, 11] (max|q| is in [2^-9, 448] or the block is
    zero), so q * 2^(S-E) is exact in float32: the same bits as quantizing the dequantized values.
    """
    m, k = data.shape
    q = data.float().view(m, k // MXFP4_BLOCK, MXFP4_BLOCK)
    nan_block = torch.isnan(q).any(dim=-1)
    qmax = torch.where(nan_block[..., None], torch.zeros_like(q), q.abs()).amax(dim=-1)
    s = ((scale.contiguous().view(torch.int32) >> 23) - 127)  # [M, K/128] exponents of 2^S
    s = s.repeat_interleave(FP8_TILE // MXFP4_BLOCK, dim=1)
    e_rel = ceil_log2_ratio(qmax, 0x400000, 2)  # ceil(log2(max|q|/6)); very negative when qmax == 0
    exp = (s + e_rel.clamp(min=MX_EXP_MIN - MX_EXP_MAX - 1)).clamp(MX_EXP_MIN, MX_EXP_MAX)
    v = q * exp2_int(s - exp)[..., None]
    return _encode_blocks(v.view(m, k), exp, nan_block)


def dequantize_mxfp4_ref(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """data: uint8 [M, K/2], scale: uint8 [M, K/32] -> dtype [M, K] (exact in float32; one rounding
    to bf16/fp16 otherwise). NaN blocks (scale 0xFF) give NaN; zero codes give signed zeros.

    E8M0 byte 254 (2^127) with |code| >= 2 exceeds float32's range and gives +-Inf.
    """
    m, half_k = data.shape
    k = 2 * half_k
    vals = decode_e2m1(unpack_nibbles(data)).view(m, k // MXFP4_BLOCK, MXFP4_BLOCK)
    e = scale.to(torch.int32) - E8M0_BIAS
    out = vals * exp2_int(e.clamp(max=MX_EXP_MAX))[..., None]
    out = torch.where((scale == E8M0_NAN)[..., None], torch.full_like(out, float("nan")), out)
    return out.view(m, k).to(dtype)
