"""Triton device functions shared by every kernel: the element rules of numerics.py, written once.

Each function here mirrors a pure-torch rule in ``numerics.py`` and is tested bit for bit against it
(exhaustively where the domain allows). Kernels import these; nothing here launches anything.
Conventions: "bits" are int32 float32 bit patterns; E8M0 bytes and exponents are int32.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from moe_fp4.kernels.numerics import FINITE_MAX_BITS, NAN_BITS

# Read once, like triton.jit itself, which decides at decoration time whether to interpret.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# The dtype modes of the kernels: a kernel takes IN_DTYPE / OUT_DTYPE as a tl dtype constexpr and
# compares it with ==; every launcher maps a torch dtype through this one table (tl_dtype).
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
             torch.float8_e4m3fn: tl.float8e4nv}

# numerics.NAN_BITS and numerics.FINITE_MAX_BITS as compile-time constants of f32_to_out_bits.
_NAN_BF16 = tl.constexpr(NAN_BITS[torch.bfloat16])
_NAN_F16 = tl.constexpr(NAN_BITS[torch.float16])
_NAN_F32 = tl.constexpr(NAN_BITS[torch.float32])
_MAX_BF16 = tl.constexpr(FINITE_MAX_BITS[torch.bfloat16])
_MAX_F16 = tl.constexpr(FINITE_MAX_BITS[torch.float16])
_MAX_F32 = tl.constexpr(FINITE_MAX_BITS[torch.float32])


def tl_dtype(dtype: torch.dtype):
    """torch dtype -> the tl dtype a kernel's IN_DTYPE / OUT_DTYPE constexpr takes (TL_DTYPES)."""
    try:
        return TL_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {dtype}") from None


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def use_asm(t: torch.Tensor) -> bool:
    """Whether a kernel on t's device may take its inline-PTX path: CUDA sm_90 or newer (max.u16x2
    needs sm_90), not the interpreter (which cannot run PTX). Each such path has a pure-Triton twin
    that gives the same bits."""
    return t.is_cuda and not _INTERPRET and _sm90_or_newer(t.device.index if t.device.index is not None
                                                           else torch.cuda.current_device())


@triton.jit
def ceil_log2_ratio_bits(amax_bits, M_LIMIT: tl.constexpr, LOG2_HI: tl.constexpr):
    """int32 fp32-bits of amax (finite, >= 0) -> int32 smallest X with amax <= (1+m_limit)*2^(LOG2_HI+X).

    Same as numerics.ceil_log2_ratio except that zero / subnormal amax (biased exponent 0) gives
    -127 - LOG2_HI + {0,1} instead of -1000: every caller clamps to a floor >= that value (see callers).
    """
    biased = amax_bits >> 23
    mant = amax_bits & 0x7FFFFF
    return biased - 127 - LOG2_HI + (mant > M_LIMIT).to(tl.int32)


@triton.jit
def mx_scale_exp(amax_bits):
    """RCEIL E8M0 exponent: clamp(ceil(log2(amax/6)), -127, 127) from the fp32 bits of amax.

    6 = 1.5 * 2^2 -> mantissa limit 0x400000, log2_hi 2. Zero and subnormal amax have biased
    exponent 0 -> raw value -129 or -128 -> clamped to -127, exactly as the reference's -1000 is.
    """
    e = ceil_log2_ratio_bits(amax_bits, 0x400000, 2)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def pow2_f32(e):
    """int32 e in [-126, 127] -> float32 2^e built from the exponent field (a normal number)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_rne_mag(u, SAT: tl.constexpr):
    """u: int32 bits of |v| (finite, >= 0) -> int32 E2M1 magnitude code 0..7, round-to-nearest-even.

    SAT=True saturates everything above 6 to code 7. SAT=False is for callers that have proven
    |v| <= 6 (RCEIL scaling of finite data does: amax <= 6 * 2^E); larger inputs then give garbage.

    One float add does the rounding. The E2M1 grid has step 0.5 below 2 (0, .5, 1, 1.5, 2), step 1
    in [2, 4] (2, 3, 4) and step 2 in [4, 6] (4, 6). Adding the magic number M = 2^22, 2^23 or 2^24,
    whose ulp is exactly that step, makes the FPU round |v| to the grid with ties to even, and
    bits(M + n * step) - bits(M) = n. With c = clamp(exponent(|v|), 0, 2) (0 below 2, 1 in [2, 4),
    2 from 4) the code is n + 2c:
        1.75 (c = 0): 2^22 + 1.75 -> 2^22 + 2.0 (tie, to even), n = 4 -> code 4 (2.0)
        3.5  (c = 1): 2^23 + 3.5 -> 2^23 + 4 (tie, to even), n = 4 -> code 6 (4.0)
        5.0  (c = 2): 2^24 + 5 -> 2^24 + 4 (tie, to even), n = 2 -> code 6 (4.0);  6.0 -> n = 3 -> code 7
    M + |v| < 2M (|v| < 2^22), so the sum stays in M's binade. The add is one correctly rounded
    operation on an exact operand, so FMA contraction with a preceding exact x * 2^-E cannot change
    it, and neither can flush-to-zero (a subnormal |v| gives n = 0 either way). Above 6 with SAT the
    same formula gives codes >= 8 (Inf included: bits(Inf) - bits(M) is large) and the min() clamps.
    Per element: shift, clamp, two integer multiply-adds, the float add and a 3-input add, fewer
    integer-pipe operations than an integer-carry rounding plus a select.
    """
    c = tl.minimum(tl.maximum(u >> 23, 127), 129)                   # biased exponent: 127 below 2, 128, 129 from 4
    magic = (c << 23) + (0x4A800000 - (127 << 23))                  # 2^22, 2^23, 2^24
    r = (u.to(tl.float32, bitcast=True) + magic.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    code = r - magic + (2 * c - 254)
    if SAT:
        code = tl.minimum(code, 7)
    return code


@triton.jit
def e2m1_decode_scaled(code, sbyte):
    """int32 E2M1 code 0..15, int32 E8M0 byte 0..254 (broadcastable) -> int32 fp32 bits of
    code_value * 2^(sbyte-127): exact (float32 subnormals included), +-Inf on overflow (byte 254 with
    |value| >= 2). Integer only: no float multiply, so neither a denormal multiplier (2^-127 for
    byte 0) nor flush-to-zero can change the result.

    Magnitude m = code & 7 has value {0, .5, 1, 1.5, 2, 3, 4, 6}. For m >= 2, bits(value) =
    (m + 252) << 22 (m = 2 -> 0x3F800000, m = 7 -> 0x40C00000) and scaling by 2^(s-127) adds s - 127 to
    the exponent field, so   bits = (m << 22) + base,  base = (2s - 2) << 22   (one IMAD per element),
    clamped (unsigned) at 0x7F800000 (+Inf: byte 254, m >= 4), valid while the result is normal. Below that the
    values are linear in m:  bits = m * lin,  lin = bits(0.5 * 2^(s-127)):
      s >= 2 : lin = (s - 1) << 23 (normal), used for m in {0, 1};
      s == 1 : lin = 0x400000 (2^-127, subnormal), used for m in {0, 1} (m = 2 is 2^-126, normal);
      s == 0 : lin = 0x200000 (2^-128), used for m in {0..3}: 0.5, 1, 1.5 times 2^-127 are the
               subnormals m << 21 (a subnormal's bit pattern is value / 2^-149); m = 4 is 2^-126.
    The per-block quantities (base, lin, threshold) cost nothing per element; per element it is
    and, imad, min, imad, compare, select and the sign: (code & 8) << 28 (code 8 -> -0.0).
    """
    base = (2 * sbyte - 2) << 22
    lin = tl.where(sbyte >= 2, (sbyte - 1) << 23, 0x200000 << tl.minimum(sbyte, 1))
    thr = tl.where(sbyte == 0, 4, 2)
    m = code & 7
    # (m << 22) + base reaches 513 << 22 = 0x80400000 for byte 254: past int32, not past uint32, so
    # the clamp to +Inf is an unsigned min.
    big = tl.minimum(((m << 22) + base).to(tl.uint32, bitcast=True), 0x7F800000).to(tl.int32, bitcast=True)
    bits = tl.where(m >= thr, big, m * lin)
    return bits | ((code & 8) << 28)


@triton.jit
def mxfp4_bytes_to_f32_bits(b, sbyte):
    """b: int32 MXFP4 bytes (element 2i's code in the low nibble, 2i+1's in the high), sbyte: int32 E8M0
    byte of their block (broadcastable) -> (lo, hi) int32 fp32 bits of elements 2i and 2i+1: exact
    (e2m1_decode_scaled; one mantissa bit, so the low halves are zero and the values are bf16 too),
    a value past bf16's range saturated to +-bf16's largest finite (0x7F7F0000, sign kept), the
    canonical NaN 0x7FC00000 for NaN blocks (byte 255): the bits of mxfp4.dequantize_mxfp4_ref in
    bf16, as float32."""
    nan = sbyte == 255
    s = tl.where(nan, 2, sbyte)
    lo = tl.where(nan, 0x7FC00000, e2m1_decode_scaled(b & 15, s))
    hi = tl.where(nan, 0x7FC00000, e2m1_decode_scaled((b >> 4) & 15, s))
    # A decoded code is exact in float32 (+-Inf past its range) and has one mantissa bit, so it is a bf16
    # value or +-Inf: only scale bytes 253 and 254 reach Inf (4 * 2^126 = 2^128). Tiles without them, all
    # but the rarest, skip the per-element saturation.
    if tl.max(tl.where(nan, 0, sbyte)) >= 253:
        lo = _inf_to_bf16_max(lo)
        hi = _inf_to_bf16_max(hi)
    return lo, hi


@triton.jit
def _inf_to_bf16_max(bits):
    """int32 fp32 bits of a bf16 value or +-Inf -> the same with +-Inf as +-bf16's largest finite."""
    mag = bits & 0x7FFFFFFF
    return tl.where(mag == 0x7F800000, (bits ^ mag) | 0x7F7F0000, bits)


@triton.jit
def e4m3_to_f32_bits(b):
    """int32 E4M3 byte 0..255 (not NaN) -> int32 fp32 bits of its exact value.

    Normal (exponent field f >= 1, b7 = b & 0x7F >= 8): value = 1.mmm * 2^(f-7) -> fp32 exponent
    f + 120, so bits = (b7 << 20) + (120 << 23). Subnormal/zero (b7 < 8): value = mmm * 2^-9; the same
    formula gives y = 2^-7 * (1 + mmm/8), and 2 * y - 2^-6 = mmm * 2^-9 exactly (one rounding of an
    exact, representable result whether or not it is contracted to an FMA). No int->float convert.
    """
    b7 = b & 0x7F
    normal = (b7 << 20) + (120 << 23)
    subn = (normal.to(tl.float32, bitcast=True) * 2.0 - 0.015625).to(tl.int32, bitcast=True)
    bits = tl.where(b7 >= 8, normal, subn)
    return bits | ((b & 0x80) << 24)


@triton.jit
def mx_encode_pairs(lo_bits, hi_bits, lo_abs, hi_abs, E, nan_blk, mult, SAT: tl.constexpr):
    """lo_bits/hi_bits: int32 [..., 16] fp32 bits of elements 2i / 2i+1 (unscaled), lo_abs/hi_abs
    the same with the sign bit cleared, the last axis running over the 16 pairs of a 32-block;
    E: int32 [...] block exponent; nan_blk: bool [...]; mult: float32 [...], the exact power of two
    to scale by (a normal float32) -> (packed int32 [..., 16] bytes 0..255, scale int32 [...]).
    Any number of leading axes, so the fused FP8 + MXFP4 kernel encodes its [BM, TILES, 4, 16] view
    without a reshape. Magnitudes are encoded from |x| * mult; the two sign bits go straight from
    bit 31 of the inputs to bits 3 and 7 of the byte."""
    m_e = tl.expand_dims(mult, -1)
    u_lo = (lo_abs.to(tl.float32, bitcast=True) * m_e).to(tl.int32, bitcast=True)
    u_hi = (hi_abs.to(tl.float32, bitcast=True) * m_e).to(tl.int32, bitcast=True)
    packed = (e2m1_rne_mag(u_lo, SAT) | (e2m1_rne_mag(u_hi, SAT) << 4)
              | ((lo_bits >> 28) & 8) | ((hi_bits >> 24) & 0x80))
    packed = tl.where(tl.expand_dims(nan_blk, -1), 0, packed)
    scale = tl.where(nan_blk, 255, E + 127)
    return packed, scale


@triton.jit
def philox_words(seed, group, step, rank):
    """group: int64 [...] Philox counters (element offset // SR_GROUP); step, rank: int32 scalars (uint32 bit
    patterns) -> four uint32 [...] words of Philox4x32-10 at (group low, group high, step, rank) under
    the 64-bit seed: numerics.random_bits's words, 16 random bits for each of 8 elements."""
    c0 = (group & 0xFFFFFFFF).to(tl.uint32)
    c1 = (group >> 32).to(tl.uint32)
    z = c0 * 0   # step and rank may arrive as compile-time ints (Triton specializes 1): added to a uint32 zero
    return tl.philox(seed, c0, c1, (z + step).to(tl.uint32), (z + rank).to(tl.uint32))


@triton.jit
def philox_pair_words(seed, step, rank, rows, kb, KB, PAIRS: tl.constexpr):
    """rows int64 [BM], kb [NB]: blocks of 2 PAIRS elements of a row-major [M, K] tensor (K = 2 PAIRS KB)
    -> uint32 [BM, NB, PAIRS]: per pair p of a block, the Philox word whose low / high halves are the
    random bits of its elements 2p / 2p + 1 (numerics.random_bits: one call per 8 elements, pair p
    taking word p % 4 of group (row K + 2 PAIRS kb + 2 p) / 8)."""
    G: tl.constexpr = PAIRS // 4                               # Philox groups (calls) per block
    group = rows[:, None, None] * (KB * G) + (kb * G)[None, :, None] + tl.arange(0, G)[None, None, :]
    r0, r1, r2, r3 = philox_words(seed, group, step, rank)
    j = tl.arange(0, 4)[None, None, None, :]
    words = tl.where(j == 0, r0[:, :, :, None], tl.where(j == 1, r1[:, :, :, None],
                     tl.where(j == 2, r2[:, :, :, None], r3[:, :, :, None])))
    return tl.reshape(words, [rows.shape[0], kb.shape[0], PAIRS])


def u32_as_i32(v: int) -> int:
    """A uint32 value as the int32 with its bits (a kernel argument Triton types as i32; philox_words
    reads it back as uint32)."""
    return v - (1 << 32) if v >= 1 << 31 else v


@triton.jit
def e2m1_sr_mag(a, r):
    """a: float32 [...] magnitudes in [0, 6] (scaled, finite); r: uint32 [...] 16 random bits -> int32 E2M1
    magnitude code 0..7, rounded stochastically: numerics.encode_e2m1_stochastic's rule, exact in
    float32. With c = 0 below 2, 1 in [2, 4), 2 from 4 (the spacing d = 2^(c-1)), t = a / d, the lower
    neighbour is floor(t) + 2c and frac = t - floor(t) (both exact), and the code moves up when
    r * 2^-16 < frac. At a = 6: t = 3, frac = 0, code 7."""
    c = tl.minimum(tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 127), 129) - 127
    t = a * pow2_f32(1 - c)
    f = tl.floor(t)
    up = (r.to(tl.float32) * (1.0 / 65536.0)) < (t - f)
    return f.to(tl.int32) + 2 * c + up.to(tl.int32)


@triton.jit
def mx_encode_pairs_stochastic(lo_bits, hi_bits, lo_abs, hi_abs, E, nan_blk, mult, words):
    """mx_encode_pairs with stochastic rounding: words uint32 [..., 16], pair i's two elements taking its
    low (element 2i) and high (element 2i+1) 16 bits -> (packed int32 [..., 16], scale int32 [...]).
    |x| * mult <= 6 (RCEIL scales), so nothing saturates."""
    m_e = tl.expand_dims(mult, -1)
    a_lo = lo_abs.to(tl.float32, bitcast=True) * m_e
    a_hi = hi_abs.to(tl.float32, bitcast=True) * m_e
    packed = (e2m1_sr_mag(a_lo, words & 0xFFFF) | (e2m1_sr_mag(a_hi, words >> 16) << 4)
              | ((lo_bits >> 28) & 8) | ((hi_bits >> 24) & 0x80))
    packed = tl.where(tl.expand_dims(nan_blk, -1), 0, packed)
    scale = tl.where(nan_blk, 255, E + 127)
    return packed, scale


@triton.jit
def f32_to_out_bits(v, nan, OUT_DTYPE: tl.constexpr, SATURATE: tl.constexpr = True, EXACT: tl.constexpr = False):
    """float32 v [...], nan bool (broadcastable) -> int32 [...] holding v's bits in OUT_DTYPE
    (tl.bfloat16 / tl.float16 in the low 16 bits, tl.float32 all 32): rounded to nearest even (bf16
    on the bits: the interpreter's cast truncates), the canonical NaN (numerics.NAN_BITS) where nan.
    SATURATE (every decode): a result past the dtype's largest finite magnitude, an Inf from rounding
    a finite v or from a float32 product that overflowed, becomes that magnitude with its sign
    (numerics.to_output); False (sums): IEEE overflow to Inf. A NaN v is expected only where nan.
    EXACT: the caller has proven v a bf16 value or +-Inf (decoded E2M1 codes: one mantissa bit), so the
    bf16 rounding is a truncation (the same bits, fewer instructions)."""
    if OUT_DTYPE == tl.bfloat16:
        if EXACT:
            out = (v.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
        else:
            out = (bf16_rne_bits(v) >> 16) & 0xFFFF
        TOP: tl.constexpr = _MAX_BF16
        MAG: tl.constexpr = 0x7FFF
        NAN: tl.constexpr = _NAN_BF16
    elif OUT_DTYPE == tl.float16:
        out = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        TOP: tl.constexpr = _MAX_F16
        MAG: tl.constexpr = 0x7FFF
        NAN: tl.constexpr = _NAN_F16
    else:
        tl.static_assert(OUT_DTYPE == tl.float32)
        out = v.to(tl.int32, bitcast=True)
        TOP: tl.constexpr = _MAX_F32
        MAG: tl.constexpr = 0x7FFFFFFF
        NAN: tl.constexpr = _NAN_F32
    if SATURATE:
        # Each dtype's Inf is its largest finite bits + 1: a magnitude above TOP is Inf (or NaN,
        # replaced below) and becomes TOP, the sign kept.
        mag = out & MAG
        out = tl.where(mag > TOP, (out ^ mag) | TOP, out)
    return tl.where(nan, NAN, out)


@triton.jit
def in_bits_to_f32_bits(raw, IN_DTYPE: tl.constexpr):
    """raw: integer bits of IN_DTYPE values (tl.bfloat16 / tl.float16: int16, or int32 with the value
    in the low 16 bits; tl.float32: int32) -> int32 fp32 bits of the same values, exactly. bf16 from
    its bits: the interpreter's bf16 -> fp32 cast mangles subnormals, and on the GPU the shift is what
    the cast compiles to."""
    if IN_DTYPE == tl.bfloat16:
        bits = raw.to(tl.int32) << 16
    elif IN_DTYPE == tl.float16:
        bits = raw.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
    else:
        tl.static_assert(IN_DTYPE == tl.float32)
        bits = raw.to(tl.int32)
    return bits


@triton.jit
def store_pair_words(ptr, offs, lo, hi, mask, OUT_DTYPE: tl.constexpr):
    """Store elements 2i and 2i+1, given as int32 bit patterns of the output dtype (lo, hi:
    f32_to_out_bits), as one pair word each: int64 [hi fp32 | lo fp32] for tl.float32, int32 [hi | lo]
    for tl.bfloat16 / tl.float16."""
    if OUT_DTYPE == tl.float32:
        word = (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
    else:
        word = (hi << 16) | lo
    tl.store(ptr + offs, word, mask=mask)


@triton.jit
def bf16_pair_bits(w):
    """int32 BF16 pair word [hi bf16 | lo bf16] -> (lo, hi) int32 fp32 bit patterns of elements 2i
    and 2i+1 (BF16 bits are the fp32 top half)."""
    return w << 16, w & -65536                                 # -65536 = 0xFFFF0000


@triton.jit
def bf16_pair_word(lo, hi):
    """(lo, hi) int32 fp32 bit patterns whose top halves are BF16 values (elements 2i, 2i+1) -> the
    int32 BF16 pair word [hi bf16 | lo bf16]: bf16_pair_bits inverted (the low halves are dropped)."""
    return ((lo >> 16) & 0xFFFF) | (hi & -65536)


@triton.jit
def load_pairs_as_f32_bits(ptr, offs, mask, IN_DTYPE: tl.constexpr):
    """Load pair words of IN_DTYPE (tl.bfloat16 / tl.float16 / tl.float32: pair_view's words) and
    return (lo, hi) int32 fp32 bit patterns of elements 2i and 2i+1."""
    if IN_DTYPE == tl.bfloat16:
        lo, hi = bf16_pair_bits(tl.load(ptr + offs, mask=mask, other=0))
    elif IN_DTYPE == tl.float16:
        w = tl.load(ptr + offs, mask=mask, other=0)            # int32: [hi fp16 | lo fp16]
        lo = in_bits_to_f32_bits(w, tl.float16)
        hi = in_bits_to_f32_bits(w >> 16, tl.float16)
    else:
        tl.static_assert(IN_DTYPE == tl.float32)
        w = tl.load(ptr + offs, mask=mask, other=0)            # int64: [hi fp32 | lo fp32]
        lo = w.to(tl.int32)                                    # truncation keeps the low word
        hi = (w >> 32).to(tl.int32)
    return lo, hi


def words_view(x: torch.Tensor, wtype: torch.dtype) -> torch.Tensor:
    """Contiguous x viewed as wider words (x.clone() first if its storage offset is not aligned)."""
    try:
        return x.view(wtype)
    except RuntimeError:
        return x.clone().view(wtype)


def pair_view(x: torch.Tensor):
    """x: bf16/fp16/fp32 [M, K] contiguous, K even -> (pair words int32 [M, K/2] for 16-bit dtypes,
    int64 for float32; the kernel's IN_DTYPE / OUT_DTYPE, tl_dtype(x.dtype))."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"unsupported dtype {x.dtype}")
    return words_view(x, torch.int64 if x.dtype == torch.float32 else torch.int32), tl_dtype(x.dtype)


@triton.jit
def fp8_scale_exp(amax_bits):
    """FP8 tile exponent: clamp(ceil(log2(amax/448)), -126, 127) from the fp32 bits of amax (finite).

    448 = 1.75 * 2^8 -> mantissa limit 0x600000, log2_hi 8. Zero and subnormal amax give -135 or
    -134 before the clamp, so they land on -126 like the reference's -1000.
    """
    return tl.minimum(tl.maximum(ceil_log2_ratio_bits(amax_bits, 0x600000, 8), -126), 127)


@triton.jit
def fp8_weight_block(v, ASM: tl.constexpr):
    """v: float32 [BLOCK, BLOCK], one 128x128 weight block -> (uint8 E4M3 codes [BLOCK, BLOCK], int32 S):
    S = clamp(ceil(log2(amax / 448)), -126, 127) over the block's finite values, codes = E4M3 RNE of
    v / 2^S. ASM: the rounding by PTX cvt (e4m3_rne_asm, same bytes), on CUDA sm_89+ only."""
    bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    S = fp8_scale_exp(tl.max(tl.max(tl.where(bits < 0x7F800000, bits, 0), axis=1), axis=0))
    scaled = v * pow2_f32(-tl.minimum(S, 126))
    if ASM:
        q = e4m3_rne_asm(scaled).to(tl.uint8)
    else:
        q = e4m3_rne(scaled).to(tl.uint8)
    return q, S


@triton.jit
def e4m3_rne(v):
    """float32 v (|v| <= 448, or non-finite) -> int32 E4M3 byte: round-to-nearest-even into
    subnormals and to signed zero, saturating at 448; NaN and +-Inf give the canonical NaN 0x7F.

    Integer arithmetic on the bits (e4m3_rne_mag): the interpreter's float8 cast does not round to
    nearest even, and Triton 3.6's sm_90 fp32 -> float8e4nv cast returns 0xFC for some elements in
    these kernels (H200), so neither is used. The PTX instruction itself, as
    f32x2_to_e4m3x2_asm, equals this on finite inputs and NaN (a GPU test), and fp8_encode_tiles uses it.
    """
    bits = v.to(tl.int32, bitcast=True)
    u = bits & 0x7FFFFFFF
    code = e4m3_rne_mag(u, True) | ((bits >> 24) & 0x80)
    return tl.where(u >= 0x7F800000, 0x7F, code)


@triton.jit
def e4m3_rne_mag(u, SAT: tl.constexpr):
    """u: int32 bits of a finite |v| -> int32 E4M3 magnitude byte 0..126 (see e4m3_rne). SAT=False
    is for callers that have proven |v| <= 448 (RCEIL scaling does): it saves the min.

      normal |v| >= 2^-6: RNE the 23-bit mantissa to 3 bits on the bits (add 0x7FFFF plus the kept
        lsb, shift by 20); the fp32 exponent 127+e becomes E4M3's 7+e, so the code is r - (120 << 3).
        E.g. 1.0625 = 0x3F880000 (a tie, kept lsb 0) -> (0x3F880000 + 0x7FFFF) >> 20 = 1016 -> 56 (1.0);
        448 = 0x43E00000 -> 1086 - 960 = 126 = 0x7E, and the min() saturates anything above it.
      subnormal |v| < 2^-6 (steps of 2^-9): |v| * 512 is exact, and adding 2^23 makes the float adder
        round it to an integer with RNE; the integer is the low mantissa bits (0x4B000000 = bits(2^23)).
        E.g. 3 * 2^-10 -> 1.5 -> 2 (tie to even); 2^-10 -> 0.5 -> 0. The multiply is exact, so FMA
        contraction cannot change the rounding.
    The magic-number form of e2m1_rne_mag (one add with 2^(e+20), e the clamped exponent) compiles to
    the same number of SASS instructions here (two clamps replace the select) and one more per element
    in the BF16 -> FP8 kernel, so this form stays.
    """
    c_norm = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - 960
    if SAT:
        c_norm = tl.minimum(c_norm, 126)
    c_sub = ((u.to(tl.float32, bitcast=True) * 512.0) + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return tl.where(u < 0x3C800000, c_sub, c_norm)


@triton.jit
def e2m1_to_e4m3_normal(code, e_rel):
    """int32 E2M1 code 0..15 and e_rel = E - S (its block exponent minus the FP8 tile exponent)
    -> int32 E4M3 byte of c * 2^e_rel, valid when that value is zero or an E4M3 normal, i.e.
    floor(log2|c|) + e_rel in [-6, 8] (callers check e_rel >= -5 for the whole program; e_rel <= 6
    holds by the choice of S).

    A nonzero E2M1 magnitude m is 1.f * 2^e with (e, f) = (-1, 0), (0, 0), (0, .5), (1, 0), (1, .5),
    (2, 0), (2, .5) for m = 1..7, so its E4M3 byte at shift e_rel is ((e + e_rel + 7) << 3) | (f * 8):
    48 + 4m + 8 e_rel for m >= 2 (m = 2: 1.0 -> 56 = 0x38), and 48 + 8 e_rel for m = 1 (0.5 -> 0x30).
    One add and a shift per element instead of a decode and a rounding: no rounding can occur.
    """
    m = code & 7
    byte = (m << 2) + 48 + (e_rel << 3) - ((m == 1).to(tl.int32) << 2)
    return tl.where(m == 0, 0, byte) | ((code & 8) << 4)


MAX_GRID_YZ = 65535


def row_column_grid(n_row_blocks: int, n_col_blocks: int, rows_fastest: bool = False) -> tuple[int, int, int]:
    """The launch grid of row_column_program: column blocks on axis 0 (fastest), row blocks on
    axes 1 and 2 (CUDA caps those at 65535 each); with rows_fastest, row blocks on axis 0 and
    column blocks on axis 1."""
    if rows_fastest:
        return (n_row_blocks, n_col_blocks, 1)
    ny = max(1, min(n_row_blocks, MAX_GRID_YZ))
    return (n_col_blocks, ny, triton.cdiv(n_row_blocks, ny))


@triton.jit
def row_column_program(ROWS_FASTEST: tl.constexpr = False):
    """(row block, column block) of this program in a row_column_grid of the same ROWS_FASTEST.

    Column blocks fastest (the default) puts consecutive programs on consecutive memory of the same
    rows, which with the row_chunks layout is faster than row blocks fastest for MXFP4 -> BF16, the
    fused BF16 -> {FP8, MXFP4} pass, BF16 -> FP8 and MXFP4 -> FP8 rows (bench/RESULTS.md). FP8 ->
    MXFP4 is slower that way, so it keeps row blocks fastest, as does the fused SwiGLU + quantize.
    No division: a one-axis grid's pid // n, pid % n at the start of every program delays its first
    loads. Row blocks past the last (axis 2 rounds up) fall outside M and are masked."""
    if ROWS_FASTEST:
        return tl.program_id(0), tl.program_id(1)
    else:
        return tl.program_id(1) + tl.program_id(2) * tl.num_programs(1), tl.program_id(0)


@triton.jit
def block_program(M, KB, BLOCK_M: tl.constexpr, NB: tl.constexpr, ROWS_FASTEST: tl.constexpr = False,
                  PAIRS: tl.constexpr = 16):
    """This program's [BLOCK_M rows, NB blocks of 2 PAIRS elements] (MXFP4: 16 pairs; NVFP4: 8) of a
    row-major [M, 2 PAIRS KB] tensor, seen as pair words [BLOCK_M, NB, PAIRS] (grid: row_column_grid)
    -> (rows int64 [BM], block index [NB], mask [BM, NB], mask [BM, NB, 1], pair-word column [1, NB,
    PAIRS]). Row offsets are int64: rows * stride can pass 2^31."""
    rb, cb = row_column_program(ROWS_FASTEST)
    rows = rb.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    kb = cb * NB + tl.arange(0, NB)
    mask2 = (rows < M)[:, None] & (kb < KB)[None, :]
    pair = (kb * PAIRS)[None, :, None] + tl.arange(0, PAIRS)[None, None, :]
    return rows, kb, mask2, mask2[:, :, None], pair


@triton.jit
def row_chunks(rows, M, col0, n_cols, COLS: tl.constexpr, V: tl.constexpr):
    """The [BLOCK_M rows, COLS words] a program reads or writes, starting at word column col0 of rows
    with n_cols words each, as [BM, COLS / V chunks, V] -> (word offsets from the row start int32
    [1, COLS / V, V], mask [BM, COLS / V, 1]).

    Why one chunk axis: Triton orders a blocked layout's thread dimensions by address contiguity and
    then by axis index, so a structured [BM, tiles, blocks, ..., 4] access spreads a warp's 32 threads
    over rows and tiles first, and each store instruction writes 16 bytes of every 64-128 byte
    segment it touches. With a single chunk axis the
    threads after the V-word vector run along the row, so each instruction covers whole segments; a
    kernel reshapes to its structured view for the arithmetic and back for the store."""
    c = tl.arange(0, COLS // V) * V
    offs = (col0 + c)[None, :, None] + tl.arange(0, V)[None, None, :]
    mask = (rows < M)[:, None, None] & (col0 + c < n_cols)[None, :, None]
    return offs, mask


@triton.jit
def tile_program(M, NT, BLOCK_M: tl.constexpr, TILES: tl.constexpr, ROWS_FASTEST: tl.constexpr = False):
    """This program's [BLOCK_M rows, TILES FP8 tiles of 128] of a row-major [M, 128 NT] tensor, seen
    as pair words [BLOCK_M, TILES, 4 blocks, 16] (grid: row_column_grid) -> (rows int64 [BM], tile
    index [TILES], mask [BM, TILES], mask [BM, TILES, 1], mask [BM, TILES, 1, 1], pair-word column
    [1, TILES, 4, 16])."""
    rb, cb = row_column_program(ROWS_FASTEST)
    rows = rb.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    t = cb * TILES + tl.arange(0, TILES)
    mask_t = (rows < M)[:, None] & (t < NT)[None, :]
    pair = ((t * 64)[None, :, None, None] + (tl.arange(0, 4) * 16)[None, None, :, None]
            + tl.arange(0, 16)[None, None, None, :])
    return rows, t, mask_t, mask_t[:, :, None], mask_t[:, :, None, None], pair


@triton.jit
def mxfp4_tile_exponents(sb, valid3):
    """sb: int32 [BM, T, 4] E8M0 scale bytes of the 4 blocks of T FP8 tiles; valid3: bool [BM, T, 4],
    False for masked blocks -> (nan: bool [BM, T, 4] NaN blocks, S: int32 [BM, T] tile exponents
    clamp(largest finite E - 6, -126, 127), e_rel: int32 [BM, T, 4] = E - S (<= 6), normal: scalar,
    True when every valid finite block has e_rel >= -5, i.e. every value converts to an E4M3 normal or
    zero). The scale half of the MXFP4 -> FP8 1x128 rule, shared by its byte and word kernels."""
    nan = sb == 255
    emax = tl.max(tl.where(nan, -1, sb), axis=2)                                   # byte of the largest finite block
    S = tl.minimum(tl.maximum(emax - 127 - 6, -126), 127)                          # [BM, T]
    e_rel = sb - 127 - S[:, :, None]                                               # E - S <= 6
    normal = tl.min(tl.where(nan | ~valid3, 127, e_rel)) >= -5
    return nan, S, e_rel, normal


@triton.jit
def mxfp4_words_to_e4m3(x, sb, valid3, ASM: tl.constexpr):
    """Direct MXFP4 -> FP8 1x128 conversion of whole tiles, four codes per integer operation (the rule
    of ``fp8.mxfp4_to_fp8_rowwise_ref``), for the row-wise converter's word kernel.

    x: int32 [BM, T, 4, 2, 4], each holding four E2M1 codes in its low 16 bits (code i in bits
    4i..4i+3; higher bits ignored): the 32 words of each of T tiles per row, as 4 blocks x 8 words;
    sb: int32 [BM, T, 4] their E8M0 scale bytes; valid3: bool [BM, T, 4], False for masked blocks
    -> (q: int32 [BM, T, 4, 2, 4], byte i the E4M3 byte of code i, S: int32 [BM, T] tile exponents:
    the FP8 scale is 2^S). ASM (CUDA only) decodes with two prmt per word; the pure-Triton twin gives
    the same bits.
    """
    nan, S, e_rel, normal = mxfp4_tile_exponents(sb, valid3)
    return e2m1_words_to_e4m3(x, nan, e_rel, normal, ASM), S


@triton.jit
def e2m1_words_to_e4m3(x, nan, e_rel, normal, ASM: tl.constexpr):
    """The codes half of mxfp4_words_to_e4m3, with the block exponents of mxfp4_tile_exponents given
    (nan, e_rel: [BM, T, 4]) and ``normal`` a scalar that is True only when every block of x has
    e_rel >= -5: a caller may decide it once for more rows than x holds.
    -> int32 [BM, T, 4, 2, 4] E4M3 bytes."""
    if normal:
        # Every block within 11 binades of its tile's largest: all values are E4M3 normals or zero,
        # four codes per integer operation.
        k = (e_rel + 6)[:, :, :, None, None]
        if ASM:
            t_lo, t_hi = e2m1x4_to_e4m3x4_tables(k)
            q = e2m1x4_to_e4m3x4_asm(x, tl.broadcast_to(t_lo, x.shape), tl.broadcast_to(t_hi, x.shape))
        else:
            q = e2m1x4_to_e4m3x4(nibbles_to_byte_lanes(x & 0xFFFF), k)
    else:
        # General path, one code at a time: c * 2^(E - S) as exact fp32 bits (decoded with the
        # shifted byte E - S + 127; below 0 the values are under 6 * 2^-127 and round to zero like
        # byte 0's), then RNE.
        shifted = tl.maximum(e_rel + 127, 0)[:, :, :, None, None]
        q = x & 0   # zeros in x's layout (tl.zeros_like has no layout to give under Gluon)
        for j in tl.static_range(4):
            v = e2m1_decode_scaled((x >> (4 * j)) & 15, shifted).to(tl.float32, bitcast=True)
            q |= (e4m3_rne(v) & 0xFF) << (8 * j)
    return tl.where(nan[:, :, :, None, None], 0x7F7F7F7F, q)


@triton.jit
def bf16_rne_bits(v):
    """float32 v -> int32 fp32 bits of bf16(v) (low half zero): RNE, overflow to +-Inf, NaN -> 0x7FC00000.

    On the bits because the interpreter's float32 -> bf16 cast truncates. Adding 0x7FFF plus the
    kept lsb (bit 16) carries into bit 16 exactly when the dropped half is above the midpoint, or on
    it with an odd kept lsb (ties to even); a carry out of the mantissa bumps the exponent, so the
    largest values round to Inf as RNE requires. A NaN whose payload sits in the dropped half would
    become Inf, hence the select (the canonical NaN of numerics.NAN_BITS).
    """
    b = v.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000
    return tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, r)


@triton.jit
def f32x2_to_e4m3x2_asm(lo, hi):
    """lo, hi: float32 -> int16 word of their E4M3 bytes (lo's in the low byte) as one PTX
    cvt.rn.satfinite.e4m3x2.f32 (sm_89+, CUDA only): RNE into subnormals and to signed zero,
    saturating at +-448. Equal to e4m3_rne on every finite input and on NaN (0x7F); +-Inf gives
    +-448 here, where e4m3_rne gives 0x7F, so callers pass finite values."""
    return tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,f,f", [lo, hi],
                                     dtype=tl.int16, is_pure=True, pack=1)


@triton.jit
def e4m3_rne_asm(v):
    """e4m3_rne with the PTX cvt.rn.satfinite.e4m3x2.f32 (sm_89+, CUDA only), one value per
    instruction (the pair's other input is 0): the same byte on every input, since non-finite values
    (which satfinite would send to +-448 when infinite) take 0x7F by a select."""
    q = tl.inline_asm_elementwise(
        """{
        .reg .f32 z;
        mov.f32 z, 0f00000000;
        cvt.rn.satfinite.e4m3x2.f32 $0, z, $1;
        }""",
        "=h,f", [v], dtype=tl.int16, is_pure=True, pack=1).to(tl.int32) & 0xFF
    return tl.where((v.to(tl.int32, bitcast=True) & 0x7FFFFFFF) >= 0x7F800000, 0x7F, q)


@triton.jit
def fp8_encode_tiles(lo, hi, ASM: tl.constexpr = False):
    """lo/hi: int32 [BM, TILES, 4, 16] fp32 bits of elements 2i / 2i+1 of each 128-column tile
    -> (int16 [BM, TILES, 4, 16] pair words of E4M3 bytes, float32 [BM, TILES] tile scales 2^S).
    The FP8 1x128 rule of fp8.quantize_fp8_rowwise_ref (the row-wise quantizer and the fused SwiGLU use it).
    ASM: tiles of finite values round with f32x2_to_e4m3x2_asm (one instruction per pair) instead of
    the integer e4m3_rne_mag (its twin there)."""
    a_lo = lo & 0x7FFFFFFF
    a_hi = hi & 0x7FFFFFFF
    fin = tl.maximum(tl.where(a_lo < 0x7F800000, a_lo, 0), tl.where(a_hi < 0x7F800000, a_hi, 0))
    S = fp8_scale_exp(tl.max(tl.max(fin, axis=3), axis=2))
    mult = pow2_f32(-tl.minimum(S, 126))[:, :, None, None]
    if tl.max(tl.maximum(a_lo, a_hi)) < 0x7F800000:
        # All finite: |x| * 2^-S <= 448, no saturation; the signs go from bit 31 to bit 7 of each byte.
        if ASM:
            word = f32x2_to_e4m3x2_asm(lo.to(tl.float32, bitcast=True) * mult, hi.to(tl.float32, bitcast=True) * mult)
        else:
            q_lo = e4m3_rne_mag((a_lo.to(tl.float32, bitcast=True) * mult).to(tl.int32, bitcast=True), False)
            q_hi = e4m3_rne_mag((a_hi.to(tl.float32, bitcast=True) * mult).to(tl.int32, bitcast=True), False)
            word = (q_lo | (q_hi << 8) | ((lo >> 24) & 0x80) | ((hi >> 16) & 0x8000)).to(tl.int16)
    else:
        q_lo = e4m3_rne(lo.to(tl.float32, bitcast=True) * mult)
        q_hi = e4m3_rne(hi.to(tl.float32, bitcast=True) * mult)
        word = (q_lo | (q_hi << 8)).to(tl.int16)
    return word, pow2_f32(S)


@triton.jit
def mx_encode_tiles(lo, hi):
    """lo/hi: int32 [BM, TILES, 4, 16] fp32 bits -> (uint8 [BM, TILES, 4, 16] MXFP4 bytes, uint8
    [BM, TILES, 4] E8M0 scales); the MXFP4 rule of mxfp4.quantize_mxfp4_rowwise_ref, on the
    [.., 4 blocks, 16 pairs] view of 128-column tiles."""
    a_lo = lo & 0x7FFFFFFF
    a_hi = hi & 0x7FFFFFFF
    amax_bits = tl.max(tl.maximum(a_lo, a_hi), axis=3)
    nan_blk = amax_bits >= 0x7F800000
    E = mx_scale_exp(amax_bits)
    packed, sc = mx_encode_pairs(lo, hi, a_lo, a_hi, E, nan_blk, pow2_f32(-tl.minimum(E, 126)), False)
    return packed.to(tl.uint8), sc.to(tl.uint8)


@triton.jit
def f32_to_bf16_rne(x):
    """float32 -> bfloat16 with round-to-nearest-even (see bf16_rne_bits)."""
    return (bf16_rne_bits(x) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


# ---------------------------------------------------------------------------------------------
# SWAR decode: several E2M1 codes per 32-bit integer operation. The conversion kernels are bound by
# instruction issue, not memory (bench/RESULTS.md), so the per-element work is done on byte lanes
# (four FP8 outputs per word) or 16-bit lanes (two BF16 outputs per word). Every lane stays inside
# its bounds (stated per function), so no add carries into the next lane.

@triton.jit
def nibbles_to_byte_lanes(x):
    """int32 x holding four E2M1 codes in its low 16 bits (code i in bits 4i..4i+3) -> int32 with
    code i in byte i (values 0..15). Two shift-or-mask steps: 16 -> 2 x 8 bits, then 8 -> 2 x 4."""
    t = (x | (x << 8)) & 0x00FF00FF
    return (t | (t << 4)) & 0x0F0F0F0F


@triton.jit
def e2m1x4_to_e4m3x4(u, k):
    """u: int32, one E2M1 code (0..15) per byte lane; k: int32 = 6 + e_rel with e_rel in [-5, 6]
    (broadcast) -> int32 whose byte i is the E4M3 byte of code_i * 2^e_rel, exactly (every such
    value is zero or an E4M3 normal: the fast path of e2m1_to_e4m3_normal, four codes at a time).

    An E2M1 magnitude m >= 2 is 1.f * 2^(e-1) with e = m >> 1, f = m & 1; its E4M3 byte at shift
    e_rel is ((e - 1 + 7 + e_rel) << 3) | (f << 2) = 8e + 4f + 8k = 4m + 8k (m = 2, 1.0 at e_rel 0:
    8 + 48 = 0x38). m = 1 (0.5 = 2^-1) is 8k and m = 0 is 0, so byte = 4m + 4[m >= 2] + [m != 0] (8k - 4).
    The two predicates come from one add per lane: m + 7 has bit 3 set iff m >= 1, m + 6 iff m >= 2
    (m <= 7: no lane overflows). Lane maximum 4*7 + 4 + 92 = 124: no carry.
    The sign (bit 3 of the code) moves to bit 7 of its byte with one shift and mask.
    """
    m = u & 0x07070707
    nz = ((m + 0x07070707) >> 3) & 0x01010101
    ge = ((m + 0x06060606) >> 1) & 0x04040404
    return (m * 4 + ge + nz * (8 * k - 4)) | ((u << 4) & -0x7F7F7F80)  # 0x80808080 as int32


@triton.jit
def e2m1x4_to_e4m3x4_tables(k):
    """k: int32 = 6 + e_rel, e_rel in [-5, 6] -> (lo, hi): int32 byte tables of the E4M3 magnitude
    of E2M1 magnitudes 0..3 and 4..7 at 2^e_rel, the prmt operands of e2m1x4_to_e4m3x4_asm.

    From e2m1x4_to_e4m3x4: magnitude 0 -> 0, 1 -> 8k, m >= 2 -> 4m + 8k; so the bytes are
    (0, 8k, 8 + 8k, 12 + 8k) and (16, 20, 24, 28) + 8k, at most 124: no byte carries."""
    return 0x0C080000 + k * 0x08080800, 0x1C181410 + k * 0x08080808


@triton.jit
def e2m1x4_to_e4m3x4_asm(x, lo, hi):
    """x: int32 with four E2M1 codes in its low 16 bits (code i in bits 4i..4i+3); lo, hi: the tables
    of e2m1x4_to_e4m3x4_tables(k) (same shape as x) -> int32 whose byte i is the E4M3 byte of code i
    at 2^e_rel: e2m1x4_to_e4m3x4(nibbles_to_byte_lanes(x), k) in PTX (CUDA only).

    One prmt looks up four magnitudes: the selector nibbles are the codes with their sign bits cleared
    (a set bit 3 would ask prmt to replicate a byte's sign instead). The signs: a second prmt copies
    x's bytes to (x0, x0, x1, x1), which puts the signs of codes 1 and 3 at bits 15 and 31 already;
    those of codes 0 and 2 are at bits 3 and 19, four places short."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 sel, mag, dup, sgn;
        and.b32 sel, $1, 0x7777;
        prmt.b32 mag, $2, $3, sel;
        prmt.b32 dup, $1, $1, 0x1100;
        shl.b32 sgn, dup, 4;
        and.b32 sgn, sgn, 0x00800080;
        and.b32 dup, dup, 0x80008000;
        or.b32 mag, mag, sgn;
        or.b32 $0, mag, dup;
        }""",
        "=r,r,r,r", [x, lo, hi], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def e2m1x2_to_bf16x2(u, s):
    """u: int32, one E2M1 code (0..15) in bits 0..3 and one in bits 16..19; s: int32 E8M0 byte in
    [2, 252] (broadcast) -> int32 of two BF16 bit patterns, code * 2^(s - 127) exactly.

    The same structure as e2m1x4_to_e4m3x4 in 16-bit lanes: BF16 of m >= 2 at scale byte s is
    (m << 6) + ((s - 1) << 7) + 64 (m = 2: s << 7, i.e. 1.0 * 2^(s-127)); m = 1 is (s - 1) << 7 (0.5,
    a normal because s >= 2); m = 0 is 0. So bits = 64m + 64[m >= 2] + [m != 0] (128(s - 1) - 64).
    Lane maximum (s = 252, m = 7): 448 + 64 + 32192 - 64 = 32640 < 2^15, so the sign fits in bit 15
    and no lane carries; s <= 252 also keeps 6 * 2^(s-127) finite (byte 253 would overflow to Inf).
    """
    m = u & 0x00070007
    nz = ((m + 0x00070007) >> 3) & 0x00010001
    ge = ((m + 0x00060006) << 3) & 0x00400040
    return (m * 64 + ge + nz * (128 * s - 192)) | ((u << 12) & -0x7FFF8000)  # 0x80008000 as int32


@triton.jit
def max15x2(a, b):
    """a, b: int32, two 15-bit values (0..0x7FFF) in 16-bit lanes -> int32, their lane-wise maximum:
    the pure-Triton twin of max_u16x2_asm (the same result on these inputs).

    (a | 0x8000) - b is 0x8000 + a - b in [1, 0xFFFF] per lane (no borrow), so bit 15 = [a >= b];
    that bit minus itself shifted to bit 0 is 0x7FFF, a select mask wide enough for 15-bit lanes.
    (The shift is arithmetic on int32: the mask after it drops the sign copies.)"""
    d = ((a | -0x7FFF8000) - b) & -0x7FFF8000  # 0x80008000 as int32
    keep = d - ((d >> 15) & 0x00010001)
    return b ^ ((a ^ b) & keep)


@triton.jit
def max_u16x2_asm(a, b):
    """max15x2 as one PTX max.u16x2 (sm_90: one instruction for two lanes). CUDA only."""
    return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                     is_pure=True, pack=1)


# SWAR encode (BF16 -> MXFP4): two BF16 values per 32-bit operation. The block maximum, the scaling
# and the E2M1 rounding run on 16-bit lanes of the pair word as loaded, so no per-element float32
# unpacking, multiply or integer rounding is left (BF16 -> MXFP4 executes 10.2 SASS instructions per
# element against 15.9 with mx_encode_pairs; bench/RESULTS.md).

@triton.jit
def fma_bf16x2(a, b, c):
    """a, b, c: int32 pairs of BF16 bit patterns (16-bit lanes) -> int32 pair of bf16(a * b + c)
    (RNE), lane-wise: the pure-Triton twin of fma_bf16x2_asm on the inputs e2m1x2_rne_bf16x2 gives it
    (a >= 0 finite, b a power of two with a * b <= 6 where it matters, c in {64, 128, 256}).

    Computed in float32 and rounded once to BF16 (bf16_rne_bits). That is the single rounding of the
    exact a * b + c whenever the float32 result is exact, which holds here when a * b >= 2^-3:
    a * b has at most 8 significant bits, down to 2^-10, and c + a * b < 512 needs 19 bits. Below
    2^-3 the float32 sum may round (or the product flush), but it stays under c + 2^-3 + ulp, short of
    the BF16 midpoint c + ulp_bf16(c) / 2 >= c + 2^-2, so both round to c."""
    lo = (a << 16).to(tl.float32, bitcast=True) * (b << 16).to(tl.float32, bitcast=True) \
        + (c << 16).to(tl.float32, bitcast=True)
    hi = (a & -65536).to(tl.float32, bitcast=True) * (b & -65536).to(tl.float32, bitcast=True) \
        + (c & -65536).to(tl.float32, bitcast=True)
    return bf16_pair_word(bf16_rne_bits(lo), bf16_rne_bits(hi))


@triton.jit
def fma_bf16x2_asm(a, b, c):
    """fma_bf16x2 as one PTX fma.rn.bf16x2 (sm_90: one rounding of the exact a * b + c per lane,
    subnormals kept). CUDA only."""
    return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def e2m1x2_rne_bf16x2(w, E, ASM: tl.constexpr):
    """w: int32 pair word of two BF16 (element 2i in bits 0..15, 2i+1 in 16..31); E: int32 block
    exponent in [-127, 126] (broadcast) with |x| * 2^-E <= 6 for both lanes (RCEIL makes it so for
    finite blocks) -> int32 whose low byte is the MXFP4 byte of the pair: the E2M1 codes of
    RNE(x * 2^-E), element 2i in bits 0..3 (sign in bit 3), 2i+1 in bits 4..7. The bits above 7 are
    not cleared (callers store the low byte). Other inputs (NaN or Inf blocks) give some byte, which
    callers overwrite; lanes only ever meet inside their own word, so nothing leaks to a neighbour.

    The rounding is the magic-number add of e2m1_rne_mag, in BF16: with c' = clamp(floor(log2 v),
    0, 2) for v = |x| * 2^-E, the E2M1 step is 2^(c'-1), which is the BF16 ulp of M = 2^(6 + c'), so
    bf16(v + M) = bits(M) + n with n = RNE(v / step) (M's low 7 bits are 0: the tie goes to even n),
    and the code is n + 2c'. One fma.rn.bf16x2 forms v + M from |x|, 2^-E and M exactly (one rounding:
    neither the scaling nor a subnormal v loses anything). M comes from the exponent field of
    max(|x|, 2^E) (1.0 after scaling: below it c' = 0; v <= 6 keeps it under 2^(E+3)): bits(M) =
    (that field + 6 - E) << 7. Then bits(M) >> 7 = 133 + c', so n + 2c' = r - M + (M >> 6) - 266 per
    lane (M >> 6 moves nothing across lanes: the high lane's low 7 bits are 0). Every lane result is
    in [0, 0xFFFF], so the packed per-block constants, negative lanes included, add without borrows."""
    a = w & 0x7FFF7FFF
    inv = ((127 - E) << 7) * 0x10001                 # BF16 2^-E per lane: a normal (E <= 126)
    one = ((127 + E) << 7) * 0x10001                 # BF16 2^E per lane; 0 at E = -127, where a zero
                                                     # exponent field (|x| < 2^-126, v < 2) gives c' = 0 too
    if ASM:
        cs = max_u16x2_asm(a, one)
    else:
        cs = max15x2(a, one)
    m = (cs & 0x7F807F80) + ((6 - E) << 7) * 0x10001
    if ASM:
        r = fma_bf16x2_asm(a, inv, m)
    else:
        r = fma_bf16x2(a, inv, m)
    t = r - m + (m >> 6) + ((w >> 12) & 0x00080008) - 266 * 0x10001
    return t | (t >> 12)


@triton.jit
def mx_encode_bf16_pairs(w, AXIS: tl.constexpr, ASM: tl.constexpr):
    """w: int32 [..., 16, ...] BF16 pair words, axis AXIS running over the 16 pairs of a 32-block
    -> (packed int32 [..., 16, ...] with the MXFP4 byte of each pair in its low 8 bits, scale int32
    [...] E8M0 bytes): mx_encode_pairs's bytes for BF16 input, two elements per operation. ASM (CUDA
    only) takes max.u16x2 and fma.rn.bf16x2; the pure-Triton twins give the same bits.

    The block maximum is a lane-wise maximum of the |x| lanes (BF16 magnitude bits are monotone in
    |x|, NaN and Inf are the largest), then of the two lanes; as float32 bits it is that << 16."""
    a = w & 0x7FFF7FFF
    if ASM:
        lanes = tl.reduce(a, AXIS, max_u16x2_asm)
        amax = tl.maximum(lanes & 0xFFFF, lanes >> 16)
    else:
        # Each lane on its own with tl.max: the same maximum as a max15x2 reduction, and the Triton
        # interpreter runs a reduction with a user combine function one element at a time (24 s
        # against 0.7 s for a 256 x 1024 tensor on the CI machine).
        amax = tl.maximum(tl.max(a & 0xFFFF, AXIS), tl.max(a >> 16, AXIS))
    nan_blk = amax >= 0x7F80
    E = mx_scale_exp(amax << 16)
    byte = e2m1x2_rne_bf16x2(w, tl.expand_dims(tl.minimum(E, 126), AXIS), ASM)
    packed = tl.where(tl.expand_dims(nan_blk, AXIS), 0, byte)
    return packed, tl.where(nan_blk, 255, E + 127)


@triton.jit
def bytes_0246(a, b):
    """a, b: int32 -> int32 of bytes (a0, a2, b0, b2), byte 0 lowest: the pure-Triton twin of
    bytes_0246_asm."""
    return (a & 0xFF) | ((a >> 8) & 0xFF00) | ((b & 0xFF) << 16) | ((b << 8) & -0x1000000)  # 0xFF000000


@triton.jit
def bytes_0246_asm(a, b):
    """bytes_0246 as one PTX prmt (selector 0x6420: bytes 0 and 2 of a, then of b). CUDA only."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x6420;", "=r,r,r", [a, b], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def e4m3x4_to_e2m1x4(w, sh):
    """w: int32, four E4M3 bytes (byte lanes); sh: int32 in [-4, 7] (broadcast) such that every
    |byte value| * 2^-sh <= 6 -> int32 whose byte i is the E2M1 code (sign in bit 3) of
    RNE(byte_i * 2^-sh), exactly as e2m1_rne_mag on the float value.

    The 3-bit magnitude code is the number of E2M1 rounding thresholds (0.25, 0.75, 1.25, 1.75, 2.5,
    3.5, 5) that |value| reaches, a tie counting where RNE sends it (0.75, 1.75, 3.5 up; the others
    down). Scaled by 2^sh every threshold is an E4M3 normal for sh in [-4, 6] (0.25 * 2^-4 = 2^-6 is
    the smallest), so on the magnitude byte m = b & 0x7F the test is m >= T_i(0) + 8 sh with
    T(0) = 0x29 0x34 0x3B 0x3E 0x43 0x46 0x4B (the tie code, plus one where the tie rounds down).
    E4M3 subnormal m (< 8) is below every threshold: |value| * 2^-sh <= 7 * 2^-9 * 2^4 < 0.25.
    Thresholds 0-5: lane (m | 0x80) - 8 sh - T(0) lies in [2, 0xA3] (m - 8 sh is in [-56, 76]:
    |value| <= 6 * 2^sh), so bit 7 is the test and no lane borrows. Threshold 6 is tested on
    (m | 0x80) - min(0x4B + 8 sh, 0x80) (in [0, 0xFF]; at sh = 7, 5 * 2^7 exceeds E4M3: never).
    The count of flags that rise in order (a thermometer code) is binary from XORs: bit 0 the
    parity of all seven, bit 1 = f1 ^ f3 ^ f5, bit 2 = f3. The sign moves from bit 7 to bit 3.
    """
    x = w | -0x7F7F7F80                                      # m | 0x80 per lane (0x80808080 as int32)
    xs = x - sh * 0x08080808
    z3 = xs - 0x3E3E3E3E
    p1 = (xs - 0x34343434) ^ z3 ^ (xs - 0x46464646)
    z6 = x - tl.minimum(0x4B + 8 * sh, 0x80) * 0x01010101
    p0 = p1 ^ (xs - 0x29292929) ^ (xs - 0x3B3B3B3B) ^ (xs - 0x43434343) ^ z6
    return (((p0 >> 7) & 0x01010101) | ((p1 >> 6) & 0x02020202) | ((z3 >> 5) & 0x04040404)
            | ((w >> 4) & 0x08080808))


# Row -> column SWAR (mxfp4_to_fp8_colwise): four tokens' words become eight columns' words.

@triton.jit
def bytes_transpose4x4(x0, x1, x2, x3):
    """x0..x3: int32 -> (b0, b1, b2, b3), byte i of b_j = byte j of x_i (a 4 x 4 byte transpose):
    the pure-Triton twin of bytes_transpose4x4_asm. (Shifts are arithmetic: each field is masked or
    shifted to the top.)"""
    b0 = (x0 & 0xFF) | ((x1 & 0xFF) << 8) | ((x2 & 0xFF) << 16) | (x3 << 24)
    b1 = ((x0 >> 8) & 0xFF) | (x1 & 0xFF00) | ((x2 & 0xFF00) << 8) | ((x3 >> 8) << 24)
    b2 = ((x0 >> 16) & 0xFF) | ((x1 >> 8) & 0xFF00) | (x2 & 0xFF0000) | ((x3 >> 16) << 24)
    b3 = ((x0 >> 24) & 0xFF) | ((x1 >> 16) & 0xFF00) | ((x2 >> 8) & 0xFF0000) | (x3 & -0x1000000)
    return b0, b1, b2, b3


@triton.jit
def bytes_transpose4x4_asm(x0, x1, x2, x3):
    """bytes_transpose4x4 as eight PTX prmt (CUDA only): pairs (x0, x1) and (x2, x3) interleave their
    bytes 0-1 and 2-3 (selectors 0x5140, 0x7362), then the half-words of those pairs interleave
    (0x5410, 0x7632)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t0, t1, t2, t3;
        prmt.b32 t0, $4, $5, 0x5140;
        prmt.b32 t1, $4, $5, 0x7362;
        prmt.b32 t2, $6, $7, 0x5140;
        prmt.b32 t3, $6, $7, 0x7362;
        prmt.b32 $0, t0, t2, 0x5410;
        prmt.b32 $1, t0, t2, 0x7632;
        prmt.b32 $2, t1, t3, 0x5410;
        prmt.b32 $3, t1, t3, 0x7632;
        }""",
        "=r,=r,=r,=r,r,r,r,r", [x0, x1, x2, x3], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True, pack=1)


@triton.jit
def e2m1_pairs_to_base_flagged(b):
    """b: int32, four bytes of two E2M1 codes each (lo nibble, hi nibble) -> (lo, hi): int32 whose
    byte i is B(m) of the magnitude m = code & 7 of byte i's lo / hi code, the pure-Triton twin of
    e2m1_pairs_to_base_flagged_asm.

    B(m) = 4m + 4[m >= 2] - 3[m >= 1] = 0, 1, 9, 13, 17, 21, 25, 29: with v the E2M1 value of m (0,
    0.5, 1, 1.5, 2, 3, 4, 6), the E4M3 byte of v * 2^(k - 6) minus 8k (e2m1x4_to_e4m3x4: 4m +
    4[m >= 2] + [m != 0](8k - 4)), plus a nonzero flag in bit 0. So B(m) + [m != 0](8k - 1) is that
    E4M3 byte (while it is a normal), and B(m) >> 3 = floor(log2 v) + 1 for m != 0.
    """
    m_lo = b & 0x07070707
    m_hi = (b >> 4) & 0x07070707
    lo = m_lo * 4 + ((m_lo + 0x06060606) >> 1 & 0x04040404) - 3 * ((m_lo + 0x07070707) >> 3 & 0x01010101)
    hi = m_hi * 4 + ((m_hi + 0x06060606) >> 1 & 0x04040404) - 3 * ((m_hi + 0x07070707) >> 3 & 0x01010101)
    return lo, hi


@triton.jit
def e2m1_pairs_to_base_flagged_asm(b):
    """e2m1_pairs_to_base_flagged in PTX (CUDA only): the eight B(m) bytes are two prmt tables
    (0x0D090100, 0x1D191511); a prmt selector nibble with bit 3 set would replicate a sign, so the
    codes' sign bits are cleared first. Lookups of byte pairs (lo0, hi0, lo1, hi1) and (lo2, hi2,
    lo3, hi3) are split into the lo and hi words by two more prmt (0x6420, 0x7531)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 sel, tlo, thi, r0, r1;
        mov.b32 tlo, 0x0D090100;
        mov.b32 thi, 0x1D191511;
        and.b32 sel, $2, 0x77777777;
        prmt.b32 r0, tlo, thi, sel;
        shr.b32 sel, sel, 16;
        prmt.b32 r1, tlo, thi, sel;
        prmt.b32 $0, r0, r1, 0x6420;
        prmt.b32 $1, r0, r1, 0x7531;
        }""",
        "=r,=r,r", [b], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


# FP8 rows -> FP8 columns (fp8_to_fp8_colwise): two values per float16x2 operation. Every E4M3 value
# is a float16 normal or zero (2^-9 >= 2^-14), so the decode is exact; products by powers of two stay
# exact while they stay on float16's grid (the kernel argues when). Words are int32: float16 bits in
# the low half (the lower-addressed value) and the high half.

@triton.jit
def f16_lo_to_f32(h):
    """int32 float16 bits in the low 16 bits (the high bits ignored) -> float32, exact."""
    return (h & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def f32_to_f16_lo(v):
    """float32 -> int32 float16 bits (0..0xFFFF) of RNE(v)."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _e4m3_to_f16_half(b):
    """int32 E4M3 byte 0..255 -> int32 float16 bits of its value; NaN bytes give NaN 0x7E00 | sign."""
    b7 = b & 0x7F
    h = f32_to_f16_lo(e4m3_to_f32_bits(b7).to(tl.float32, bitcast=True))
    return tl.where(b7 == 0x7F, 0x7E00, h) | ((b & 0x80) << 8)


@triton.jit
def e4m3x4_to_f16x2(x):
    """x: int32, four E4M3 bytes -> (lo, hi): int32 float16x2 words of bytes (0, 1) and (2, 3), the
    lower byte in the low half; values exact, NaN bytes a float16 NaN. The pure-Triton twin of
    e4m3x4_to_f16x2_asm (equal bits except on NaN, where both give a NaN)."""
    lo = _e4m3_to_f16_half(x & 0xFF) | (_e4m3_to_f16_half((x >> 8) & 0xFF) << 16)
    hi = _e4m3_to_f16_half((x >> 16) & 0xFF) | (_e4m3_to_f16_half((x >> 24) & 0xFF) << 16)
    return lo, hi


@triton.jit
def e4m3x4_to_f16x2_asm(x):
    """e4m3x4_to_f16x2 as two PTX cvt.rn.f16x2.e4m3x2 (sm_89+, CUDA only)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 l, h;
        mov.b32 {l, h}, $2;
        cvt.rn.f16x2.e4m3x2 $0, l;
        cvt.rn.f16x2.e4m3x2 $1, h;
        }""",
        "=r,=r,r", [x], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def mul_f16x2(a, b):
    """a, b: int32 float16x2 words -> int32 float16x2 word of the lane-wise products, RNE (float16
    subnormals kept): the pure-Triton twin of mul_f16x2_asm. A float16 product is exact in float32,
    so one float32 multiply and one rounding to float16 give the correctly rounded product."""
    lo = f32_to_f16_lo(f16_lo_to_f32(a) * f16_lo_to_f32(b))
    hi = f32_to_f16_lo(f16_lo_to_f32(a >> 16) * f16_lo_to_f32(b >> 16))
    return lo | (hi << 16)


@triton.jit
def mul_f16x2_asm(a, b):
    """mul_f16x2 as one PTX mul.rn.f16x2 (.rn: never contracted into an FMA). CUDA only."""
    return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _max_abs_f16_half(a, b):
    fa = tl.abs(f16_lo_to_f32(a))
    fb = tl.abs(f16_lo_to_f32(b))
    return f32_to_f16_lo(tl.where(fa != fa, fb, tl.where(fb > fa, fb, fa)))


@triton.jit
def max_abs_f16x2(a, b):
    """a, b: int32 float16x2 words -> int32 float16x2 word of max(|a|, |b|) per lane, a NaN lane
    giving the other operand (NaN only if both are): the pure-Triton twin of max_abs_f16x2_asm, and a
    reduction combine (the maximum magnitude of every value it sees)."""
    return _max_abs_f16_half(a, b) | (_max_abs_f16_half(a >> 16, b >> 16) << 16)


@triton.jit
def max_abs_f16x2_asm(a, b):
    """max_abs_f16x2 as PTX abs.f16x2 twice and max.f16x2 (whose NaN rule is the twin's); ptxas folds
    the two abs into the max's operand modifiers (one HMNMX2). CUDA only."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 x, y;
        abs.f16x2 x, $1;
        abs.f16x2 y, $2;
        max.f16x2 $0, x, y;
        }""",
        "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _f16_half_to_e4m3(h):
    return e4m3_rne(f16_lo_to_f32(h))


@triton.jit
def f16x2x2_to_e4m3x4(lo, hi):
    """lo, hi: int32 float16x2 words -> int32 of four E4M3 bytes (lo's halves then hi's, low half
    first): RNE into subnormals and to signed zero, saturating at 448, NaN -> 0x7F (e4m3_rne on the
    exact float32 value). The pure-Triton twin of f16x2x2_to_e4m3x4_asm."""
    return (_f16_half_to_e4m3(lo) | (_f16_half_to_e4m3(lo >> 16) << 8) | (_f16_half_to_e4m3(hi) << 16)
            | (_f16_half_to_e4m3(hi >> 16) << 24))


@triton.jit
def f16x2x2_to_e4m3x4_asm(lo, hi):
    """f16x2x2_to_e4m3x4 as two PTX cvt.rn.satfinite.e4m3x2.f16x2 (sm_89+, CUDA only)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 l, h;
        cvt.rn.satfinite.e4m3x2.f16x2 l, $1;
        cvt.rn.satfinite.e4m3x2.f16x2 h, $2;
        mov.b32 $0, {l, h};
        }""",
        "=r,r,r", [lo, hi], dtype=tl.int32, is_pure=True, pack=1)
