"""NVFP4: E2M1 values, one E4M3 scale per 16 elements, one float32 scale per tensor.

Triton kernels (``quantize_nvfp4``, ``dequantize_nvfp4``), their launchers, and the exact pure-torch
references ``*_ref`` with the same signatures, which the kernels equal bit for bit (tests/formats/test_nvfp4.py),
as for MXFP4. The tensor scale (rule 1) takes one pass of its own (``nvfp4_tensor_scale``, the finite
amax); the block kernel reads it as a float32 0-d tensor. The rules, in float32 unless said otherwise
(DESIGN.md section 2):

1. tensor scale: s_t = max(amax_t / 2688, 2^-126), one float32 division; amax_t is the largest |x| over
   the finite elements (NaN and +-Inf ignored, 0 for a tensor with none). 2688 = 448 * 6 maps amax_t onto
   the largest E4M3 scale times the largest E2M1 value. The floor keeps s_t a float32 normal, so a zero
   or tiny tensor needs no special case: its blocks round to zero scales.
2. block scale, per 16 consecutive elements of a row: r = amax_b / fl(6 * s_t) (two float32 roundings),
   stored as the E4M3 code of r rounded to nearest even, saturating at 448 (``encode_e4m3``); E4M3
   subnormals are used. A block holding NaN or +-Inf gets the E4M3 NaN byte 0x7F.
3. elements: with the block's effective scale S = fl(e4m3(code) * s_t), each value x / S (one float32
   division) is rounded to the nearest E2M1 value, ties to even, saturating at +-6 (``encode_e2m1``),
   sign kept (-0 for a small negative). A block whose scale code is 0 (r below half the smallest E4M3
   subnormal, 2^-10) has S = 0 and stores signed zeros; a NaN block stores codes 0.
4. dequantize: fl(fl(e2m1 * e4m3) * s_t) in float32 (the first product is exact), rounded once to the
   output dtype, a value past that dtype's largest finite magnitude (or a float32 product that
   overflowed, possible with a given tensor scale above about 2^117) saturating to it, sign kept
   (``numerics.to_output``); a NaN block gives NaN (the canonical bits of ``NAN_BITS``).

FP8 1x128 (E4M3 codes, power-of-two float32 scale per 128 columns) on either side, each defined as the
composition of the exact conversions, which a kernel fuses into one pass over the codes:

5. FP8 -> NVFP4 (``quantize_nvfp4_from_fp8``): rules 1-3 applied to the FP8 tensor's values code * 2^S,
   which float32 holds exactly (a NaN byte is NaN, a product past float32 +-Inf: ``fp8_values_ref``);
   = ``quantize_nvfp4_ref(fp8_values_ref(., .))``. Nothing is lost that quantizing the values would
   not lose; the FP8 value 2^128, which ``quantize_fp8`` makes of bf16's and float32's largest values,
   is +-Inf here and makes its block a NaN block.
6. NVFP4 -> FP8 (``nvfp4_to_fp8_rowwise``, the GEMM operand): the FP8 1x128 rule
   (``quantize_fp8_rowwise_ref``: S = ceil(log2(tile amax / 448)), RNE into E4M3) applied to rule 4's
   float32 values (unsaturated: an overflowed product is +-Inf, the NaN byte); =
   ``quantize_fp8_rowwise_ref(nvfp4_values_ref(., ., .))``. Not exact in
   general: an element is e2m1 * e4m3 * s_t, up to 24 significant bits for an arbitrary tensor scale,
   and E4M3 keeps 4; each element then moves by at most half an E4M3 step (2^-4 of its value in the
   normal range), and blocks more than about 17 binades below the tile's largest round into E4M3's
   subnormals or to zero. How often and how far on real activations: bench/RESULTS.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_fp4.kernels.fp8 import empty_m_major, fp8_values_ref, quantize_fp8_rowwise_ref
from moe_fp4.kernels.mxfp4 import check_row_views, write_out
from moe_fp4.kernels.numerics import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_NAN_BYTE,
    Rounding,
    decode_e2m1,
    encode_e2m1,
    encode_e2m1_stochastic,
    encode_e4m3,
    finite_abs,
    pack_nibbles,
    random_bits,
    to_output,
    unpack_nibbles,
)
from moe_fp4.kernels.triton_numerics import (
    block_program,
    e2m1_rne_mag,
    e2m1_sr_mag,
    e4m3_rne,
    e4m3_to_f32_bits,
    f32_to_out_bits,
    fp8_encode_tiles,
    fp8_scale_exp,
    load_pairs_as_f32_bits,
    pair_view,
    philox_pair_words,
    pow2_f32,
    row_column_grid,
    store_pair_words,
    tile_program,
    tl_dtype,
    u32_as_i32,
    use_asm,
    words_view,
)

NVFP4_BLOCK = 16
# amax_t / NVFP4_TENSOR_DIVISOR maps a tensor's largest finite magnitude onto E4M3_MAX * E2M1_MAX.
NVFP4_TENSOR_DIVISOR = E4M3_MAX * E2M1_MAX
# Floor of the tensor scale: float32's smallest normal.
NVFP4_TENSOR_SCALE_MIN = 2.0 ** -126


def nvfp4_tensor_scale_ref(x: torch.Tensor) -> torch.Tensor:
    """x: bf16/fp16/fp32 [...] -> float32 0-d: max(amax of the finite |x| / 2688, 2^-126) (rule 1)."""
    amax = finite_abs(x.float()).amax() if x.numel() else torch.zeros((), device=x.device)
    s = amax / torch.tensor(NVFP4_TENSOR_DIVISOR, dtype=torch.float32, device=x.device)
    return s.clamp(min=NVFP4_TENSOR_SCALE_MIN)


def quantize_nvfp4_ref(x: torch.Tensor, tensor_scale: torch.Tensor | None = None,
                       rounding: Rounding = Rounding.NEAREST, seed: int = 0, step: int = 0, rank: int = 0,
                       out=None):
    """x: bf16/fp16/fp32 [M, K], K % 16 == 0; tensor_scale: float32 0-d (default: rule 1 from x)
    -> (data uint8 [M, K/2] two E2M1 codes a byte (element 2i in the low nibble), scale float8_e4m3fn
    [M, K/16], tensor_scale float32 0-d). A given tensor_scale lets a tensor be quantized in pieces
    with one scale (it must be a positive float32 normal). rounding STOCHASTIC rounds the elements with
    ``encode_e2m1_stochastic`` and the bits ``random_bits(seed, step, rank, M * K)`` (scales as for
    NEAREST; unbiased except where an element exceeds 6 S, which rule 2's saturation can cause). ``out``:
    (data uint8 [M, K/2], scale uint8 [M, K/16]) views with unit column stride to write the codes and
    the E4M3 bytes into (a wire's rows); they are returned in place of new tensors."""
    m, k = x.shape
    xf = x.float()
    s_t = nvfp4_tensor_scale_ref(xf) if tensor_scale is None else tensor_scale.to(torch.float32).reshape(())
    blocks = xf.view(m, k // NVFP4_BLOCK, NVFP4_BLOCK)
    nonfinite = (~torch.isfinite(blocks)).any(dim=-1)
    amax_b = finite_abs(blocks).amax(dim=-1) if k else torch.zeros(m, 0, device=x.device)
    r = amax_b / (6.0 * s_t)                                           # rule 2: fl(6 * s_t), then the division
    code = encode_e4m3(r.clamp(max=E4M3_MAX))
    nan_byte = torch.full_like(code.view(torch.uint8), E4M3_NAN_BYTE)
    code = torch.where(nonfinite, nan_byte, code.view(torch.uint8)).view(torch.float8_e4m3fn)
    eff = torch.where(nonfinite, torch.zeros_like(r), code.float() * s_t)   # rule 3: S = fl(e4m3 * s_t)
    safe = torch.where(eff > 0, eff, torch.ones_like(eff))[..., None]
    v = torch.where((eff > 0)[..., None], blocks / safe, blocks * 0.0)     # S = 0: signed zeros
    v = torch.where(nonfinite[..., None], torch.zeros_like(v), v)          # NaN block: codes 0
    v = v.view(m, k)
    if Rounding(rounding) is Rounding.STOCHASTIC:
        codes = encode_e2m1_stochastic(v, random_bits(seed, step, rank, m * k, x.device).view(m, k))
    else:
        codes = encode_e2m1(v)
    if out is not None:
        return (*write_out(out, pack_nibbles(codes), code.view(torch.uint8)), s_t)
    return pack_nibbles(codes), code, s_t


def _nvfp4_products(data: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor):
    """data, scale, tensor_scale as dequantize_nvfp4_ref -> (float32 [M, K/16, 16] products
    fl(fl(e2m1 * e4m3) * s_t), +-Inf where they overflow and 0 in NaN blocks; bool [M, K/16] NaN blocks)."""
    m, half_k = data.shape
    k = 2 * half_k
    vals = decode_e2m1(unpack_nibbles(data)).view(m, k // NVFP4_BLOCK, NVFP4_BLOCK)
    sv = scale.float()
    nan = torch.isnan(sv)
    s_t = tensor_scale.to(torch.float32)
    s_t = s_t.reshape(m, 1, 1) if s_t.dim() else s_t
    return (vals * torch.where(nan, torch.zeros_like(sv), sv)[..., None]) * s_t, nan


def nvfp4_values_ref(data: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """data uint8 [M, K/2], scale float8_e4m3fn [M, K/16], tensor_scale float32 0-d or [M] -> float32
    [M, K]: rule 4's products as they are, +-Inf where float32 overflows and NaN in NaN blocks (what the
    NVFP4 -> FP8 conversions encode; a decode saturates instead, dequantize_nvfp4_ref)."""
    v, nan = _nvfp4_products(data, scale, tensor_scale)
    return torch.where(nan[..., None], torch.full_like(v, float("nan")), v).view(data.shape[0], 2 * data.shape[1])


def dequantize_nvfp4_ref(data: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """data uint8 [M, K/2], scale float8_e4m3fn [M, K/16], tensor_scale float32 0-d, or [M] (one per row:
    rows received from several senders) -> dtype [M, K] (rule 4: saturating, never Inf)."""
    v, nan = _nvfp4_products(data, scale, tensor_scale)
    return to_output(v, dtype, nan[..., None]).view(data.shape[0], 2 * data.shape[1])


def nvfp4_tensor_scale_from_fp8_ref(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """data float8_e4m3fn [M, K], scale float32 [M, K/128] -> float32 0-d: rule 1 over the FP8 values."""
    return nvfp4_tensor_scale_ref(fp8_values_ref(data, scale))


def quantize_nvfp4_from_fp8_ref(data: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None = None,
                                rounding: Rounding = Rounding.NEAREST, seed: int = 0, step: int = 0, rank: int = 0,
                                out=None):
    """Rule 5: data float8_e4m3fn [M, K], scale float32 [M, K/128] (FP8 1x128, K % 128 == 0) ->
    quantize_nvfp4_ref of its float32 values (exact), with the same other arguments and results."""
    return quantize_nvfp4_ref(fp8_values_ref(data, scale), tensor_scale, rounding, seed, step, rank, out)


def nvfp4_to_fp8_colwise_ref(data: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor):
    """data uint8 [M, K/2], scale float8_e4m3fn [M, K/16], tensor_scale float32 0-d or [M] -> (data
    float8_e4m3fn [K, M], scale float32 [K, ceil(M/128)] M-major): the FP8 1x128 quantization along
    tokens of the transposed float32 values (nvfp4_values_ref; the weight gradient's operand; any M)."""
    v = nvfp4_values_ref(data, scale, tensor_scale)
    return quantize_fp8_rowwise_ref(v.t().contiguous())


def nvfp4_to_fp8_rowwise_ref(data: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor):
    """Rule 6: data uint8 [M, K/2], scale float8_e4m3fn [M, K/16], tensor_scale float32 0-d or [M] (K %
    128 == 0) -> (data float8_e4m3fn [M, K], scale float32 [M, K/128] M-major): the FP8 1x128
    quantization of the float32 values (nvfp4_values_ref; NaN blocks give the NaN byte 0x7F)."""
    return quantize_fp8_rowwise_ref(nvfp4_values_ref(data, scale, tensor_scale))


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _finite_amax_kernel(x_ptr, amax_ptr, N, IN_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    # Rule 1's amax: the largest finite |x| as float32 bits (monotone in |x| for finite values; NaN and
    # +-Inf, bits >= 0x7F800000, count as 0), one atomic max per program into an int32 that starts at 0.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lo, hi = load_pairs_as_f32_bits(x_ptr, offs, offs < N, IN_DTYPE)
    lo = lo & 0x7FFFFFFF
    hi = hi & 0x7FFFFFFF
    m = tl.maximum(tl.where(lo >= 0x7F800000, 0, lo), tl.where(hi >= 0x7F800000, 0, hi))
    tl.atomic_max(amax_ptr, tl.max(m, axis=0))


@triton.jit
def fp8_pairs_as_f32_bits(w, s):
    """w: int32 holding int16 pair words of two E4M3 bytes (element 2i in the low byte), s: float32 tile
    scales 2^S broadcastable to w -> (lo, hi) int32 fp32 bits of code * 2^S (exact, as
    fp8_values_ref; a NaN byte gives NaN)."""
    b_lo = w & 0xFF
    b_hi = (w >> 8) & 0xFF
    lo = (e4m3_to_f32_bits(b_lo).to(tl.float32, bitcast=True) * s).to(tl.int32, bitcast=True)
    hi = (e4m3_to_f32_bits(b_hi).to(tl.float32, bitcast=True) * s).to(tl.int32, bitcast=True)
    return tl.where((b_lo & 0x7F) == 0x7F, 0x7FC00000, lo), tl.where((b_hi & 0x7F) == 0x7F, 0x7FC00000, hi)


@triton.jit
def _fp8_finite_amax_kernel(w_ptr, s_ptr, amax_ptr, M, NT, stride_wm, stride_sm, stride_st,
                            BLOCK_M: tl.constexpr, TILES: tl.constexpr):
    # Rule 1's amax over FP8 1x128 values (code * 2^S): the largest finite |value| as float32 bits, one
    # atomic max per program (as _finite_amax_kernel). A program covers [BLOCK_M, TILES] tiles.
    rows, t, mask_t, mask3, _mask4, _ = tile_program(M, NT, BLOCK_M, TILES)
    pair = (t * 64)[None, :, None] + tl.arange(0, 64)[None, None, :]
    w = tl.load(w_ptr + rows[:, None, None] * stride_wm + pair, mask=mask3, other=0).to(tl.int32)
    ts = tl.load(s_ptr + rows[:, None] * stride_sm + t[None, :] * stride_st, mask=mask_t, other=1.0)
    lo, hi = fp8_pairs_as_f32_bits(w, tl.expand_dims(ts, -1))
    lo = lo & 0x7FFFFFFF
    hi = hi & 0x7FFFFFFF
    m = tl.maximum(tl.where(lo >= 0x7F800000, 0, lo), tl.where(hi >= 0x7F800000, 0, hi))
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.max(m, axis=2), axis=1), axis=0))


@triton.jit
def _tensor_scale_kernel(amax_ptr, st_ptr, DIVISOR: tl.constexpr, FLOOR: tl.constexpr):
    # Rule 1 on the amax: max(amax / 2688, 2^-126), the division correctly rounded (div_rn) as torch's.
    amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
    tl.store(st_ptr, tl.maximum(tl.math.div_rn(amax, DIVISOR), FLOOR))


@triton.jit
def _quantize_nvfp4_kernel(
    x_ptr, xs_ptr, data_ptr, scale_ptr, st_ptr, M, KB, stride_xm, stride_xsm, stride_xst, stride_dm, stride_sm,
    seed, step, rank,
    IN_DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Rules 2 and 3 of the module docstring per 16-element block; divisions are div_rn (Triton's "/" on
    # float32 is an approximate division on the GPU). IN_DTYPE tl.bfloat16 / tl.float16 / tl.float32:
    # pair words; tl.float8e4nv: FP8 1x128 (int16 pair words of E4M3 codes, xs_ptr the tile scales;
    # rule 5), the values formed exactly.
    NB: tl.constexpr = BLOCK_K // 16
    rows, kb, mask2, mask3, pair = block_program(M, KB, BLOCK_M, NB, PAIRS=8)
    if IN_DTYPE == tl.float8e4nv:
        w = tl.load(x_ptr + rows[:, None, None] * stride_xm + pair, mask=mask3, other=0).to(tl.int32)
        ts = tl.load(xs_ptr + rows[:, None] * stride_xsm + (kb // 8)[None, :] * stride_xst, mask=mask2, other=1.0)
        lo, hi = fp8_pairs_as_f32_bits(w, tl.expand_dims(ts, -1))
    else:
        lo, hi = load_pairs_as_f32_bits(x_ptr, rows[:, None, None] * stride_xm + pair, mask3, IN_DTYPE)
    lo_abs = lo & 0x7FFFFFFF
    hi_abs = hi & 0x7FFFFFFF
    nonfinite = tl.max(tl.maximum(lo_abs, hi_abs), axis=2) >= 0x7F800000          # [BM, NB]
    # The block maximum over its finite values, on the bits (monotone in |x| for finite values).
    fin_lo = tl.where(lo_abs >= 0x7F800000, 0, lo_abs)
    fin_hi = tl.where(hi_abs >= 0x7F800000, 0, hi_abs)
    amax = tl.max(tl.maximum(fin_lo, fin_hi), axis=2).to(tl.float32, bitcast=True)
    s_t = tl.load(st_ptr)
    # r = amax / fl(6 s_t), saturated at 448 (a given tensor scale far below rule 1's can make it Inf).
    code = e4m3_rne(tl.minimum(tl.math.div_rn(amax, 6.0 * s_t), 448.0))
    code = tl.where(nonfinite, 0x7F, code)
    eff = e4m3_to_f32_bits(tl.where(nonfinite, 0, code)).to(tl.float32, bitcast=True) * s_t   # S
    eff3 = tl.expand_dims(eff, -1)
    pos = eff3 > 0
    safe = tl.where(pos, eff3, 1.0)
    a_lo = tl.where(pos, tl.math.div_rn(lo_abs.to(tl.float32, bitcast=True), safe), 0.0)
    a_hi = tl.where(pos, tl.math.div_rn(hi_abs.to(tl.float32, bitcast=True), safe), 0.0)
    if STOCHASTIC:
        words = philox_pair_words(seed, step, rank, rows, kb, KB, 8)
        m_lo = e2m1_sr_mag(tl.minimum(a_lo, 6.0), words & 0xFFFF)
        m_hi = e2m1_sr_mag(tl.minimum(a_hi, 6.0), words >> 16)
    else:
        m_lo = e2m1_rne_mag(a_lo.to(tl.int32, bitcast=True), True)
        m_hi = e2m1_rne_mag(a_hi.to(tl.int32, bitcast=True), True)
    packed = m_lo | (m_hi << 4) | ((lo >> 28) & 8) | ((hi >> 24) & 0x80)
    packed = tl.where(tl.expand_dims(nonfinite, -1), 0, packed)
    tl.store(data_ptr + rows[:, None, None] * stride_dm + pair, packed.to(tl.uint8), mask=mask3)
    tl.store(scale_ptr + rows[:, None] * stride_sm + kb[None, :], code.to(tl.uint8), mask=mask2)


@triton.jit
def _dequantize_nvfp4_kernel(
    data_ptr, scale_ptr, st_ptr, out_ptr, M, KB, stride_dm, stride_sm, stride_om, stride_st,
    OUT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Rule 4: fl(fl(e2m1 * e4m3) * s_t) (the first product exact), rounded once to the output dtype and
    # saturated (f32_to_out_bits).
    NB: tl.constexpr = BLOCK_K // 16
    rows, kb, mask2, mask3, pair = block_program(M, KB, BLOCK_M, NB, PAIRS=8)
    b = tl.load(data_ptr + rows[:, None, None] * stride_dm + pair, mask=mask3, other=0).to(tl.int32)
    code = tl.load(scale_ptr + rows[:, None] * stride_sm + kb[None, :], mask=mask2, other=0).to(tl.int32)
    nan = tl.expand_dims((code & 0x7F) == 0x7F, -1)
    sv = tl.expand_dims(e4m3_to_f32_bits(tl.where((code & 0x7F) == 0x7F, 0, code)).to(tl.float32, bitcast=True), -1)
    s_t = tl.load(st_ptr + rows * stride_st, mask=rows < M, other=1.0)[:, None, None]   # stride 0: one scale
    lo = f32_to_out_bits(_e2m1_value(b & 15) * sv * s_t, nan, OUT_DTYPE)
    hi = f32_to_out_bits(_e2m1_value(b >> 4) * sv * s_t, nan, OUT_DTYPE)
    store_pair_words(out_ptr, rows[:, None, None] * stride_om + pair, lo, hi, mask3, OUT_DTYPE)


@triton.jit
def _nvfp4_to_fp8_kernel(d_ptr, s_ptr, st_ptr, o_ptr, os_ptr, M, NT, stride_dm, stride_sm, stride_om, stride_st,
                         BLOCK_M: tl.constexpr, TILES: tl.constexpr, ASM: tl.constexpr):
    # Rule 6 per 1x128 tile: its 8 NVFP4 blocks decoded by rule 4 (float32), then the FP8 tile rule
    # (fp8_encode_tiles) on [BM, TILES, 8 blocks, 8 pairs]: NVFP4 byte j of a tile holds elements 2j and
    # 2j+1, which FP8 int16 pair word j holds too, so the offsets are shared.
    rows, t, mask_t, mask3, mask4, _ = tile_program(M, NT, BLOCK_M, TILES)
    pair = ((t * 64)[None, :, None, None] + (tl.arange(0, 8) * 8)[None, None, :, None]
            + tl.arange(0, 8)[None, None, None, :])
    blk = (t * 8)[None, :, None] + tl.arange(0, 8)[None, None, :]
    b = tl.load(d_ptr + rows[:, None, None, None] * stride_dm + pair, mask=mask4, other=0).to(tl.int32)
    code = tl.load(s_ptr + rows[:, None, None] * stride_sm + blk, mask=mask3, other=0).to(tl.int32)
    nan3 = (code & 0x7F) == 0x7F
    nan = tl.expand_dims(nan3, -1)
    sv = tl.expand_dims(e4m3_to_f32_bits(tl.where(nan3, 0, code)).to(tl.float32, bitcast=True), -1)
    s_t = tl.load(st_ptr + rows * stride_st, mask=rows < M, other=1.0)[:, None, None, None]   # stride 0: one scale
    lo = tl.where(nan, 0x7FC00000, (_e2m1_value(b & 15) * sv * s_t).to(tl.int32, bitcast=True))
    hi = tl.where(nan, 0x7FC00000, (_e2m1_value(b >> 4) * sv * s_t).to(tl.int32, bitcast=True))
    word, fscale = fp8_encode_tiles(lo, hi, ASM)
    tl.store(o_ptr + rows[:, None, None, None] * stride_om + pair, word, mask=mask4)
    tl.store(os_ptr + t[None, :].to(tl.int64) * M + rows[:, None], fscale, mask=mask_t)   # M-major


@triton.jit
def _nvfp4_to_fp8_colwise_kernel(d_ptr, s_ptr, st_ptr, o_ptr, os_ptr, M, K, KB, stride_dm, stride_sm, stride_st,
                                 NB: tl.constexpr):
    # A program: one tile of 128 tokens x NB NVFP4 blocks of columns, as [T, NB, 8 pairs]: rule 4's
    # float32 values, then per column (over the tile's tokens) the FP8 1x128 rule, stored transposed.
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    tok = pid_t.to(tl.int64) * 128 + tl.arange(0, 128).to(tl.int64)
    kb = pid_k * NB + tl.arange(0, NB)
    p = tl.arange(0, 8)
    mask2 = (tok < M)[:, None] & (kb < KB)[None, :]
    mask3 = mask2[:, :, None]
    b = tl.load(d_ptr + tok[:, None, None] * stride_dm + (kb * 8)[None, :, None] + p[None, None, :], mask=mask3,
                other=0).to(tl.int32)
    code = tl.load(s_ptr + tok[:, None] * stride_sm + kb[None, :], mask=mask2, other=0).to(tl.int32)
    nan3 = (code & 0x7F) == 0x7F
    nan = tl.expand_dims(nan3, -1)
    sv = tl.expand_dims(e4m3_to_f32_bits(tl.where(nan3, 0, code)).to(tl.float32, bitcast=True), -1)
    s_t = tl.load(st_ptr + tok * stride_st, mask=tok < M, other=1.0)[:, None, None]   # stride 0: one scale
    lo = tl.where(nan, 0x7FC00000, (_e2m1_value(b & 15) * sv * s_t).to(tl.int32, bitcast=True))
    hi = tl.where(nan, 0x7FC00000, (_e2m1_value(b >> 4) * sv * s_t).to(tl.int32, bitcast=True))
    a_lo = lo & 0x7FFFFFFF
    a_hi = hi & 0x7FFFFFFF
    # Per column, the finite amax over the tile's tokens (masked tokens are zeros: no change), then S.
    S_lo = fp8_scale_exp(tl.max(tl.where(a_lo < 0x7F800000, a_lo, 0), axis=0))          # [NB, 8]
    S_hi = fp8_scale_exp(tl.max(tl.where(a_hi < 0x7F800000, a_hi, 0), axis=0))
    q_lo = e4m3_rne(lo.to(tl.float32, bitcast=True) * pow2_f32(-tl.minimum(S_lo, 126))[None, :, :]).to(tl.uint8)
    q_hi = e4m3_rne(hi.to(tl.float32, bitcast=True) * pow2_f32(-tl.minimum(S_hi, 126))[None, :, :]).to(tl.uint8)
    # Transposed store, tokens the fastest axis (as the MXFP4 column kernel): element (token, column
    # 16 kb + 2p (+1 for hi)) goes to out[column, token].
    col = (kb * 16)[:, None, None] + 2 * p[None, :, None]
    off = col.to(tl.int64) * M + tok[None, None, :]
    mask_t = tl.permute(mask3, (1, 2, 0))
    tl.store(o_ptr + off, tl.permute(q_lo, (1, 2, 0)), mask=mask_t)
    tl.store(o_ptr + off + M, tl.permute(q_hi, (1, 2, 0)), mask=mask_t)
    soff = pid_t.to(tl.int64) * K + (kb * 16)[:, None] + 2 * p[None, :]
    mask_c = (kb < KB)[:, None]
    tl.store(os_ptr + soff, pow2_f32(S_lo), mask=mask_c)
    tl.store(os_ptr + soff + 1, pow2_f32(S_hi), mask=mask_c)


@triton.jit
def _e2m1_value(c):
    """int32 E2M1 code 0..15 -> float32 value (exact): magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6."""
    m = c & 7
    # 2^(e-1) * (2 + mantissa) / 2 for the normal codes (m >= 2), m / 2 for 0 and 0.5.
    e = m >> 1
    mant = (m & 1).to(tl.float32)
    normal = (1.0 + 0.5 * mant) * (1 << tl.maximum(e - 1, 0)).to(tl.float32)
    mag = tl.where(m >= 2, normal, 0.5 * m.to(tl.float32))
    # The sign as a bit: Triton's unary minus is 0 - x, which turns code 8 (-0) into +0 on the GPU (the
    # interpreter's numpy negation kept -0; the GPU test caught it).
    return (mag.to(tl.int32, bitcast=True) | ((c & 8) << 28)).to(tl.float32, bitcast=True)


def nvfp4_tensor_scale(x: torch.Tensor, block: int = 4096, num_warps: int = 8) -> torch.Tensor:
    """nvfp4_tensor_scale_ref's contract and bits (x bf16/fp16/fp32 [M, K], contiguous, K even -> float32
    0-d): the finite amax in one Triton pass (an int32 atomic max of float32 bits), then rule 1's
    division (div_rn) and floor in a one-program kernel: no host sync, and one read of x where the
    reference's abs/isfinite/where/amax chain makes several."""
    amax = torch.zeros(1, dtype=torch.int32, device=x.device)
    if x.numel():
        words, mode = pair_view(x)
        words = words.view(-1)
        _finite_amax_kernel[(triton.cdiv(words.numel(), block),)](words, amax, words.numel(), IN_DTYPE=mode,
                                                                  BLOCK=block, num_warps=num_warps)
    return _tensor_scale_of_amax(amax)


def _tensor_scale_of_amax(amax: torch.Tensor) -> torch.Tensor:
    s_t = torch.empty((), dtype=torch.float32, device=amax.device)
    _tensor_scale_kernel[(1,)](amax, s_t, DIVISOR=NVFP4_TENSOR_DIVISOR, FLOOR=NVFP4_TENSOR_SCALE_MIN)
    return s_t


def nvfp4_tensor_scale_from_fp8(data: torch.Tensor, scale: torch.Tensor, block_m: int = 8, tiles: int = 8,
                                num_warps: int = 4) -> torch.Tensor:
    """nvfp4_tensor_scale_from_fp8_ref's contract and bits (data float8_e4m3fn [M, K], scale float32
    [M, K/128], K % 128 == 0 -> float32 0-d): the finite amax of the values in one pass over the codes."""
    m, k = data.shape
    amax = torch.zeros(1, dtype=torch.int32, device=data.device)
    if m and k:
        nt = k // 128
        tiles = min(tiles, triton.next_power_of_2(nt))
        words = words_view(data if data.stride(1) == 1 else data.contiguous(), torch.int16)
        _fp8_finite_amax_kernel[row_column_grid(triton.cdiv(m, block_m), triton.cdiv(nt, tiles))](
            words, scale, amax, m, nt, words.stride(0), scale.stride(0), scale.stride(1), BLOCK_M=block_m,
            TILES=tiles, num_warps=num_warps)
    return _tensor_scale_of_amax(amax)


def _launch_quantize(words, mode, tile_scale, m: int, k: int, s_t, rounding, seed, step, rank, out, block_m,
                     block_k, num_warps):
    if out is None:
        data = torch.empty(m, k // 2, dtype=torch.uint8, device=words.device)
        scale = torch.empty(m, k // NVFP4_BLOCK, dtype=torch.uint8, device=words.device)
    else:   # written in place: the kernel takes row strides
        data, scale = check_row_views(out, m, k // 2, k // NVFP4_BLOCK, torch.uint8, torch.uint8)
    if m and k:
        block_k = min(block_k, triton.next_power_of_2(k))
        grid = row_column_grid(triton.cdiv(m, block_m), triton.cdiv(k, block_k))
        ts = words if tile_scale is None else tile_scale
        _quantize_nvfp4_kernel[grid](
            words, ts, data, scale, s_t.reshape(1), m, k // NVFP4_BLOCK, words.stride(0),
            0 if tile_scale is None else ts.stride(0), 0 if tile_scale is None else ts.stride(1), data.stride(0),
            scale.stride(0), seed, u32_as_i32(step), u32_as_i32(rank), IN_DTYPE=mode,
            STOCHASTIC=Rounding(rounding) is Rounding.STOCHASTIC, BLOCK_M=block_m, BLOCK_K=block_k,
            num_warps=num_warps)
    return data, scale if out is not None else scale.view(torch.float8_e4m3fn), s_t


def quantize_nvfp4(x: torch.Tensor, tensor_scale: torch.Tensor | None = None,
                   rounding: Rounding = Rounding.NEAREST, seed: int = 0, step: int = 0, rank: int = 0,
                   out=None, block_m: int = 4, block_k: int = 512, num_warps: int = 4):
    """quantize_nvfp4_ref's contract and bytes (x bf16/fp16/fp32 [M, K], K % 16 == 0 -> (data uint8
    [M, K/2], scale float8_e4m3fn [M, K/16], tensor_scale float32 0-d)), the blocks in one Triton pass;
    the tensor scale (rule 1) from nvfp4_tensor_scale when not given."""
    m, k = x.shape
    x = x.contiguous()
    s_t = nvfp4_tensor_scale(x) if tensor_scale is None else tensor_scale.to(torch.float32).reshape(())
    words, mode = pair_view(x) if m and k else (x, None)
    return _launch_quantize(words, mode, None, m, k, s_t, rounding, seed, step, rank, out, block_m, block_k,
                            num_warps)


def quantize_nvfp4_from_fp8(data: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None = None,
                            rounding: Rounding = Rounding.NEAREST, seed: int = 0, step: int = 0, rank: int = 0,
                            out=None, block_m: int = 4, block_k: int = 512, num_warps: int = 4):
    """quantize_nvfp4_from_fp8_ref's contract and bytes (rule 5): the FP8 codes read once per pass (the
    tensor scale's, when not given, and the blocks'), no float tensor formed."""
    m, k = data.shape
    s_t = nvfp4_tensor_scale_from_fp8(data, scale) if tensor_scale is None \
        else tensor_scale.to(torch.float32).reshape(())
    words = words_view(data if data.stride(1) == 1 else data.contiguous(), torch.int16) if m and k else data
    return _launch_quantize(words, tl_dtype(torch.float8_e4m3fn), scale, m, k, s_t, rounding, seed, step, rank, out,
                            block_m, block_k, num_warps)


def nvfp4_to_fp8_rowwise(data: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor, block_m: int = 4,
                         tiles: int = 4, num_warps: int = 4, asm: bool | None = None):
    """nvfp4_to_fp8_rowwise_ref's contract and bytes (rule 6): data uint8 [M, K/2], scale float8_e4m3fn
    or uint8 [M, K/16] (rows may be strided, e.g. a wire buffer's views), tensor_scale float32 0-d or
    [M], K % 128 == 0 -> (data float8_e4m3fn [M, K], scale float32 [M, K/128] M-major), one pass. asm as
    in fp8.quantize_fp8_rowwise (the PTX E4M3 rounding on sm_90+)."""
    m, half_k = data.shape
    k = 2 * half_k
    out = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=data.device)
    oscale = empty_m_major(m, k // 128, data.device)
    if m and k:
        nt = k // 128
        tiles = min(tiles, triton.next_power_of_2(nt))
        data = data if data.stride(1) == 1 else data.contiguous()
        scale = scale if scale.stride(1) == 1 else scale.contiguous()
        s_t = tensor_scale.to(torch.float32).reshape(-1).contiguous()
        ow = out.view(torch.int16)
        _nvfp4_to_fp8_kernel[row_column_grid(triton.cdiv(m, block_m), triton.cdiv(nt, tiles))](
            data, scale.view(torch.uint8), s_t, ow, oscale, m, nt, data.stride(0), scale.stride(0), ow.stride(0),
            1 if tensor_scale.dim() else 0, BLOCK_M=block_m, TILES=tiles,
            ASM=use_asm(data) if asm is None else asm, num_warps=num_warps)
    return out, oscale


def nvfp4_to_fp8_colwise(data: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor, nb: int = 4,
                         num_warps: int = 4):
    """nvfp4_to_fp8_colwise_ref's contract and bytes: data uint8 [M, K/2], scale float8_e4m3fn or uint8
    [M, K/16], tensor_scale float32 0-d or [M] (any M) -> (data float8_e4m3fn [K, M], scale float32
    [K, ceil(M/128)] M-major), one pass; nb: NVFP4 blocks of columns per program (a power of two)."""
    m, half_k = data.shape
    k = 2 * half_k
    kb = k // NVFP4_BLOCK
    out = torch.empty(k, m, dtype=torch.float8_e4m3fn, device=data.device)
    nt = triton.cdiv(m, 128)
    oscale = empty_m_major(k, nt, data.device)
    if m and k:
        data = data if data.stride(1) == 1 else data.contiguous()
        sc = scale.view(torch.uint8)
        sc = sc if sc.stride(1) == 1 else sc.contiguous()
        s_t = tensor_scale.to(torch.float32).reshape(-1).contiguous()
        nb = min(nb, triton.next_power_of_2(kb))
        _nvfp4_to_fp8_colwise_kernel[(nt, triton.cdiv(kb, nb))](
            data, sc, s_t, out.view(torch.uint8), oscale, m, k, kb, data.stride(0), sc.stride(0),
            1 if tensor_scale.dim() else 0, NB=nb, num_warps=num_warps)
    return out, oscale


def dequantize_nvfp4(data: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor, dtype: torch.dtype,
                     block_m: int = 4, block_k: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """dequantize_nvfp4_ref's contract and bits: data uint8 [M, K/2], scale float8_e4m3fn [M, K/16],
    tensor_scale float32 0-d or [M] (per row) -> dtype [M, K] (bf16, fp16 or fp32)."""
    m, half_k = data.shape
    k = 2 * half_k
    out = torch.empty(m, k, dtype=dtype, device=data.device)
    if m and k:
        s_t = tensor_scale.to(torch.float32).reshape(-1).contiguous()
        block_k = min(block_k, triton.next_power_of_2(k))
        words, mode = pair_view(out)
        grid = row_column_grid(triton.cdiv(m, block_m), triton.cdiv(k, block_k))
        _dequantize_nvfp4_kernel[grid](
            data, scale.view(torch.uint8), s_t, words, m, k // NVFP4_BLOCK,
            data.stride(0), scale.stride(0), words.stride(0), 1 if tensor_scale.dim() else 0, OUT_DTYPE=mode,
            BLOCK_M=block_m, BLOCK_K=block_k, num_warps=num_warps)
    return out
