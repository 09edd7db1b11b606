"""Row -> column conversions for the weight-gradient GEMM: Triton kernels, launchers, and pure-torch
references (each launcher ``name`` beside its twin ``name_ref``).

dW = dY^T X contracts over tokens, so X must be quantized in 1x128 tiles *along tokens*. These
functions take X stored row-wise ([M tokens, K]) and return X^T ([K, M]) in FP8 1x128 tiles along M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_fp4.kernels.fp8 import dequantize_fp8_ref, empty_m_major, m_major, quantize_fp8_rowwise_ref
from moe_fp4.kernels.triton_numerics import (
    e2m1_decode_scaled,
    e2m1_to_e4m3_normal,
    e4m3_rne,
    e4m3_to_f32_bits,
    fp8_scale_exp,
    pow2_f32,
)
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


def fp8_to_fp8_colwise_ref(data: torch.Tensor, scale: torch.Tensor):
    """FP8 1x128 row-wise -> FP8 1x128 along tokens (the FP8 baseline's weight-gradient operand).

    data: float8_e4m3fn [M, K], scale: float32 [M, ceil(K/128)] powers of two (M tokens, any M)
    -> (data float8_e4m3fn [K, M], scale float32 [K, ceil(M/128)] M-major).

    Dequantize exactly to float32, transpose, quantize 1x128 along tokens: per column tile S =
    clamp(ceil(log2(amax/448)), -126, 127), element = RNE_E4M3(q * 2^(S_r - S)). The Triton kernel
    does the same without the float32 tensor; NaN elements stay the NaN byte 0x7F.
    """
    return quantize_fp8_rowwise_ref(dequantize_fp8_ref(data, scale, torch.float32).t().contiguous())


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _mxfp4_to_fp8_colwise_kernel(d_ptr, s_ptr, o_ptr, os_ptr, M, K, KB, stride_dm, stride_sm,
                                 BLOCK_T: tl.constexpr, NB: tl.constexpr):
    # A program: one tile of BLOCK_T (=128) tokens x NB MXFP4 blocks of columns, as [T, NB, 16] pairs.
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    tok = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    kb = pid_k * NB + tl.arange(0, NB)
    p = tl.arange(0, 16)
    mask2 = (tok < M)[:, None] & (kb < KB)[None, :]
    mask3 = mask2[:, :, None]
    pair = (kb * 16)[None, :, None] + p[None, None, :]
    byte = tl.load(d_ptr + tok[:, None, None] * stride_dm + pair, mask=mask3, other=0).to(tl.int32)
    sb = tl.load(s_ptr + tok[:, None] * stride_sm + kb[None, :], mask=mask2, other=0).to(tl.int32)
    nan = (sb == 255)[:, :, None]
    c_lo = byte & 15
    c_hi = byte >> 4
    # floor(log2 |c|) for magnitudes 1..7 (0.5, 1, 1.5, 2, 3, 4, 6) is (m >> 1) - 1; zero and NaN
    # elements get a sentinel below every real exponent. Column amax = m * 2^e with m in {1, 1.5},
    # so ceil(log2(amax / 448)) = e - 8 exactly (1.5 <= 1.75).
    e_blk = (sb - 127)[:, :, None]
    m_lo = c_lo & 7
    m_hi = c_hi & 7
    l_lo = tl.where((m_lo == 0) | nan, -100000, (m_lo >> 1) - 1 + e_blk)
    l_hi = tl.where((m_hi == 0) | nan, -100000, (m_hi >> 1) - 1 + e_blk)
    S_lo = tl.minimum(tl.maximum(tl.max(l_lo, axis=0) - 8, -126), 127)            # [NB, 16]
    S_hi = tl.minimum(tl.maximum(tl.max(l_hi, axis=0) - 8, -126), 127)
    rel_lo = (sb - 127)[:, :, None] - S_lo[None, :, :]                            # E_row - S_col
    rel_hi = (sb - 127)[:, :, None] - S_hi[None, :, :]
    # A lower bound of every E_row - S_col, from per-block and per-column values only.
    lowest = tl.min(tl.where((sb == 255) | ~mask2, 1000, sb - 127)) - tl.maximum(tl.max(S_lo), tl.max(S_hi))
    if lowest >= -5:
        # No row block more than 11 binades under its column maximum: values are normals or zero.
        q_lo = e2m1_to_e4m3_normal(c_lo, rel_lo)
        q_hi = e2m1_to_e4m3_normal(c_hi, rel_hi)
    else:
        q_lo = e4m3_rne(e2m1_decode_scaled(c_lo, tl.maximum(rel_lo + 127, 0)).to(tl.float32, bitcast=True))
        q_hi = e4m3_rne(e2m1_decode_scaled(c_hi, tl.maximum(rel_hi + 127, 0)).to(tl.float32, bitcast=True))
    q_lo = tl.where(nan, 0x7F, q_lo).to(tl.uint8)
    q_hi = tl.where(nan, 0x7F, q_hi).to(tl.uint8)
    # Transposed store: element (token, column k) goes to out[k, token], k = 32 kb + 2p (+1 for hi).
    # Permuting to [NB, 16, T] first (a shared-memory transpose the compiler inserts) makes tokens
    # the fastest axis, so each output row segment is written by consecutive threads.
    col = (kb * 32)[:, None, None] + 2 * p[None, :, None]
    off = col.to(tl.int64) * M + tok[None, None, :]
    mask_t = tl.permute(mask3, (1, 2, 0))
    tl.store(o_ptr + off, tl.permute(q_lo, (1, 2, 0)), mask=mask_t)
    tl.store(o_ptr + off + M, tl.permute(q_hi, (1, 2, 0)), mask=mask_t)
    mask_c = (kb < KB)[:, None]
    soff = pid_t.to(tl.int64) * K + (kb * 32)[:, None] + 2 * p[None, :]
    tl.store(os_ptr + soff, pow2_f32(S_lo), mask=mask_c)
    tl.store(os_ptr + soff + 1, pow2_f32(S_hi), mask=mask_c)


@triton.jit
def _fp8_to_fp8_colwise_kernel(q_ptr, s_ptr, o_ptr, os_ptr, M, K,
                               BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    # A program: BLOCK_T (=128) tokens x BLOCK_K (<= 128, inside one row tile) columns.
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    tok = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (tok < M)[:, None] & (cols < K)[None, :]
    byte = tl.load(q_ptr + tok[:, None] * K + cols[None, :], mask=mask, other=0).to(tl.int32)
    srow = tl.load(s_ptr + (cols // 128)[None, :].to(tl.int64) * M + tok[:, None], mask=mask, other=1.0)
    s_r = (srow.to(tl.int32, bitcast=True) >> 23) - 127
    nan = (byte & 0x7F) == 0x7F
    qf = e4m3_to_f32_bits(tl.where(nan, 0, byte)).to(tl.float32, bitcast=True)
    absval = tl.abs(qf) * srow                         # exact: a 4-bit significand times 2^S_r
    S = fp8_scale_exp(tl.max(absval, axis=0).to(tl.int32, bitcast=True))        # [BLOCK_K]
    shift = tl.minimum(tl.maximum(s_r - S[None, :], -126), 127)
    q = tl.where(nan, 0x7F, e4m3_rne(qf * pow2_f32(shift))).to(tl.uint8)
    off = cols[:, None].to(tl.int64) * M + tok[None, :]   # [BLOCK_K, T]: tokens fastest, see above
    tl.store(o_ptr + off, tl.trans(q), mask=tl.trans(mask))
    tl.store(os_ptr + pid_t.to(tl.int64) * K + cols, pow2_f32(S), mask=cols < K)


def mxfp4_to_fp8_colwise(data: torch.Tensor, scale: torch.Tensor, nb: int = 1, num_warps: int = 4):
    """data uint8 [M, K/2], scale uint8 [M, K/32] -> (data float8_e4m3fn [K, M], scale float32
    [K, ceil(M/128)] M-major); bit-identical to mxfp4_to_fp8_colwise_ref."""
    m, half_k = data.shape
    k = 2 * half_k
    kb = k // MXFP4_BLOCK
    out = torch.empty(k, m, dtype=torch.float8_e4m3fn, device=data.device)
    nt = triton.cdiv(m, FP8_TILE)
    oscale = empty_m_major(k, nt, data.device)
    if m and k:
        nb = min(nb, triton.next_power_of_2(kb))
        _mxfp4_to_fp8_colwise_kernel[(nt, triton.cdiv(kb, nb))](
            data, scale, out.view(torch.uint8), oscale, m, k, kb, data.stride(0), scale.stride(0),
            BLOCK_T=FP8_TILE, NB=nb, num_warps=num_warps)
    return out, oscale


def fp8_to_fp8_colwise(data: torch.Tensor, scale: torch.Tensor, block_k: int = 32, num_warps: int = 4):
    """data float8_e4m3fn [M, K] (K % 128 == 0), scale float32 [M, K/128] M-major -> (data
    float8_e4m3fn [K, M], scale float32 [K, ceil(M/128)] M-major); bit-identical to
    fp8_to_fp8_colwise_ref."""
    m, k = data.shape
    out = torch.empty(k, m, dtype=torch.float8_e4m3fn, device=data.device)
    nt = triton.cdiv(m, FP8_TILE)
    oscale = empty_m_major(k, nt, data.device)
    if m and k:
        _fp8_to_fp8_colwise_kernel[(nt, triton.cdiv(k, block_k))](
            data.view(torch.uint8), m_major(scale), out.view(torch.uint8), oscale, m, k,
            BLOCK_T=FP8_TILE, BLOCK_K=block_k, num_warps=num_warps)
    return out, oscale
