"""Pure-torch building blocks shared by every reference conversion.

These are the element-level rules of DESIGN.md's numerics table, written once in torch so that the
reference conversions (and the tests) agree with each other by construction. The Triton kernels
re-implement the same rules as ``@triton.jit`` device functions and are tested bit for bit against
the references built from these.

Exponent conventions: an E8M0 byte ``b`` means ``2^(b - 127)`` (byte 0xFF is NaN); an FP8 tile
scale is the float32 ``2^S``. Every function takes and returns plain tensors.
"""

from __future__ import annotations

import enum

import torch

MXFP4_BLOCK = 32
FP8_TILE = 128

E2M1_MAX = 6.0
E4M3_MAX = 448.0

E8M0_BIAS = 127
E8M0_NAN = 0xFF
# E8M0 exponent range: bytes 0..254.
MX_EXP_MIN = -127
MX_EXP_MAX = 127
# FP8 tile-scale exponent range. The floor is float32's smallest *normal* power of two so that a
# GEMM that flushes denormal scales to zero never sees one; the ceiling is E8M0's.
FP8_EXP_MIN = -126
FP8_EXP_MAX = 127

# E4M3 NaN is canonicalised to 0x7F (positive, all ones): the sign of a NaN is not meaningful and a
# canonical byte lets kernel and reference outputs be compared as raw bytes.
E4M3_NAN_BYTE = 0x7F

# The 8 magnitudes of E2M1, indexed by the 3 low bits of a code (bit 3 is the sign).
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# RNE decision points between neighbouring E2M1 magnitudes, and whether a value exactly on the
# point rounds up. A tie rounds to the code whose mantissa bit is 0 (the even code):
#   0.25 -> 0 (code 0), 0.75 -> 1 (code 2), 1.25 -> 1 (code 2), 1.75 -> 2 (code 4),
#   2.5 -> 2 (code 4), 3.5 -> 4 (code 6), 5 -> 4 (code 6).
_E2M1_TIES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
              (2.5, False), (3.5, True), (5.0, False))


def e2m1_values(device=None) -> torch.Tensor:
    """float32 [16]: the value of every E2M1 code 0..15 (codes 8..15 are the negatives)."""
    mags = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """v: float32 [...] already divided by the block scale -> uint8 [...] E2M1 codes in 0..15.

    Round-to-nearest-even on the E2M1 grid, saturating at +-6. The sign bit is kept, so a negative
    value that rounds to zero gives code 8 (-0). NaN inputs are not expected here (their block is
    marked NaN by its scale); they encode as +0 (code 0).
    """
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for point, tie_up in _E2M1_TIES:
        code += (a >= point if tie_up else a > point).to(torch.uint8)
    return code | (torch.signbit(v) & ~torch.isnan(v)).to(torch.uint8) << 3


class Rounding(str, enum.Enum):
    """How a value is put on the E2M1 grid. NEAREST: to nearest, ties to even (``encode_e2m1``).
    STOCHASTIC: to one of its two neighbours with probability proportional to closeness, from 32 random
    bits per element (``encode_e2m1_stochastic``): unbiased for |v| <= 6, for gradients."""

    NEAREST = "nearest"
    STOCHASTIC = "stochastic"


_MASK32 = 0xFFFFFFFF
PHILOX_KEY_A, PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUND_A, PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a: a uint32 constant, b: int64 [...] holding uint32 -> (high, low) 32-bit halves of a * b, in
    int64 without overflow (b split into 16-bit halves)."""
    bh, bl = b >> 16, b & 0xFFFF
    p_hi, p_lo = a * bh, a * bl                       # each < 2^48
    return (p_hi + (p_lo >> 16)) >> 16, (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32


def philox4x32(seed: int, c0: torch.Tensor, c1, c2, c3, rounds: int = 10):
    """Philox4x32-10 of counters (c0, c1, c2, c3) (int64 tensors or ints holding uint32) under the 64-bit
    ``seed`` -> four int64 tensors holding uint32: Triton's ``tl.philox(seed, c0, c1, c2, c3)`` (the key
    is (seed & 0xFFFFFFFF, seed >> 32)), bit for bit, so a kernel's random bits equal the reference's."""
    c = [torch.as_tensor(v, dtype=torch.int64, device=c0.device).expand_as(c0) & _MASK32 for v in (c0, c1, c2, c3)]
    c0, c1, c2, c3 = c
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(rounds):
        hi_b, lo_b = _mul32(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul32(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + PHILOX_KEY_A) & _MASK32, (k1 + PHILOX_KEY_B) & _MASK32
    return c0, c1, c2, c3


# Random bits per element for stochastic rounding. One Philox4x32 call (10 rounds, about 80 integer
# operations) yields 128 bits: at 16 per element it serves 8 elements, which keeps the encoder near
# the memory bound (32 bits each would cost 4x the Philox work). 16 bits bound the rounding's bias by
# 2^-16 of the grid spacing (P(up) = ceil(frac * 2^16) / 2^16); Blackwell's cvt.rs for E2M1 uses 8.
SR_BITS = 16
SR_GROUP = 128 // SR_BITS   # elements per Philox call


def random_bits(seed: int, step: int, rank: int, numel: int, device=None) -> torch.Tensor:
    """The SR_BITS random bits of each of ``numel`` elements (row-major offsets 0..numel-1) -> int64
    [numel] in [0, 2^16). Element o takes half (o % 2, the low half first) of word (o % 8) // 2 of
    Philox4x32-10 under ``seed`` at the counter (g low 32 bits, g high 32 bits, step, rank), g = o // 8.
    A run is reproducible from (seed, step, rank); each element, step and rank draws its own bits."""
    off = torch.arange(numel, dtype=torch.int64, device=device)
    g = off // SR_GROUP
    words = torch.stack(philox4x32(seed, g & _MASK32, g >> 32, step, rank), -1) if numel else off[:, None]
    word = words.gather(-1, ((off % SR_GROUP) // 2)[:, None])[:, 0] if numel else off
    return (word >> (SR_BITS * (off % 2))) & ((1 << SR_BITS) - 1)


# E2M1's magnitude grid and the spacing above each point (the last, 6, saturates).
_E2M1_SPACING = (0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 0.0)


def encode_e2m1_stochastic(v: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """v: float32 [...] already divided by the block scale, bits: int64 [...] of SR_BITS random bits
    (``random_bits``) -> uint8 [...] E2M1 codes. With a = min(|v|, 6), lo the largest grid magnitude <= a
    and d the spacing above it, the code is lo's, or the next one up when u < (a - lo) / d, u = bits *
    2^-16 in [0, 1). Every operation is exact in float32 (a - lo by Sterbenz, d a power of two), so any
    implementation gives the same bytes for the same bits, and E[value] = a for |v| <= 6 up to 2^-16 d
    (u's resolution). Sign kept (-0 for a negative that rounds to 0); NaN inputs encode as +0 (their
    block is marked NaN by its scale)."""
    a = torch.where(torch.isnan(v), torch.zeros_like(v), v.abs()).clamp(max=E2M1_MAX)
    mags = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=v.device)
    spacing = torch.tensor(_E2M1_SPACING, dtype=torch.float32, device=v.device)
    lo = (a[..., None] >= mags).sum(-1) - 1                        # index of the largest magnitude <= a
    d = spacing[lo]
    frac = torch.where(d > 0, (a - mags[lo]) / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(a))
    u = bits.to(torch.float32) * 2.0 ** -SR_BITS
    code = (lo + (u < frac).to(lo.dtype)).to(torch.uint8)
    return code | (torch.signbit(v) & ~torch.isnan(v)).to(torch.uint8) << 3


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """codes: uint8 [...] in 0..15 -> float32 [...] E2M1 values."""
    return e2m1_values(codes.device)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes: uint8 [..., K] (K even) -> uint8 [..., K/2]; element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """data: uint8 [..., K/2] -> uint8 [..., K] codes; element 2i from the low nibble."""
    return torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """e: int32 [...] in [-149, 127] -> float32 [...] exactly 2^e (subnormal below -126).

    Built from the bit pattern, not ``exp2``, so that no libm rounding can creep in.
    """
    e = e.to(torch.int32)
    normal = ((e.clamp(-126, 127) + 127) << 23).view(torch.float32)
    # 2^e for e < -126 is the subnormal with the single mantissa bit 2^(e + 149).
    sub_bits = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, sub_bits.view(torch.float32))


def ceil_log2_ratio(amax: torch.Tensor, m_limit_bits: int, log2_hi: int) -> torch.Tensor:
    """Smallest integer X with amax <= (1 + m_limit) * 2^(log2_hi + X), computed on the bits.

    amax: float32 [...], finite, >= 0 -> int32 [...]. ``m_limit_bits`` is the 23-bit mantissa
    field of the bound's significand: 6 = 1.5 * 2^2 gives (0x400000, 2); 448 = 1.75 * 2^8 gives
    (0x600000, 8). Writing amax = m * 2^e with m in [1, 2): the answer is e - log2_hi when
    m <= 1 + m_limit, else one more. This is ceil(log2(amax / bound)) evaluated exactly, where a
    float division amax / 6 could round down onto a power of two and make the scale clip.
    amax == 0 and float32 subnormals give a very small result that callers clamp.
    """
    bits = amax.view(torch.int32)
    biased = bits >> 23
    mant = bits & 0x7FFFFF
    x = biased - 127 - log2_hi + (mant > m_limit_bits).to(torch.int32)
    # Zero and subnormal amax: below every clamp floor used here.
    return torch.where(biased == 0, torch.full_like(x, -1000), x)


def mx_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """amax: float32 [...] finite -> int32 [...] E = clamp(ceil(log2(amax / 6)), -127, 127) (RCEIL)."""
    return ceil_log2_ratio(amax, 0x400000, 2).clamp(MX_EXP_MIN, MX_EXP_MAX)


def fp8_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """amax: float32 [...] finite -> int32 [...] S = clamp(ceil(log2(amax / 448)), -126, 127)."""
    return ceil_log2_ratio(amax, 0x600000, 8).clamp(FP8_EXP_MIN, FP8_EXP_MAX)


def encode_e4m3(v: torch.Tensor) -> torch.Tensor:
    """v: float32 [...] already divided by the tile scale, |v| <= 448 or non-finite
    -> float8_e4m3fn [...]: RNE (into subnormals and to signed zero), saturating at +-448; NaN and
    +-Inf give the canonical NaN byte 0x7F.
    """
    finite = torch.isfinite(v)
    q = torch.where(finite, v.clamp(-E4M3_MAX, E4M3_MAX), torch.zeros_like(v)).to(torch.float8_e4m3fn)
    nan = torch.full_like(q.view(torch.uint8), E4M3_NAN_BYTE)
    return torch.where(finite, q.view(torch.uint8), nan).view(torch.float8_e4m3fn)


# Canonical quiet NaN per output dtype: outputs are compared as raw bytes, and torch's own float32 ->
# bfloat16 cast gives different NaN bits on different CPU code paths (0x7FC0 or 0xFFFF).
NAN_BITS = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000}
_INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


# Largest finite magnitude per output dtype, as bits: where a decode saturates (``to_output``).
FINITE_MAX_BITS = {torch.bfloat16: 0x7F7F, torch.float16: 0x7BFF, torch.float32: 0x7F7FFFFF}


def _scalar_of_bits(bits: int, dtype: torch.dtype, device) -> torch.Tensor:
    # A fill, not torch.tensor(..., device=cuda): that copies from pageable host memory, a host sync.
    return torch.full((), bits, dtype=_INT_OF[dtype], device=device).view(dtype)


def with_canonical_nan(out: torch.Tensor, nan: torch.Tensor) -> torch.Tensor:
    """out: bf16/fp16/fp32 [...], nan: bool broadcastable to out -> out with NAN_BITS where nan."""
    return torch.where(nan, _scalar_of_bits(NAN_BITS[out.dtype], out.dtype, out.device), out)


def to_output(v: torch.Tensor, dtype: torch.dtype, nan: torch.Tensor | None = None) -> torch.Tensor:
    """v: float32 [...] decoded values (+-Inf where the float32 product overflowed) -> dtype [...]
    (bf16/fp16/fp32): rounded to nearest even, and a result past dtype's largest finite magnitude
    saturated to it, sign kept, so no finite encoded value decodes to Inf; the canonical NaN
    (NAN_BITS) where ``nan`` (bool, broadcastable). The rule of triton_numerics.f32_to_out_bits."""
    out = v.to(dtype)
    top = _scalar_of_bits(FINITE_MAX_BITS[dtype], dtype, v.device)
    out = torch.where(torch.isinf(out), torch.where(torch.signbit(out), -top, top), out)
    return out if nan is None else with_canonical_nan(out, nan)


def finite_abs(x: torch.Tensor) -> torch.Tensor:
    """x: float32 [...] -> float32 [...] |x| with NaN and Inf replaced by 0 (for amax of finite values)."""
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))


def tile_amax(x: torch.Tensor, tile: int) -> torch.Tensor:
    """x: float32 [M, K] -> float32 [M, ceil(K/tile)]: max |finite x| per tile (a short last tile is fine)."""
    m, k = x.shape
    n = -(-k // tile)
    pad = torch.zeros(m, n * tile, dtype=torch.float32, device=x.device)
    pad[:, :k] = finite_abs(x)
    return pad.view(m, n, tile).amax(dim=-1)


def tile_any_nonfinite(x: torch.Tensor, tile: int) -> torch.Tensor:
    """x: float32 [M, K] (K % tile == 0) -> bool [M, K/tile]: whether a tile holds NaN or Inf."""
    m, k = x.shape
    return (~torch.isfinite(x)).view(m, k // tile, tile).any(dim=-1)
