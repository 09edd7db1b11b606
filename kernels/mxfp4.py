"""MXFP4 quantize / dequantize: Triton kernels, their launchers, and pure-torch references.

Each launcher ``name`` has a twin ``name_ref`` with the same signature on plain 2-D tensors (plus
tuning keywords on the launcher); ``moe_fp4.formats._ops`` wraps them in the containers. The kernels read
and write *pair words* (two bf16/fp16 in an int32, two fp32 in an int64, two E4M3 in an int16), so
the two elements that share an MXFP4 byte come out of one load with a shift and a mask, no split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
    encode_e2m1_stochastic,
    exp2_int,
    mx_scale_exponent,
    pack_nibbles,
    random_bits,
    to_output,
    unpack_nibbles,
)
from moe_fp4.kernels.triton_numerics import (
    block_program,
    bytes_0246,
    bytes_0246_asm,
    ceil_log2_ratio_bits,
    e2m1_decode_scaled,
    e2m1x2_to_bf16x2,
    e4m3_to_f32_bits,
    e4m3x4_to_e2m1x4,
    f32_to_out_bits,
    load_pairs_as_f32_bits,
    max_u16x2_asm,
    mx_encode_bf16_pairs,
    mx_encode_pairs,
    mx_encode_pairs_stochastic,
    mx_scale_exp,
    pair_view,
    philox_pair_words,
    pow2_f32,
    row_chunks,
    row_column_grid,
    row_column_program,
    store_pair_words,
    u32_as_i32,
    use_asm,
    words_view,
)


def _encode_blocks(v: torch.Tensor, exp: torch.Tensor, nan_block: torch.Tensor, bits: torch.Tensor | None = None):
    """v: float32 [M, K] already scaled by 2^-E; exp: int32 [M, K/32]; nan_block: bool [M, K/32];
    bits: None (round to nearest even) or int64 [M, K] random bits (stochastic rounding)
    -> (data uint8 [M, K/2], scale uint8 [M, K/32]). NaN blocks get scale 0xFF and zero codes."""
    m, k = v.shape
    codes = (encode_e2m1(v) if bits is None else encode_e2m1_stochastic(v, bits)).view(m, k // MXFP4_BLOCK, MXFP4_BLOCK)
    codes = torch.where(nan_block[..., None], torch.zeros_like(codes), codes).view(m, k)
    scale = torch.where(nan_block, torch.full_like(exp, E8M0_NAN), exp + E8M0_BIAS).to(torch.uint8)
    return pack_nibbles(codes), scale


def write_out(out, data: torch.Tensor, scale: torch.Tensor):
    """The ``out=`` convention of the row-wise producers: None -> (data, scale) as computed; else copy
    them into the given (data, scale) tensors (e.g. row-strided views of an all-to-all wire buffer)
    and return those."""
    if out is None:
        return data, scale
    out[0].copy_(data)
    out[1].copy_(scale)
    return out


def check_row_views(out, m: int, data_cols: int, scale_cols: int, data_dtype, scale_dtype):
    """out = (data, scale): 2-D views of the given shapes and dtypes with unit column stride (a row
    stride of their own, e.g. one uint8 wire row holding both) -> out."""
    d, s = out
    assert d.shape == (m, data_cols) and d.dtype == data_dtype and d.stride(1) == 1, (d.shape, d.dtype, d.stride())
    assert s.shape == (m, scale_cols) and s.dtype == scale_dtype, (s.shape, s.dtype)
    return out


def quantize_mxfp4_rowwise_ref(x: torch.Tensor, out=None):
    """x: bf16/fp16/fp32 [M, K], K % 32 == 0 -> (data uint8 [M, K/2], scale uint8 [M, K/32]), or
    written into ``out`` = (data, scale) views of those shapes with unit column stride.

    Per 32-block: E = clamp(ceil(log2(amax/6)), -127, 127) (RCEIL: nothing clips), codes =
    RNE_E2M1(x * 2^-E). A block holding NaN or Inf gets scale 0xFF.
    """
    v, exp, nan_block = _scaled_blocks(x)
    return write_out(out, *_encode_blocks(v, exp, nan_block))


def _scaled_blocks(x: torch.Tensor):
    """x: [M, K] -> (v float32 [M, K] = x * 2^-E per 32-block, E int32 [M, K/32] (RCEIL), NaN-block mask)."""
    m, k = x.shape
    blocks = x.float().view(m, k // MXFP4_BLOCK, MXFP4_BLOCK)
    nan_block = (~torch.isfinite(blocks)).any(dim=-1)
    amax = torch.where(nan_block[..., None], torch.zeros_like(blocks), blocks.abs()).amax(dim=-1)
    exp = mx_scale_exponent(amax)
    # x * 2^-E is exact: the result is at most 6 and 2^-E in [2^-127, 2^127] is representable.
    # (2^127 * x cannot overflow: E = -127 only when amax <= 6 * 2^-127.)
    return (blocks * exp2_int(-exp)[..., None]).view(m, k), exp, nan_block


def quantize_mxfp4_stochastic_ref(x: torch.Tensor, seed: int, step: int = 0, rank: int = 0, out=None):
    """x: bf16/fp16/fp32 [M, K], K % 32 == 0 -> (data uint8 [M, K/2], scale uint8 [M, K/32]), or written
    into ``out`` = (data, scale) views of those shapes with unit column stride (a wire's rows): the scales of
    quantize_mxfp4_rowwise_ref, the codes rounded stochastically (``encode_e2m1_stochastic``) with the
    bits ``random_bits(seed, step, rank, M * K)`` of each element's row-major offset. Unbiased: the mean
    over (seed, step) of the dequantized values is x (RCEIL scales never clip; up to 2^-16 of the grid
    spacing, the bits' resolution)."""
    m, k = x.shape
    v, exp, nan_block = _scaled_blocks(x)
    bits = random_bits(seed, step, rank, m * k, x.device).view(m, k)
    return write_out(out, *_encode_blocks(v, exp, nan_block, bits))


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

    A value past dtype's largest finite magnitude saturates to it, sign kept (numerics.to_output):
    in float32 and bf16 E8M0 byte 254 (2^127) with |code| >= 2 and byte 253 with |code| >= 4, in
    float16 every value of 2^16 and more (e.g. code 4.0 at byte 141).
    """
    m, half_k = data.shape
    k = 2 * half_k
    vals = decode_e2m1(unpack_nibbles(data)).view(m, k // MXFP4_BLOCK, MXFP4_BLOCK)
    e = scale.to(torch.int32) - E8M0_BIAS
    out = vals * exp2_int(e.clamp(max=MX_EXP_MAX))[..., None]
    return to_output(out, dtype, (scale == E8M0_NAN)[..., None]).view(m, k)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _quantize_mxfp4_kernel(
    x_ptr, data_ptr, scale_ptr,
    M, KB,                      # rows, number of 32-blocks per row
    stride_xm,                  # row stride of x in pair words
    stride_dm, stride_sm,       # row strides of data (bytes) and scale (bytes)
    IN_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_K // 32
    rows, kb, mask2, mask3, pair = block_program(M, KB, BLOCK_M, NB)
    offs = rows[:, None, None] * stride_xm + pair
    if IN_DTYPE == tl.bfloat16:
        # BF16: two elements per operation on the pair words as loaded (mx_encode_bf16_pairs). Each
        # thread holds whole blocks ([1, 1, 16] per thread), so the block maximum needs no shuffle;
        # the row_chunks layout (a block over 4 threads) is slower (bench/RESULTS.md).
        packed, scale = mx_encode_bf16_pairs(tl.load(x_ptr + offs, mask=mask3, other=0), 2, ASM)
    else:
        lo, hi = load_pairs_as_f32_bits(x_ptr, offs, mask3, IN_DTYPE)
        # amax on the bits: |x| bits are monotone in |x|; NaN/Inf (>= 0x7F800000) are the largest.
        lo_abs = lo & 0x7FFFFFFF
        hi_abs = hi & 0x7FFFFFFF
        amax_bits = tl.max(tl.maximum(lo_abs, hi_abs), axis=2)                      # [BM, NB]
        nan_blk = amax_bits >= 0x7F800000
        E = mx_scale_exp(amax_bits)
        # 2^-E: for finite amax E <= 126 (amax < 2^128 gives at most 254 - 129 + 1), so -E is in
        # [-126, 127] and 2^-E is a normal float32. The min() only matters for NaN blocks (overwritten).
        mult = pow2_f32(-tl.minimum(E, 126))
        # No saturation needed: E = ceil(log2(amax / 6)) unclamped gives |x| * 2^-E <= 6 exactly, the
        # -127 floor only makes |v| smaller, and the 127 ceiling is unreachable for finite input.
        packed, scale = mx_encode_pairs(lo, hi, lo_abs, hi_abs, E, nan_blk, mult, False)

    tl.store(data_ptr + rows[:, None, None] * stride_dm + pair, packed.to(tl.uint8), mask=mask3)
    tl.store(scale_ptr + rows[:, None] * stride_sm + kb[None, :], scale.to(tl.uint8), mask=mask2)


@triton.jit
def _quantize_mxfp4_stochastic_kernel(
    x_ptr, data_ptr, scale_ptr, M, KB, stride_xm, stride_dm, stride_sm, seed, step, rank,
    IN_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # _quantize_mxfp4_kernel's scales (its general path, on fp32 bits), the codes rounded stochastically.
    NB: tl.constexpr = BLOCK_K // 32
    rows, kb, mask2, mask3, pair = block_program(M, KB, BLOCK_M, NB)
    lo, hi = load_pairs_as_f32_bits(x_ptr, rows[:, None, None] * stride_xm + pair, mask3, IN_DTYPE)
    lo_abs = lo & 0x7FFFFFFF
    hi_abs = hi & 0x7FFFFFFF
    amax_bits = tl.max(tl.maximum(lo_abs, hi_abs), axis=2)
    nan_blk = amax_bits >= 0x7F800000
    E = mx_scale_exp(amax_bits)
    mult = pow2_f32(-tl.minimum(E, 126))
    words = philox_pair_words(seed, step, rank, rows, kb, KB, 16)
    packed, scale = mx_encode_pairs_stochastic(lo, hi, lo_abs, hi_abs, E, nan_blk, mult, words)
    tl.store(data_ptr + rows[:, None, None] * stride_dm + pair, packed.to(tl.uint8), mask=mask3)
    tl.store(scale_ptr + rows[:, None] * stride_sm + kb[None, :], scale.to(tl.uint8), mask=mask2)


@triton.jit
def _dequantize_mxfp4_kernel(
    data_ptr, scale_ptr, out_ptr,
    M, KB, stride_dm, stride_sm, stride_om,     # stride_om in output pair words
    OUT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # The exact float32 value of each code (e2m1_decode_scaled: +-Inf past float32), then the one
    # rounding and saturation of f32_to_out_bits.
    NB: tl.constexpr = BLOCK_K // 32
    rows, kb, mask2, mask3, pair = block_program(M, KB, BLOCK_M, NB)

    b = tl.load(data_ptr + rows[:, None, None] * stride_dm + pair, mask=mask3, other=0).to(tl.int32)
    s = tl.load(scale_ptr + rows[:, None] * stride_sm + kb[None, :], mask=mask2, other=0).to(tl.int32)
    nan = (s == 255)[:, :, None]
    s3 = s[:, :, None]
    lo = f32_to_out_bits(e2m1_decode_scaled(b & 15, s3).to(tl.float32, bitcast=True), nan, OUT_DTYPE)
    hi = f32_to_out_bits(e2m1_decode_scaled(b >> 4, s3).to(tl.float32, bitcast=True), nan, OUT_DTYPE)
    store_pair_words(out_ptr, rows[:, None, None] * stride_om + pair, lo, hi, mask3, OUT_DTYPE)


@triton.jit
def _dequantize_mxfp4_bf16_kernel(
    data_ptr, scale_ptr, out_ptr,
    M, KB, stride_dm, stride_sm, stride_om,     # stride_om in output pair words
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Each MXFP4 byte (two codes) becomes one int32 word of two BF16, at the same index. Loaded and
    # stored as [BM, NB * 4 chunks, 4] (row_chunks), decoded as [BM, NB, 4, 4]: a last axis of 4 gives
    # the byte loads and the word stores the same 4 elements per thread, so both use one register
    # layout (see _mxfp4_to_fp8_kernel in fp8.py).
    NB: tl.constexpr = BLOCK_K // 32
    rows, kb, mask2, _mask3, _ = block_program(M, KB, BLOCK_M, NB)
    _rb, cb = row_column_program()
    pair, mask_c = row_chunks(rows, M, cb * (NB * 16), KB * 16, NB * 16, 4)
    b = tl.load(data_ptr + rows[:, None, None] * stride_dm + pair, mask=mask_c, other=0).to(tl.int32)
    b = tl.reshape(b, [BLOCK_M, NB, 4, 4])
    s = tl.load(scale_ptr + rows[:, None] * stride_sm + kb[None, :], mask=mask2, other=2).to(tl.int32)
    nan = (s == 255)[:, :, None, None]
    s_fin = tl.where(s == 255, 2, s)
    s3 = s_fin[:, :, None, None]
    if (tl.min(s_fin) >= 2) & (tl.max(s_fin) <= 252):
        # Every block's values are BF16 normals or zero (and below bf16's largest finite): two codes
        # per operation. The byte times 0x1001 puts its low code in bits 0..3 and its high code in
        # bits 16..19 (the other bits are ignored by e2m1x2_to_bf16x2).
        word = e2m1x2_to_bf16x2(b * 0x1001, s3)
    else:
        # Subnormal or overflowing blocks, one code at a time: exact fp32 bits (one mantissa bit, so
        # bf16 holds them exactly), saturated past bf16's range by f32_to_out_bits.
        lo = e2m1_decode_scaled(b & 15, s3).to(tl.float32, bitcast=True)
        hi = e2m1_decode_scaled(b >> 4, s3).to(tl.float32, bitcast=True)
        lo = f32_to_out_bits(lo, nan, tl.bfloat16, EXACT=True)
        word = lo | (f32_to_out_bits(hi, nan, tl.bfloat16, EXACT=True) << 16)
    word = tl.reshape(tl.where(nan, 0x7FC07FC0, word), [BLOCK_M, NB * 4, 4])
    tl.store(out_ptr + rows[:, None, None] * stride_om + pair, word, mask=mask_c)


@triton.jit
def _fp8_to_mxfp4_kernel(
    q_ptr, s_ptr, data_ptr, scale_ptr,
    M, KB,
    stride_qm,                  # row stride of the FP8 data in int32 words (4 bytes each)
    stride_sm, stride_st,       # FP8 scale strides (elements): row, tile
    stride_dm, stride_om,       # MXFP4 data row stride in int32 words (8 codes each) / scale row stride (bytes)
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
):
    # FP8 bytes as int32 words ([M, K/4]) and MXFP4 codes as int32 words ([M, K/8]): input words 2j
    # and 2j+1 become output word j. A program covers [BLOCK_M, BLOCK_K] as [BM, NB blocks, 2, 4
    # words]: a last axis of 4 gives 16-byte loads, and its pairs (split in registers) give the
    # [BM, NB, 2, 2] output words with no layout conversion. ASM (CUDA only) selects one-instruction
    # PTX for the lane maximum and the byte gather; the pure-Triton twins give the same bits.
    NB: tl.constexpr = BLOCK_K // 32
    rows, kb, mask2, mask3, _pairs = block_program(M, KB, BLOCK_M, NB, True)
    word = ((kb * 8)[None, :, None, None] + (tl.arange(0, 2) * 4)[None, None, :, None]
            + tl.arange(0, 4)[None, None, None, :])
    mask4 = mask3[:, :, :, None]
    w = tl.load(q_ptr + rows[:, None, None, None] * stride_qm + word, mask=mask4, other=0)
    # max |q| on the codes: E4M3 magnitude bytes (b & 0x7F) are monotone in |q|; NaN is 0x7F. Bytes
    # 0, 2 and 1, 3 go to separate words as 16-bit lanes (m and m << 8, both below 0x8000), so one
    # max.u16x2 compares two bytes; the two lane sets meet at the end.
    if ASM:
        lo = tl.reduce(tl.reduce(w & 0x007F007F, 3, max_u16x2_asm), 2, max_u16x2_asm)         # [BM, NB]
        hi = tl.reduce(tl.reduce(w & 0x7F007F00, 3, max_u16x2_asm), 2, max_u16x2_asm)
        lanes = max_u16x2_asm(lo << 8, hi)
        qmax = tl.maximum(lanes & 0xFFFF, (lanes >> 16) & 0xFFFF) >> 8
    else:
        # The same maximum byte by byte with tl.max: the interpreter runs a reduction with a user
        # combine function (max15x2) one element at a time (24 s for 256 x 1024 on the CI machine).
        m = tl.maximum(tl.maximum(w & 0x7F, (w >> 8) & 0x7F), tl.maximum((w >> 16) & 0x7F, (w >> 24) & 0x7F))
        qmax = tl.max(tl.max(m, axis=3), axis=2)
    nan_blk = qmax == 0x7F
    zero_blk = qmax == 0
    # Tile scale 2^S (float32 power of two, normal): S from its exponent field.
    sbits = tl.load(s_ptr + rows[:, None] * stride_sm + (kb // 4).to(tl.int64)[None, :] * stride_st,
                    mask=mask2, other=1.0).to(tl.int32, bitcast=True)
    S = (sbits >> 23) - 127
    # For a normal qmax = f.mmm (byte f << 3 | mmm), ceil(log2(qmax / 6)) = f - 9 + [mmm > 4]
    # = ((qmax + 3) >> 3) - 9 (1.mmm / 1.5 exceeds 1 iff mmm > 4). The SWAR path needs it >= -4
    # (qmax >= 0x25, which also makes qmax normal), no clamp at E = 127 (that one saturates) and no
    # NaN block (rare: NaN blocks take the general path, which zeroes their codes).
    e_fast = ((qmax + 3) >> 3) - 9
    special = zero_blk | ~mask2
    slow = nan_blk | (~special & ((qmax < 0x25) | (S + e_fast > 127)))
    if tl.max(slow.to(tl.int32)) == 0:
        # E = max(S + e_rel, -127); every value is at most 6 * 2^sh with sh = E - S in [-4, 7]:
        # four codes per integer operation. A zero block takes sh = 7, where its bytes stay in range
        # (zeros encode as signed zeros).
        E = tl.where(zero_blk, -127, tl.maximum(S + e_fast, -127))
        sh = tl.where(zero_blk, 7, E - S)
        c = e4m3x4_to_e2m1x4(w, sh[:, :, None, None])
        # Byte lanes (c0, c1, c2, c3) -> c + (c >> 4): bytes 0 and 2 are the MXFP4 bytes c0 | c1 << 4
        # and c2 | c3 << 4 (codes are 4 bits, so nothing carries into them; bytes 1, 3 are unused).
        p_lo, p_hi = tl.split(tl.reshape(c + (c >> 4), [BLOCK_M, NB, 2, 2, 2]))
        if ASM:
            codes = bytes_0246_asm(p_lo, p_hi)
        else:
            codes = bytes_0246(p_lo, p_hi)
    else:
        # General path, one element at a time. E = clamp(S + ceil(log2(qmax/6)), -127, 127); qmax
        # is never subnormal in float32 (E4M3's smallest is 2^-9), but qmax == 0 must give E = -127
        # whatever S is: the reference's e_rel is -1000 clamped to -255; ceil_log2_ratio_bits would
        # give -129 (not low enough for S >= -1). v = q * 2^(S - E): S - E is in [-7, 11] for a
        # nonzero block (see quantize_mxfp4_from_fp8_ref), larger for a zero block (value irrelevant:
        # zeros stay signed zeros); capped at 127 so 2^(S-E) is a normal float32 and v is exact.
        e_rel = ceil_log2_ratio_bits(e4m3_to_f32_bits(qmax), 0x400000, 2)
        e_rel = tl.where(zero_blk, -255, e_rel)
        E = tl.minimum(tl.maximum(S + e_rel, -127), 127)
        mult = pow2_f32(tl.minimum(S - E, 127))[:, :, None]
        E3 = E[:, :, None]
        nan3 = nan_blk[:, :, None]
        c16 = tl.zeros_like(w)
        for j in tl.static_range(2):
            lo8 = e4m3_to_f32_bits((w >> (16 * j)) & 0xFF)
            hi8 = e4m3_to_f32_bits((w >> (16 * j + 8)) & 0xFF)
            # Saturate: where E hit its 127 ceiling, q * 2^(S-E) can exceed 6 (the reference saturates).
            pair, _ = mx_encode_pairs(lo8, hi8, lo8 & 0x7FFFFFFF, hi8 & 0x7FFFFFFF, E3, nan3, mult, True)
            c16 |= pair << (8 * j)
        c_lo, c_hi = tl.split(tl.reshape(c16, [BLOCK_M, NB, 2, 2, 2]))
        codes = c_lo | (c_hi << 16)
    scale = tl.where(nan_blk, 255, E + 127)
    out = ((kb * 4)[None, :, None, None] + (tl.arange(0, 2) * 2)[None, None, :, None]
           + tl.arange(0, 2)[None, None, None, :])
    tl.store(data_ptr + rows[:, None, None, None] * stride_dm + out, codes, mask=mask4)
    tl.store(scale_ptr + rows[:, None] * stride_om + kb[None, :], scale.to(tl.uint8), mask=mask2)


def quantize_mxfp4_rowwise(x: torch.Tensor, out=None, block_m: int = 4, block_k: int = 1024, num_warps: int = 2,
                           asm: bool | None = None):
    """x: bf16/fp16/fp32 [M, K], K % 32 == 0 -> (data uint8 [M, K/2], scale uint8 [M, K/32]), or
    written into ``out`` = (data, scale) views with unit column stride (one pass either way).
    asm (BF16 input): None = max.u16x2 and fma.rn.bf16x2 on sm_90+ outside the interpreter (use_asm),
    True / False to force them or their pure-Triton twins. Defaults (4 rows x 1024 columns on 2 warps)
    from the H200 sweep in bench/RESULTS.md."""
    assert x.dim() == 2 and x.shape[1] % MXFP4_BLOCK == 0, x.shape
    m, k = x.shape
    x = x.contiguous()
    if out is None:
        data = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
        scale = torch.empty(m, k // MXFP4_BLOCK, dtype=torch.uint8, device=x.device)
    else:
        data, scale = check_row_views(out, m, k // 2, k // MXFP4_BLOCK, torch.uint8, torch.uint8)
    if m == 0 or k == 0:
        return data, scale
    block_k = min(block_k, triton.next_power_of_2(k))
    words, mode = pair_view(x)
    kb = k // MXFP4_BLOCK
    grid = row_column_grid(triton.cdiv(m, block_m), triton.cdiv(k, block_k))
    _quantize_mxfp4_kernel[grid](
        words, data, scale, m, kb, words.stride(0), data.stride(0), scale.stride(0),
        IN_DTYPE=mode, BLOCK_M=block_m, BLOCK_K=block_k, ASM=use_asm(x) if asm is None else asm,
        num_warps=num_warps,
    )
    return data, scale


def quantize_mxfp4_stochastic(x: torch.Tensor, seed: int, step: int = 0, rank: int = 0, out=None,
                              block_m: int = 4, block_k: int = 512, num_warps: int = 4):
    """quantize_mxfp4_stochastic_ref's contract and bytes: x bf16/fp16/fp32 [M, K], K % 32 == 0 -> (data
    uint8 [M, K/2], scale uint8 [M, K/32]) or written into ``out``'s views in the same pass, the codes
    rounded stochastically with the Philox bits of (seed, step, rank, element offset) computed in the
    kernel."""
    assert x.dim() == 2 and x.shape[1] % MXFP4_BLOCK == 0, x.shape
    m, k = x.shape
    x = x.contiguous()
    if out is None:
        data = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
        scale = torch.empty(m, k // MXFP4_BLOCK, dtype=torch.uint8, device=x.device)
    else:
        data, scale = check_row_views(out, m, k // 2, k // MXFP4_BLOCK, torch.uint8, torch.uint8)
    if m == 0 or k == 0:
        return data, scale
    block_k = min(block_k, triton.next_power_of_2(k))
    words, mode = pair_view(x)
    grid = row_column_grid(triton.cdiv(m, block_m), triton.cdiv(k, block_k))
    _quantize_mxfp4_stochastic_kernel[grid](
        words, data, scale, m, k // MXFP4_BLOCK, words.stride(0), data.stride(0), scale.stride(0),
        seed, u32_as_i32(step), u32_as_i32(rank), IN_DTYPE=mode, BLOCK_M=block_m, BLOCK_K=block_k,
        num_warps=num_warps)
    return data, scale


def dequantize_mxfp4(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                     block_m: int | None = None, block_k: int | None = None, num_warps: int | None = None):
    """data uint8 [M, K/2], scale uint8 [M, K/32] (each with unit column stride; the rows may be
    strided, e.g. views of a received wire buffer) -> dtype [M, K] (bit-identical to dequantize_mxfp4_ref).
    Tuning defaults (H200 sweeps in bench/RESULTS.md): BF16 output (the two-codes-per-operation
    kernel, row_chunks layout) 2 rows x 1024 columns on 2 warps; FP16/FP32 4 x 1024 on 4 warps."""
    bf16 = dtype == torch.bfloat16
    block_m = block_m or (2 if bf16 else 4)
    block_k = block_k or 1024
    num_warps = num_warps or (2 if bf16 else 4)
    m, half_k = data.shape
    k = 2 * half_k
    assert k % MXFP4_BLOCK == 0 and scale.shape == (m, k // MXFP4_BLOCK)
    out = torch.empty(m, k, dtype=dtype, device=data.device)
    if m == 0 or k == 0:
        return out
    data = data if data.stride(1) == 1 else data.contiguous()
    scale = scale if scale.stride(1) == 1 else scale.contiguous()
    words, mode = pair_view(out)
    block_k = min(block_k, triton.next_power_of_2(k))
    grid = row_column_grid(triton.cdiv(m, block_m), triton.cdiv(k, block_k))
    if dtype == torch.bfloat16:
        _dequantize_mxfp4_bf16_kernel[grid](
            data, scale, words, m, k // MXFP4_BLOCK, data.stride(0), scale.stride(0), words.stride(0),
            BLOCK_M=block_m, BLOCK_K=block_k, num_warps=num_warps,
        )
        return out
    _dequantize_mxfp4_kernel[grid](
        data, scale, words, m, k // MXFP4_BLOCK, data.stride(0), scale.stride(0), words.stride(0),
        OUT_DTYPE=mode, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=num_warps,
    )
    return out


def quantize_mxfp4_from_fp8(data: torch.Tensor, scale: torch.Tensor,
                            block_m: int = 4, block_k: int = 1024, num_warps: int = 4, asm: bool | None = None):
    """data float8_e4m3fn [M, K] (K % 128 == 0), scale float32 [M, K/128] (any strides, e.g. (1, M))
    -> (data uint8 [M, K/2], scale uint8 [M, K/32]); bit-identical to quantize_mxfp4_from_fp8_ref.
    Defaults from bench/tools/tune.py on the H200 (one-warp programs stop at 32 resident programs, half
    the SM's warps). asm: None = the PTX lane maximum and byte gather on
    sm_90+ outside the interpreter (use_asm), True / False to force them or their pure-Triton twins."""
    m, k = data.shape
    assert k % FP8_TILE == 0 and scale.shape == (m, k // FP8_TILE)
    assert scale.dtype == torch.float32
    out = torch.empty(m, k // 2, dtype=torch.uint8, device=data.device)
    oscale = torch.empty(m, k // MXFP4_BLOCK, dtype=torch.uint8, device=data.device)
    if m == 0 or k == 0:
        return out, oscale
    words = words_view(data.contiguous().view(torch.uint8), torch.int32)
    out_words = out.view(torch.int32)
    block_k = min(block_k, triton.next_power_of_2(k))
    grid = row_column_grid(triton.cdiv(m, block_m), triton.cdiv(k, block_k), rows_fastest=True)
    _fp8_to_mxfp4_kernel[grid](
        words, scale, out_words, oscale, m, k // MXFP4_BLOCK, words.stride(0),
        scale.stride(0), scale.stride(1), out_words.stride(0), oscale.stride(0),
        BLOCK_M=block_m, BLOCK_K=block_k, ASM=use_asm(data) if asm is None else asm, num_warps=num_warps,
    )
    return out, oscale
