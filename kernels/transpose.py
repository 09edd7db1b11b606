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
from moe_fp4.kernels.triton_numerics import (
    bytes_transpose4x4,
    bytes_transpose4x4_asm,
    ceil_log2_ratio_bits,
    e2m1_decode_scaled,
    e2m1_pairs_to_base_flagged,
    e2m1_pairs_to_base_flagged_asm,
    e2m1_to_e4m3_normal,
    e4m3_rne,
    e4m3_rne_asm,
    e4m3_to_f32_bits,
    e4m3x4_to_f16x2,
    e4m3x4_to_f16x2_asm,
    f16_lo_to_f32,
    f16x2x2_to_e4m3x4,
    f16x2x2_to_e4m3x4_asm,
    f32_to_f16_lo,
    fp8_scale_exp,
    in_bits_to_f32_bits,
    max_abs_f16x2_asm,
    max_u16x2_asm,
    mul_f16x2,
    mul_f16x2_asm,
    pow2_f32,
    tl_dtype,
    use_asm,
)

# floor(log2(|value|)) of the E2M1 magnitudes 0.5, 1, 1.5, 2, 3, 4, 6 (code 0, the zero, gets a
# sentinel far below any scale so it never sets a maximum).
_E2M1_FLOOR_LOG2 = (-(1 << 20), -1, 0, 0, 1, 1, 2, 2)
# E4M3's largest value is 1.75 * 2^8. Every E2M1 significand is 1 or 1.5 (<= 1.75), so for a column
# whose largest value is m * 2^e the FP8 scale ceil(log2(amax / 448)) is exactly e - 8.
_E4M3_MAX_LOG2 = 8
_MIN_SHIFT = -149


def mxfp4_to_fp8_colwise_ref(data: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor | None = None):
    """Scaling-aware MXFP4 row -> FP8 column conversion, in one pass on the codes.

    data: uint8 [M, K/2], scale: uint8 [M, K/32] (M tokens, any M)
    -> (data float8_e4m3fn [K, M], scale float32 [K, ceil(M/128)] M-major (strides (1, K))).

    For each column k and each tile of 128 tokens (the last may be short): the true amax of the
    decoded values gives S = clamp(floor(log2(amax)) - 8, -126, 127); each element is re-encoded as
    RNE_E4M3(c * 2^(E - S)). Bit-identical to dequantize -> transpose -> quantize 1x128 along tokens,
    except in columns holding values of 2^128 and more (byte 254 with |value| >= 2, byte 253 with
    |value| >= 4): the definition's float32 decode saturates them to float32's largest finite value,
    this rule scales and encodes the value itself (docs/formats.md).
    Elements of NaN blocks become the NaN byte 0x7F and take no part in the amax.
    With rows (int [M'] indices into data's rows) the input is data[rows] (out [K, M']): a gathered
    view converted without a gathered copy (the launcher reads the rows in place).
    """
    if rows is not None:
        data, scale = data[rows], scale[rows]
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

    Dequantize to float32 (exact; saturating, so the FP8 value 2^128 that quantize_fp8 makes of bf16's
    and float32's largest values becomes float32's largest, which scales and encodes as 2^128 does),
    transpose, quantize 1x128 along tokens: per column tile S = clamp(ceil(log2(amax/448)), -126, 127),
    element = RNE_E4M3(q * 2^(S_r - S)). The Triton kernel does the same without the float32 tensor;
    NaN elements stay the NaN byte 0x7F.
    """
    return quantize_fp8_rowwise_ref(dequantize_fp8_ref(data, scale, torch.float32).t().contiguous())


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _source_rows(r_ptr, tok, mask, GATHER: tl.constexpr):
    """Output tokens -> the input rows they read: r[tok] (int64) with GATHER, else tok itself."""
    if GATHER:
        src = tl.load(r_ptr + tok, mask=mask, other=0).to(tl.int64)
    else:
        src = tok
    return src


@triton.jit
def _mxfp4_to_fp8_colwise_bytes_kernel(d_ptr, s_ptr, r_ptr, o_ptr, os_ptr, M, K, KB, stride_dm, stride_sm,
                                       BLOCK_T: tl.constexpr, NB: tl.constexpr, GATHER: tl.constexpr):
    # M % 4 != 0 (rows of the output are not 32-bit aligned): one code per operation (4 warps, nb = 1),
    # faster for such M than _mxfp4_colwise_general in one-warp programs (bench/RESULTS.md).
    # A program: one tile of BLOCK_T (=128) tokens x NB MXFP4 blocks of columns, as [T, NB, 16] pairs.
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    tok = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    kb = pid_k * NB + tl.arange(0, NB)
    p = tl.arange(0, 16)
    mask2 = (tok < M)[:, None] & (kb < KB)[None, :]
    mask3 = mask2[:, :, None]
    pair = (kb * 16)[None, :, None] + p[None, None, :]
    src = _source_rows(r_ptr, tok, tok < M, GATHER)
    byte = tl.load(d_ptr + src[:, None, None] * stride_dm + pair, mask=mask3, other=0).to(tl.int32)
    sb = tl.load(s_ptr + src[:, None] * stride_sm + kb[None, :], mask=mask2, other=0).to(tl.int32)
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


@triton.jit(noinline=True)
def _mxfp4_colwise_general(d_ptr, s_ptr, r_ptr, o_ptr, os_ptr, M, K, KB, stride_dm, stride_sm, pid_t, pid_k,
                           NB: tl.constexpr, GATHER: tl.constexpr):
    # One tile of 128 tokens x NB MXFP4 blocks of columns, one code per operation: the word kernel's
    # programs with a block more than 11 binades under its tile's largest. Per block, two passes over chunks
    # of 8 tokens (column maxima, then encode and store), so a one-warp program holds 4 byte pairs
    # per thread instead of the tile's 64 per block (which would spill). Rare, so built for size
    # (Triton 3.6, NB = 4: the kernel is 12233 SASS instructions with chunks of 32, 6785 with 8).
    CH: tl.constexpr = 8
    p = tl.arange(0, 16)
    c = tl.arange(0, CH)
    for b in tl.static_range(NB):
        kb = pid_k * NB + b
        if kb < KB:
            # floor(log2 |c|) for magnitudes 1..7 (0.5, 1, 1.5, 2, 3, 4, 6) is (m >> 1) - 1; zero and
            # NaN elements get a sentinel below every real exponent. Column amax = m * 2^e with m in
            # {1, 1.5}, so ceil(log2(amax / 448)) = e - 8 exactly (1.5 <= 1.75).
            l_lo = tl.full([16], -100000, tl.int32)
            l_hi = tl.full([16], -100000, tl.int32)
            for ch in tl.range(0, 128 // CH):
                tok = pid_t.to(tl.int64) * 128 + ch * CH + c
                src = _source_rows(r_ptr, tok, tok < M, GATHER)
                byte = tl.load(d_ptr + src[:, None] * stride_dm + kb * 16 + p[None, :],
                               mask=(tok < M)[:, None], other=0).to(tl.int32)
                sb = tl.load(s_ptr + src * stride_sm + kb, mask=tok < M, other=255).to(tl.int32)[:, None]
                m_lo = byte & 7
                m_hi = (byte >> 4) & 7
                l_lo = tl.maximum(l_lo, tl.max(tl.where((m_lo == 0) | (sb == 255), -100000, (m_lo >> 1) + sb - 128),
                                               axis=0))
                l_hi = tl.maximum(l_hi, tl.max(tl.where((m_hi == 0) | (sb == 255), -100000, (m_hi >> 1) + sb - 128),
                                               axis=0))
            S_lo = tl.minimum(tl.maximum(l_lo - 8, -126), 127)
            S_hi = tl.minimum(tl.maximum(l_hi - 8, -126), 127)
            col = kb * 32 + 2 * p                                                   # lo codes' columns
            for ch in tl.range(0, 128 // CH):
                tok = pid_t.to(tl.int64) * 128 + ch * CH + c
                tmask = tok < M
                src = _source_rows(r_ptr, tok, tmask, GATHER)
                byte = tl.load(d_ptr + src[:, None] * stride_dm + kb * 16 + p[None, :],
                               mask=tmask[:, None], other=0).to(tl.int32)
                sb = tl.load(s_ptr + src * stride_sm + kb, mask=tmask, other=0).to(tl.int32)[:, None]
                # c * 2^(E - S) as exact fp32 bits (decoded with the shifted byte E - S + 127; below 0
                # the values are under 6 * 2^-127 and round to zero like byte 0's), then RNE.
                q_lo = e4m3_rne(e2m1_decode_scaled(byte & 15, tl.maximum(sb - S_lo[None, :], 0))
                                .to(tl.float32, bitcast=True))
                q_hi = e4m3_rne(e2m1_decode_scaled(byte >> 4, tl.maximum(sb - S_hi[None, :], 0))
                                .to(tl.float32, bitcast=True))
                q_lo = tl.where(sb == 255, 0x7F, q_lo).to(tl.uint8)
                q_hi = tl.where(sb == 255, 0x7F, q_hi).to(tl.uint8)
                # Transposed store: out[k, token], tokens the fastest axis (a shared-memory transpose).
                off = col[:, None].to(tl.int64) * M + tok[None, :]
                tl.store(o_ptr + off, tl.trans(q_lo), mask=tmask[None, :])
                tl.store(o_ptr + off + M, tl.trans(q_hi), mask=tmask[None, :])
            soff = pid_t.to(tl.int64) * K + col
            tl.store(os_ptr + soff, pow2_f32(S_lo))
            tl.store(os_ptr + soff + 1, pow2_f32(S_hi))


@triton.jit
def _quad_tokens(pid_t):
    """Tokens of token tile pid_t as [4 qr, 8 ql, 4 i]: token 4 q + i of quad q = 8 qr + ql -> (quad
    int32 [4, 8], tok int64 [4, 8, 4]). A quad's four tokens become the four bytes of one output word
    (out[k, 4 q:4 q + 4]); loads of [4, N, 4 words, 8, 4] keep i in one thread's registers (Triton 3.6)."""
    quad = tl.arange(0, 4)[:, None] * 8 + tl.arange(0, 8)[None, :]
    return quad, pid_t.to(tl.int64) * 128 + quad[:, :, None] * 4 + tl.arange(0, 4)[None, None, :]


@triton.jit
def _quad_bytes_transpose(x, N: tl.constexpr, ASM: tl.constexpr):
    """x: int32 [4, N, 4, 8, 4] words of tokens 4 q + i (i last) -> (b0, b1, b2, b3) int32 [4, N, 4, 8]:
    byte i of b_j = byte j of token i's word (bytes_transpose4x4 over the quad, PTX with ASM)."""
    xe, xo = x.reshape(4, N, 4, 8, 2, 2).split()            # i = 2u + v: v = 0 -> i = 0, 2
    x0, x2 = xe.split()
    x1, x3 = xo.split()
    if ASM:
        return bytes_transpose4x4_asm(x0, x1, x2, x3)
    else:
        return bytes_transpose4x4(x0, x1, x2, x3)


@triton.jit
def _max_u16x2_combine(a, b):
    return max_u16x2_asm(a, b)


@triton.jit
def _column_max_byte(p, ASM: tl.constexpr):
    """p: int32 [4, NB, 4, 8] of byte lanes (values 0..255) -> int32 [NB, 4]: the largest lane over
    axes 0 and 3 and the four lanes of each word. ASM: max.u16x2 on p and on p << 8 (the high byte
    of each 16-bit lane compares first, so high bytes of a running maximum are exact: p's give
    lanes 1 and 3, p << 8's lanes 0 and 2)."""
    if ASM:
        v = max_u16x2_asm(p, p << 8)
        r = tl.reduce(tl.reduce(v, 3, _max_u16x2_combine), 0, _max_u16x2_combine)
        return tl.maximum((r >> 24) & 0xFF, (r >> 8) & 0xFF)
    else:
        v = tl.maximum(tl.maximum(p & 0xFF, (p >> 8) & 0xFF), tl.maximum((p >> 16) & 0xFF, (p >> 24) & 0xFF))
        return tl.max(tl.max(v, axis=3), axis=0)


@triton.jit
def _mxfp4_to_fp8_colwise_kernel(d_ptr, s_ptr, r_ptr, o_ptr, os_ptr, M, M4, K, KB, stride_dm, stride_sm,
                                 NB: tl.constexpr, ASM: tl.constexpr, GATHER: tl.constexpr):
    # M % 4 == 0, rows 4-byte aligned. A program: one tile of 128 tokens x NB MXFP4 blocks of
    # columns. Programs whose blocks all lie within 11 binades of their tile's largest block take the
    # SWAR path below, the others _mxfp4_colwise_general.
    # One grid axis (no 65535 limit on token tiles), column groups fastest: neighbouring programs
    # read the same input rows (faster than token tiles fastest, bench/RESULTS.md).
    n_k = tl.cdiv(KB, NB)
    pid_k = tl.program_id(0) % n_k
    pid_t = tl.program_id(0) // n_k
    # Tokens as [4 qr, 8 ql, 4 i] (_quad_tokens): a block's four words in one thread, quads across
    # lanes and registers, the quad split in registers.
    i4 = tl.arange(0, 4)
    nb = pid_k * NB + tl.arange(0, NB)
    wb = tl.arange(0, 4)
    quad, tok = _quad_tokens(pid_t)                                                 # [4, 8], [4, 8, 4]
    kbm = nb < KB
    mask4 = (tok < M)[:, None, :, :] & kbm[None, :, None, None]                      # [4, NB, 8, 4]
    src = _source_rows(r_ptr, tok, tok < M, GATHER)                                   # rows read
    sb = tl.load(s_ptr + src[:, None, :, :] * stride_sm + nb[None, :, None, None], mask=mask4,
                 other=0).to(tl.int32)
    nan = sb == 255
    valid = mask4 & ~nan
    # Scale byte 0 is the quantizer's encoding of an all-zero block (padding rows, zero-weight rows),
    # hundreds of binades under real data: such a block would send its whole tile to the (much slower)
    # general path. Its bytes are left out of e_low and
    # of the lane offsets; that is exact when its codes are zeros (signed zeros encode as +-0 on the
    # SWAR path too), which is checked once the codes are loaded.
    low = valid & (sb != 0)
    e = sb - 127
    e_top = tl.max(tl.max(tl.max(tl.where(valid, e, -1000), axis=3), axis=2), axis=0)        # [NB]
    e_low = tl.min(tl.min(tl.min(tl.where(low, e, 1000), axis=3), axis=2), axis=0)
    zero = valid & (sb == 0)
    if tl.min(e_low - e_top) >= -11:
        dw_ptr = d_ptr.to(tl.pointer_type(tl.int32))
        word = (nb * 4)[None, :, None, None, None] + wb[None, None, :, None, None]
        mask5 = mask4[:, :, None, :, :]
        x = tl.load(dw_ptr + src[:, None, None, :, :] * (stride_dm // 4) + word, mask=mask5, other=0)
        swar = True
        if tl.max(zero.to(tl.int32)) > 0:
            # a byte-0 block with a nonzero magnitude (values <= 6 * 2^-127): the general path
            swar = tl.max(tl.where(zero[:, :, None, :, :], x & 0x77777777, 0)) == 0
        if swar:
            # Every element is c * 2^(E - S) with E - S >= -5 (S >= E_top - 6 whenever the column has
            # a nonzero, E >= E_top - 11): a zero or an E4M3 normal, four tokens per integer operation.
            # P = B(m) + [m != 0](8 k0 - 1) with k0 = 6 + E - S_ref, S_ref = E_top - 20 <= every S, is
            # the E4M3 byte of the element at scale 2^S_ref (k0 in [15, 26]: lanes <= 236, no carry),
            # so the column's largest P gives S, and P - 8 (S - S_ref) [m != 0] the output byte.
            k8 = tl.where(low, 8 * (26 + e - e_top[None, :, None, None]) - 1, 0)
            kq = tl.sum(k8 << (8 * i4)[None, None, None, :], axis=3)[:, :, None, :]      # [4, NB, 1, 8]
            nq = tl.sum(tl.where(nan, 0x7F, 0) << (8 * i4)[None, None, None, :], axis=3)[:, :, None, :]
            x = x & tl.where(nan, 0, -1)[:, :, None, :, :]          # NaN blocks: zero codes, 0x7F below
            b0, b1, b2, b3 = _quad_bytes_transpose(x, NB, ASM)
            s_ref = (e_top - 20)[:, None]
            qg = pid_t * 32 + quad
            omask = kbm[None, :, None, None] & (qg < M4)[:, None, None, :]
            col0 = (nb * 32)[:, None] + (wb * 8)[None, :]                                 # [NB, 4]
            obase = (o_ptr.to(tl.pointer_type(tl.int32)) + col0[None, :, :, None].to(tl.int64) * M4
                     + qg[:, None, None, :])
            for j in tl.static_range(4):
                # b_j: byte j of the four tokens' words = codes of columns 8 w + 2j (lo) and + 1 (hi).
                bj = b0 if j == 0 else (b1 if j == 1 else (b2 if j == 2 else b3))
                if ASM:
                    lo, hi = e2m1_pairs_to_base_flagged_asm(bj)
                else:
                    lo, hi = e2m1_pairs_to_base_flagged(bj)
                for h in tl.static_range(2):
                    w = lo if h == 0 else hi
                    fm = (w & 0x01010101) * 255                                          # 0xFF per nonzero
                    pw = w + (kq & fm)
                    sgn = (((bj << 4) if h == 0 else bj) & -0x7F7F7F80) | nq             # 0x80808080
                    pmax = _column_max_byte(pw, ASM)
                    # The largest P's exponent field is floor(log2 amax) + 7 - S_ref, so S = that - 15 + S_ref
                    # (floor(log2 amax) - 8); a column of zeros (pmax 0) gets the floor 2^-126.
                    S = tl.maximum(tl.where(pmax > 0, (pmax >> 3) - 15 + s_ref, -126), -126)
                    d = tl.where(pmax > 0, 8 * (S - s_ref), 0) * 0x01010101
                    out = pw - (d[None, :, :, None] & fm) + sgn
                    tl.store(obase + (2 * j + h) * M4, out, mask=omask)
                    col = col0 + 2 * j + h
                    tl.store(os_ptr + pid_t.to(tl.int64) * K + col, pow2_f32(S), mask=kbm[:, None])
        else:
            _mxfp4_colwise_general(d_ptr, s_ptr, r_ptr, o_ptr, os_ptr, M, K, KB, stride_dm, stride_sm, pid_t, pid_k,
                                   NB, GATHER)
    else:
        _mxfp4_colwise_general(d_ptr, s_ptr, r_ptr, o_ptr, os_ptr, M, K, KB, stride_dm, stride_sm, pid_t, pid_k,
                               NB, GATHER)


@triton.jit
def _fp8_to_fp8_colwise_bytes_kernel(q_ptr, s_ptr, o_ptr, os_ptr, M, K,
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


@triton.jit(noinline=True)
def _fp8_colwise_general(q_ptr, s_ptr, o_ptr, os_ptr, M, K, pid_t, col0, BK: tl.constexpr):
    # One tile of 128 tokens x BK columns with the bytes kernel's arithmetic (one value per
    # operation), for the word kernel's programs that its float16 argument does not cover. Two passes
    # over chunks of 8 tokens (column maxima, then encode and store). Rare, so built for registers,
    # not speed: a call (noinline) with small chunks keeps it from raising the kernel's register
    # count, which sets how many programs an SM holds (Triton 3.6, G = 8 on 4 warps: 96 registers
    # against 202 inlined with chunks of 32).
    CH: tl.constexpr = 8
    c = tl.arange(0, CH)
    cols = col0 + tl.arange(0, BK)
    amax = tl.zeros([BK], tl.float32)
    for ch in tl.range(0, 128 // CH):
        tok = pid_t.to(tl.int64) * 128 + ch * CH + c
        byte = tl.load(q_ptr + tok[:, None] * K + cols[None, :], mask=(tok < M)[:, None], other=0).to(tl.int32)
        srow = tl.load(s_ptr + (col0 // 128).to(tl.int64) * M + tok, mask=tok < M, other=1.0)
        nan = (byte & 0x7F) == 0x7F
        qf = e4m3_to_f32_bits(tl.where(nan, 0, byte)).to(tl.float32, bitcast=True)
        amax = tl.maximum(amax, tl.max(tl.abs(qf) * srow[:, None], axis=0))
    S = fp8_scale_exp(amax.to(tl.int32, bitcast=True))
    for ch in tl.range(0, 128 // CH):
        tok = pid_t.to(tl.int64) * 128 + ch * CH + c
        mask = (tok < M)[:, None] & (cols < K)[None, :]
        byte = tl.load(q_ptr + tok[:, None] * K + cols[None, :], mask=mask, other=0).to(tl.int32)
        srow = tl.load(s_ptr + (col0 // 128).to(tl.int64) * M + tok, mask=tok < M, other=1.0)
        s_r = (srow.to(tl.int32, bitcast=True) >> 23) - 127
        nan = (byte & 0x7F) == 0x7F
        qf = e4m3_to_f32_bits(tl.where(nan, 0, byte)).to(tl.float32, bitcast=True)
        shift = tl.minimum(tl.maximum(s_r[:, None] - S[None, :], -126), 127)
        q = tl.where(nan, 0x7F, e4m3_rne(qf * pow2_f32(shift))).to(tl.uint8)
        off = cols[:, None].to(tl.int64) * M + tok[None, :]
        tl.store(o_ptr + off, tl.trans(q), mask=tl.trans(mask))
    tl.store(os_ptr + pid_t.to(tl.int64) * K + cols, pow2_f32(S))


@triton.jit
def _f16_column_scale(h, s_ref):
    """h: int32 float16 bits (low 16) of a column's max |a| (a = q 2^(S_r - s_ref + 7)); s_ref: int32
    scalar -> (S, f, bad): the column's exponent S, the float16 bits of 2^(s_ref - S - 7) (1.0 for a
    column without a finite nonzero, and for a bad one, whose bytes the general path rewrites), and
    whether that factor is past float16 (s_ref - S > 22)."""
    h = h & 0xFFFF
    empty = (h == 0) | (h > 0x7C00)                   # zeros only, or NaN only (no value sets a max)
    e = ceil_log2_ratio_bits(f16_lo_to_f32(h).to(tl.int32, bitcast=True), 0x600000, 8) + s_ref - 7
    S = tl.where(empty, -126, tl.minimum(tl.maximum(e, -126), 127))
    g = s_ref - S
    bad = ~empty & (g > 22)
    return S, tl.where(empty | bad, 15 << 10, (g + 8) << 10), bad


@triton.jit
def _column_max_abs_f16x2(a):
    """a: int32 float16x2 words [4, G, 4, 8, 4] -> int32 [G, 4]: the largest |value| per lane over
    axes 0, 3 and 4, NaN lanes left out (0 when there is nothing else): the pure-Triton twin of the
    max_abs_f16x2_asm reduction, written with tl.max (the interpreter runs a tl.reduce combine once
    per element pair, about 6 s per program)."""
    lo = tl.abs(f16_lo_to_f32(a))
    hi = tl.abs(f16_lo_to_f32(a >> 16))
    lo = tl.max(tl.max(tl.max(tl.where(lo != lo, 0.0, lo), 4), 3), 0)
    hi = tl.max(tl.max(tl.max(tl.where(hi != hi, 0.0, hi), 4), 3), 0)
    return f32_to_f16_lo(lo) | (f32_to_f16_lo(hi) << 16)


@triton.jit
def _max_abs_f16x2_asm_combine(a, b):
    return max_abs_f16x2_asm(a, b)


@triton.jit
def _fp8_to_fp8_colwise_kernel(q_ptr, s_ptr, o_ptr, os_ptr, M, M4, K, K4,
                               G: tl.constexpr, ASM: tl.constexpr):
    # M % 4 == 0, K % 128 == 0, rows 16-byte aligned. A program: one tile of 128 tokens x 16 G
    # columns inside one 128-column row tile (one row exponent S_r per token). Column groups fastest
    # in the one grid axis, as in _mxfp4_to_fp8_colwise_kernel.
    #
    # Float16x2 path. s_ref = the tile's largest S_r, d = s_ref - S_r >= 0 per token. Each value q
    # (an E4M3 byte's value) becomes a = q * 2^(7 - d) in float16: exact for d <= 21 (q is a
    # multiple of 2^-9 below 2^9, so a is a multiple of 2^-23 below 2^16). Tokens with d > 21 get a
    # = +-0, and the program is general unless their bytes are all +-0. The column max of |a| gives
    # S exactly (S = s_ref - 7 + ceil(log2(amax_a / 448)) <= s_ref), and the output is
    # RNE_E4M3(a * 2^(g - 7)), g = s_ref - S in [0, 22] (else general): a * 2^(g - 7) = q * 2^(S_r - S)
    # <= 448 is exact whenever it is on float16's grid, and when it is not it is below 2^-21, so its
    # float16 rounding is also below 2^-10 and both round to a signed zero in E4M3. One rounding.
    n_k = K4 // (4 * G)
    pid_k = tl.program_id(0) % n_k
    pid_t = tl.program_id(0) // n_k
    col0 = pid_k * (16 * G)
    # Tokens as [4 qr, 8 ql, 4 i] (_quad_tokens), columns as [G, 4 w, 4 bytes]: x[qr, g, w, ql, i] is
    # the word of columns 16 g + 4 w .. + 3 of token 4 q + i, and a 4 x 4 byte transpose of a quad's
    # words gives out[k, 4 q:4 q + 4].
    gw = tl.arange(0, G)[:, None] * 4 + tl.arange(0, 4)[None, :]                   # [G, 4] word in row
    quad, tok = _quad_tokens(pid_t)                                                 # [4, 8], [4, 8, 4]
    tmask = tok < M
    sbits = tl.load(s_ptr + (col0 // 128).to(tl.int64) * M + tok, mask=tmask, other=1.0).to(tl.int32, bitcast=True)
    s_r = (sbits >> 23) - 127
    s_ref = tl.max(tl.where(tmask, s_r, -1000))
    # Scales 2^-126 .. 2^100 (positive normals; the bytes kernel's products stay finite).
    ok = (s_ref <= 100) & (tl.min(tl.where(tmask, s_r, 0)) >= -126)
    d = s_ref - s_r
    tf = tl.where(tmask & (d <= 21), (22 - d) << 10, 0) * 0x10001                     # 2^(7 - d), twice
    mask5 = tmask[:, None, None, :, :]
    x = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + tok[:, None, None, :, :] * K4
                + (col0 // 4 + gw)[None, :, :, None, None], mask=mask5, other=0)
    if tl.max(tl.where(tmask, d, 0)) > 21:
        far = (tmask & (d > 21))[:, None, None, :, :]
        ok = ok & (tl.max(tl.where(far, x & 0x7F7F7F7F, 0)) == 0)
    tf = tf[:, None, None, :, :]
    if ASM:
        lo, hi = e4m3x4_to_f16x2_asm(x)
        a_lo = mul_f16x2_asm(lo, tf)
        a_hi = mul_f16x2_asm(hi, tf)
        m_lo = tl.reduce(tl.reduce(tl.reduce(a_lo, 4, _max_abs_f16x2_asm_combine), 3, _max_abs_f16x2_asm_combine),
                         0, _max_abs_f16x2_asm_combine)
        m_hi = tl.reduce(tl.reduce(tl.reduce(a_hi, 4, _max_abs_f16x2_asm_combine), 3, _max_abs_f16x2_asm_combine),
                         0, _max_abs_f16x2_asm_combine)
    else:
        lo, hi = e4m3x4_to_f16x2(x)
        a_lo = mul_f16x2(lo, tf)
        a_hi = mul_f16x2(hi, tf)
        m_lo = _column_max_abs_f16x2(a_lo)
        m_hi = _column_max_abs_f16x2(a_hi)
    # The path test comes in two parts. The scalar one (scales, far tokens) decides before the float16
    # path runs; a column past float16 (g > 22) is only known after it has run, and then the general
    # path rewrites the whole tile (after a barrier, so its stores land after the float16 path's).
    # Testing the columns before the branch instead kept every column's S and factor live across it
    # and cost 40-60 registers per thread (Triton 3.6, one warp: 162 at G = 2 against 104 now).
    bad = False
    if ok:
        S0, f0, bad0 = _f16_column_scale(m_lo, s_ref)                                  # [G, 4] each
        S1, f1, bad1 = _f16_column_scale(m_lo >> 16, s_ref)
        S2, f2, bad2 = _f16_column_scale(m_hi, s_ref)
        S3, f3, bad3 = _f16_column_scale(m_hi >> 16, s_ref)
        cf_lo = (f0 | (f1 << 16))[None, :, :, None, None]
        cf_hi = (f2 | (f3 << 16))[None, :, :, None, None]
        if ASM:
            y = f16x2x2_to_e4m3x4_asm(mul_f16x2_asm(a_lo, cf_lo), mul_f16x2_asm(a_hi, cf_hi))
        else:
            y = f16x2x2_to_e4m3x4(mul_f16x2(a_lo, cf_lo), mul_f16x2(a_hi, cf_hi))
        b0, b1, b2, b3 = _quad_bytes_transpose(y, G, ASM)
        qg = pid_t * 32 + quad
        col = col0 + gw * 4                                                           # [G, 4]
        obase = o_ptr.to(tl.pointer_type(tl.int32)) + col[None, :, :, None].to(tl.int64) * M4 + qg[:, None, None, :]
        omask = (qg < M4)[:, None, None, :]
        tl.store(obase, b0, mask=omask)
        tl.store(obase + M4, b1, mask=omask)
        tl.store(obase + 2 * M4, b2, mask=omask)
        tl.store(obase + 3 * M4, b3, mask=omask)
        sbase = os_ptr + pid_t.to(tl.int64) * K + col
        tl.store(sbase, pow2_f32(S0))
        tl.store(sbase + 1, pow2_f32(S1))
        tl.store(sbase + 2, pow2_f32(S2))
        tl.store(sbase + 3, pow2_f32(S3))
        bad = tl.max((bad0 | bad1 | bad2 | bad3).to(tl.int32)) != 0
    if (not ok) or bad:
        tl.debug_barrier()
        _fp8_colwise_general(q_ptr, s_ptr, o_ptr, os_ptr, M, K, pid_t, col0, 16 * G)


def mxfp4_to_fp8_colwise(data: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor | None = None, nb: int = 2,
                         num_warps: int = 1, asm: bool | None = None):
    """data uint8 [M, K/2], scale uint8 [M, K/32] -> (data float8_e4m3fn [K, M], scale float32
    [K, ceil(M/128)] M-major); bit-identical to mxfp4_to_fp8_colwise_ref. With M % 4 == 0 the kernel
    writes four tokens per 32-bit word (SWAR); nb (MXFP4 blocks of columns per program, a power of
    two; 2 from an H200 sweep, bench/RESULTS.md) and num_warps configure it, and asm: None = its
    prmt / max.u16x2 forms on sm_90+ outside the interpreter (use_asm), True / False to force them or
    their pure-Triton twins. Other M take the one-code-per-operation kernel at its own configuration
    (nb = 1, 4 warps). rows: optional int32/int64 [M'] indices into data's rows (in range; not checked
    here: moe_fp4.formats.conversions checks them): converts data[rows] (out [K, M'], M = M' above) reading each token's
    row in place, e.g. the experts' rows from the tokens' MXFP4 copies without gathering them first."""
    half_k = data.shape[1]
    m = data.shape[0] if rows is None else rows.shape[0]
    k = 2 * half_k
    kb = k // MXFP4_BLOCK
    out = torch.empty(k, m, dtype=torch.float8_e4m3fn, device=data.device)
    nt = triton.cdiv(m, FP8_TILE)
    oscale = empty_m_major(k, nt, data.device)
    if m and k:
        scale = scale if scale.stride(1) == 1 else scale.contiguous()
        rows = None if rows is None else rows.contiguous()
        r_arg = scale if rows is None else rows
        if m % 4:
            data = data if data.stride(1) == 1 else data.contiguous()
            _mxfp4_to_fp8_colwise_bytes_kernel[(nt, kb)](
                data, scale, r_arg, out.view(torch.uint8), oscale, m, k, kb, data.stride(0), scale.stride(0),
                BLOCK_T=FP8_TILE, NB=1, GATHER=rows is not None, num_warps=4)
            return out, oscale
        if data.stride(1) != 1 or data.stride(0) % 4 or data.data_ptr() % 4:  # rows as 32-bit words
            data = data.clone(memory_format=torch.contiguous_format)
        nb = min(nb, triton.next_power_of_2(kb))
        _mxfp4_to_fp8_colwise_kernel[(triton.cdiv(kb, nb) * nt,)](
            data, scale, r_arg, out.view(torch.uint8), oscale, m, m // 4, k, kb, data.stride(0), scale.stride(0),
            NB=nb, ASM=use_asm(data) if asm is None else asm, GATHER=rows is not None, num_warps=num_warps)
    return out, oscale


def fp8_to_fp8_colwise(data: torch.Tensor, scale: torch.Tensor, g: int = 4, num_warps: int = 1,
                       asm: bool | None = None):
    """data float8_e4m3fn [M, K] (K % 128 == 0), scale float32 [M, K/128] -> (data float8_e4m3fn [K, M],
    scale float32 [K, ceil(M/128)] M-major); bit-identical to fp8_to_fp8_colwise_ref. With M % 4 == 0
    the kernel works on float16x2 pairs and writes four tokens per 32-bit word; g (16-column groups
    per program: 1, 2, 4 or 8; 4 reads 64 bytes of each token row, from an H200 sweep, bench/RESULTS.md)
    and num_warps configure it, and asm: None = its cvt / float16x2 PTX on sm_90+ outside the
    interpreter (use_asm), True / False to force them or their pure-Triton twins.
    Other M take the one-value-per-operation kernel (32 columns, 4 warps)."""
    m, k = data.shape
    out = torch.empty(k, m, dtype=torch.float8_e4m3fn, device=data.device)
    nt = triton.cdiv(m, FP8_TILE)
    oscale = empty_m_major(k, nt, data.device)
    if m and k:
        if g not in (1, 2, 4, 8):
            raise ValueError(f"fp8_to_fp8_colwise: g must be 1, 2, 4 or 8, got {g}")
        data = data if data.is_contiguous() else data.contiguous()
        scale = m_major(scale)
        if m % 4:
            _fp8_to_fp8_colwise_bytes_kernel[(nt, triton.cdiv(k, 32))](
                data.view(torch.uint8), scale, out.view(torch.uint8), oscale, m, k,
                BLOCK_T=FP8_TILE, BLOCK_K=32, num_warps=4)
            return out, oscale
        if data.data_ptr() % 16:                                     # rows as 16-byte vectors
            data = data.clone()
        _fp8_to_fp8_colwise_kernel[(nt * (k // (16 * g)),)](
            data.view(torch.uint8), scale, out.view(torch.uint8), oscale, m, m // 4, k, k // 4,
            G=g, ASM=use_asm(data) if asm is None else asm, num_warps=num_warps)
    return out, oscale


# ---------------------------------------------------------------------------------------------
# Cast + transpose: FP8 1x128 of X and of X^T from one read of a high-precision X (the dgrad /
# wgrad operands of one tensor). Today's alternative is quantize_fp8_rowwise(x) plus
# quantize_fp8_rowwise(x.t().contiguous()): a transpose copy and a second read.

_CAST_T_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_cast_transpose_input(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _CAST_T_DTYPES:
        raise TypeError(f"{name}: x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    if m % FP8_TILE or k % FP8_TILE:
        raise ValueError(f"{name}: M and K must be multiples of {FP8_TILE}, got [M, K] = [{m}, {k}]")
    if not x.is_contiguous():
        raise ValueError(f"{name}: x must be contiguous, got strides {x.stride()}")


def quantize_fp8_rowwise_colwise_ref(x: torch.Tensor, rowwise: bool = True, colwise: bool = True):
    """x: bf16/fp16/fp32 [M, K] contiguous, M and K multiples of 128
    -> (rows, cols): rows = quantize_fp8_rowwise_ref(x) = (data float8_e4m3fn [M, K], scale float32
    [M, K/128] strides (1, M)) or None; cols = quantize_fp8_rowwise_ref(x.t().contiguous()) = (data
    float8_e4m3fn [K, M], scale float32 [K, M/128] strides (1, K)) or None: 1x128 tiles along M."""
    _check_cast_transpose_input(x, "quantize_fp8_rowwise_colwise_ref")
    rows = quantize_fp8_rowwise_ref(x) if rowwise else None
    cols = quantize_fp8_rowwise_ref(x.t().contiguous()) if colwise else None
    return rows, cols


@triton.jit
def _cast_transpose_fp8_kernel(x_ptr, r_ptr, rs_ptr, c_ptr, cs_ptr, M, K,
                               IN_DTYPE: tl.constexpr, WRITE_ROWS: tl.constexpr, WRITE_COLS: tl.constexpr,
                               TILE: tl.constexpr, SUB: tl.constexpr, TILES_K: tl.constexpr, ASM: tl.constexpr):
    # A program: one tile of TILE (=128) tokens x TILES_K column tiles of TILE, one [TILE, TILE] block
    # at a time, in column slices [TILE, SUB]. A slice holds all 128 tokens of its columns, so its
    # column amax is the scale of each of its columns of X^T. The row amax of a token spans the whole
    # block: with SUB < TILE a first pass over the slices reduces it (only the [TILE] maxima stay in
    # registers) and the encoding pass reads the block again (from L1/L2: HBM sees one read). With
    # SUB == TILE the block is loaded once and both amaxes come from the same registers.
    # ptxas for sm_90a (Triton 3.6, bf16, both outputs, 8 warps): SUB 32 -> 64 registers, SUB 128 ->
    # 152; no spills. An all-finite fast path (the row-wise kernel's unsaturated encoding behind a
    # per-block branch) doubled the registers, so every element takes e4m3_rne (3 more ops), or with
    # ASM its one-instruction PTX form e4m3_rne_asm (the same bytes).
    pid_m = tl.program_id(0)
    tok = pid_m.to(tl.int64) * TILE + tl.arange(0, TILE).to(tl.int64)          # [T] rows of X
    sub = tl.arange(0, SUB).to(tl.int64)
    for j in range(TILES_K):
        t = tl.program_id(1) * TILES_K + j                                      # column tile of X
        col0 = t.to(tl.int64) * TILE
        if WRITE_ROWS:
            if SUB < TILE:
                rmax = tl.zeros([TILE], dtype=tl.int32)
                for c in range(TILE // SUB):
                    raw = tl.load(x_ptr + tok[:, None] * K + (col0 + c * SUB + sub)[None, :])
                    a = in_bits_to_f32_bits(raw, IN_DTYPE) & 0x7FFFFFFF
                    rmax = tl.maximum(rmax, tl.max(tl.where(a < 0x7F800000, a, 0), axis=1))
                S_r = fp8_scale_exp(rmax)                                        # [T] per token
                tl.store(rs_ptr + t.to(tl.int64) * M + tok, pow2_f32(S_r))    # strides (1, M)
        for c in range(TILE // SUB):
            cols = col0 + c * SUB + sub                                         # [SUB] columns of X
            bits = in_bits_to_f32_bits(tl.load(x_ptr + tok[:, None] * K + cols[None, :]), IN_DTYPE)
            a = bits & 0x7FFFFFFF
            # Non-finite bits are >= 0x7F800000: they take no part in any amax (and encode as 0x7F).
            fin = tl.where(a < 0x7F800000, a, 0)
            v = bits.to(tl.float32, bitcast=True)
            if WRITE_ROWS:
                if SUB == TILE:
                    S_r = fp8_scale_exp(tl.max(fin, axis=1))                     # [T] per token
                    tl.store(rs_ptr + t.to(tl.int64) * M + tok, pow2_f32(S_r))
                # S <= 120 for finite data, so 2^-S is a normal float32 and the product exact.
                if ASM:
                    q_r = e4m3_rne_asm(v * pow2_f32(-tl.minimum(S_r, 126))[:, None])
                else:
                    q_r = e4m3_rne(v * pow2_f32(-tl.minimum(S_r, 126))[:, None])
                tl.store(r_ptr + tok[:, None] * K + cols[None, :], q_r.to(tl.uint8))
            if WRITE_COLS:
                S_c = fp8_scale_exp(tl.max(fin, axis=0))                         # [SUB] per column
                if ASM:
                    q_c = e4m3_rne_asm(v * pow2_f32(-tl.minimum(S_c, 126))[None, :])
                else:
                    q_c = e4m3_rne(v * pow2_f32(-tl.minimum(S_c, 126))[None, :])
                # Element (token, column) goes to out[column, token]. Storing the transposed [column,
                # token] tile makes tokens the fastest axis of both the registers' order and memory:
                # the compiler moves the bytes through shared memory and each output row segment of
                # 128 bytes is written by consecutive threads.
                tl.store(c_ptr + cols[:, None] * M + tok[None, :], tl.trans(q_c.to(tl.uint8)))
                tl.store(cs_ptr + pid_m.to(tl.int64) * K + cols, pow2_f32(S_c))  # strides (1, K)


def quantize_fp8_rowwise_colwise(x: torch.Tensor, rowwise: bool = True, colwise: bool = True,
                                 tiles_k: int = 1, slice_k: int = 128, num_warps: int = 8, asm: bool | None = None):
    """FP8 1x128 quantization of X (tiles along K) and of X^T (tiles along M) from one read of X.

    x: bf16/fp16/fp32 [M, K] contiguous, M and K multiples of 128 (M or K may be 0)
    -> (rows, cols): rows = (data float8_e4m3fn [M, K], scale float32 [M, K/128] strides (1, M)) or
    None; cols = (data float8_e4m3fn [K, M], scale float32 [K, M/128] strides (1, K)) or None.
    Bit-identical to quantize_fp8_rowwise_colwise_ref: rows to quantize_fp8_rowwise_ref(x), cols to
    quantize_fp8_rowwise_ref(x.t().contiguous()). NaN/Inf elements are the NaN byte 0x7F in both and
    take no part in either amax.

    Tuning: a program covers 128 tokens x ``tiles_k`` tiles of 128 columns (reduced to a divisor of
    K/128), looping over its 128 x 128 blocks, each in column slices of ``slice_k`` (16, 32, 64 or
    128; below 128 with ``rowwise`` a block is read twice, the second time from cache, to keep few
    registers per thread); ``num_warps`` per program. ``asm``: None = the PTX E4M3 rounding
    (e4m3_rne_asm) on sm_90+ outside the interpreter (use_asm), True / False to force it or e4m3_rne.
    Defaults from an H200 sweep (bench/tools/tune.py, 32768 x 7168 and x 4096): whole 128 x 128 blocks
    on 8 warps, faster than 32-column slices.
    """
    name = "quantize_fp8_rowwise_colwise"
    _check_cast_transpose_input(x, name)
    if tiles_k < 1 or num_warps < 1:
        raise ValueError(f"{name}: tiles_k and num_warps must be >= 1, got {tiles_k}, {num_warps}")
    if slice_k not in (16, 32, 64, 128):
        raise ValueError(f"{name}: slice_k must be 16, 32, 64 or 128, got {slice_k}")
    m, k = x.shape
    dev = x.device
    rows = ((torch.empty(m, k, dtype=torch.float8_e4m3fn, device=dev), empty_m_major(m, k // FP8_TILE, dev))
            if rowwise else None)
    cols = ((torch.empty(k, m, dtype=torch.float8_e4m3fn, device=dev), empty_m_major(k, m // FP8_TILE, dev))
            if colwise else None)
    if m and k and (rowwise or colwise):
        nt = k // FP8_TILE
        tiles_k = min(tiles_k, nt)
        while nt % tiles_k:
            tiles_k -= 1
        dummy = (rows or cols)[1]
        r, rs = (rows[0].view(torch.uint8), rows[1]) if rowwise else (dummy, dummy)
        c, cs = (cols[0].view(torch.uint8), cols[1]) if colwise else (dummy, dummy)
        raw = x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)
        _cast_transpose_fp8_kernel[(m // FP8_TILE, nt // tiles_k)](
            raw, r, rs, c, cs, m, k, IN_DTYPE=tl_dtype(x.dtype), WRITE_ROWS=rowwise, WRITE_COLS=colwise,
            TILE=FP8_TILE, SUB=slice_k, TILES_K=tiles_k, ASM=use_asm(x) if asm is None else asm,
            num_warps=num_warps)
    return rows, cols
