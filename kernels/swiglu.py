"""Fused, router-weighted SwiGLU of the grouped expert MLP: Triton kernels, launchers, and pure-torch
references.

Forward (``swiglu_quantize``): h = [gate | up] (bf16 [M, 2F]) and a per-row router weight w give
    a = bf16(silu(g) * u * w),   silu(g) = g * sigmoid(g),   in float32 from the upcast g, u,
and from one read of h the kernel writes the FP8 1x128 row-wise quantization of that bf16 ``a`` (the
fc2 GEMM operand), optionally its MXFP4 quantization, the MXFP4 quantization of h itself (the saved
SwiGLU input) and ``a`` in bf16. ``a`` is rounded to bf16 in registers and quantized from those bits,
so each quantized output is bit-identical to the reference quantizer applied to the kernel's own
bf16 ``a`` (and to h): the quantizers are composed of the device functions of triton_numerics.py.

Backward (``swiglu_backward``): with s = sigmoid(g), in float32,
    dgate = da * w * u * s * (1 + g * (1 - s)),   dup = da * w * silu(g),
    dh = bf16([dgate | dup]),   dw = sum over the F columns of da * silu(g) * u.
h may arrive as fp4 keeps it, MXFP4 codes and scales (``h_scale=``): decoded exactly in registers, so
dh is the bf16 kernel's on ``dequantize_mxfp4(h)`` without that bf16 copy being written and read.

Each launcher ``name`` has a twin ``name_ref`` with the same signature, in torch, doing the same
float32 operations in the same order. Only the exponential differs between them (``tl.sigmoid``,
an approximate exp on sm_90, vs ``torch.sigmoid``): the bf16 results may differ by one bf16 ulp in
rare elements (SWIGLU_MAX_ULP), and dw by that plus float32 summation order (SWIGLU_DW_RTOL).
NaN results are the canonical bf16 NaN 0x7FC0 in both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_fp4.kernels.fp8 import empty_m_major, quantize_fp8_rowwise_ref
from moe_fp4.kernels.mxfp4 import dequantize_mxfp4_ref, quantize_mxfp4_rowwise_ref
from moe_fp4.kernels.numerics import FP8_TILE, MXFP4_BLOCK, with_canonical_nan
from moe_fp4.kernels.triton_numerics import (
    bf16_pair_bits,
    bf16_pair_word,
    bf16_rne_bits,
    fp8_encode_tiles,
    load_pairs_as_f32_bits,
    mx_encode_bf16_pairs,
    mxfp4_bytes_to_f32_bits,
    row_column_grid,
    tile_program,
    use_asm,
    words_view,
)

# Largest distance, in bf16 ulps, between a kernel's bf16 output (a, dh) and its reference's.
# Measured 1 (never more) on CPU (interpreter, numpy exp) and on an H100 (Triton 3.6), over the
# tests' inputs (every bf16 gate value included) and 4096 x 2048 normal data, where about 1 element
# in 10^5 differs. Bound: on sm_90 tl.exp is ex2.approx(x * log2(e)), whose relative error reaches
# ~4e-6 for |x| near 88 (the rounding of x * log2(e) near 128, and of log2(e) itself); the
# cancellation in 1 + g * (1 - s) amplifies an error of s at most ~80x (worst bf16 g = -1.28125,
# where |g| is small and exp is accurate). Both stay far below half a bf16 ulp (2^-9), so only a
# rounding boundary between the two float32 values shows, as 1 ulp.
SWIGLU_MAX_ULP = 1
# |dw - dw_ref| <= SWIGLU_DW_RTOL * sum_j |da * silu * u|. Measured worst ratios: 6e-8 on CPU
# (summation order only) and 9e-7 on an H100 (rows whose gates are all near -88 with |up| ~ 1e30:
# every term carries ex2.approx's error in sigmoid). Bound: that ~4e-6 per term plus float32
# summation in another order (a tree per column chunk here, torch's reduction there).
SWIGLU_DW_RTOL = 1e-5


def _check_inputs(name: str, h: torch.Tensor, w, da=None, contiguous: bool = True) -> int:
    """Validate the SwiGLU operands of launcher / reference ``name`` -> F."""
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        raise ValueError(f"{name}: h must be a 2-D tensor [M, 2F], got {getattr(h, 'shape', type(h))}")
    if h.dtype != torch.bfloat16:
        raise TypeError(f"{name}: h must be bfloat16, got {h.dtype}")
    m, two_f = h.shape
    if two_f % (2 * FP8_TILE):
        raise ValueError(f"{name}: h must be [M, 2F] with F a multiple of {FP8_TILE}, got {tuple(h.shape)}")
    if contiguous and not h.is_contiguous():
        raise ValueError(f"{name}: h must be contiguous, got strides {h.stride()}")
    f = two_f // 2
    _check_w_da(name, m, f, h.device, w, da, contiguous)
    return f


def _check_w_da(name: str, m: int, f: int, device, w, da, contiguous: bool) -> None:
    """The router weights w (float32 [M] or None) and the gradient da (bf16 [M, F] or None) of an h on device."""
    if w is not None:
        if not isinstance(w, torch.Tensor) or w.dtype != torch.float32:
            raise TypeError(f"{name}: w must be a float32 tensor [M] or None, got {getattr(w, 'dtype', type(w))}")
        if w.shape != (m,):
            raise ValueError(f"{name}: w must be [M] = [{m}], got {tuple(w.shape)}")
        if w.device != device:
            raise ValueError(f"{name}: w is on {w.device}, h on {device}")
    if da is not None:
        if not isinstance(da, torch.Tensor) or da.dtype != torch.bfloat16:
            raise TypeError(f"{name}: da must be a bfloat16 tensor [M, F], got {getattr(da, 'dtype', type(da))}")
        if da.shape != (m, f):
            raise ValueError(f"{name}: da must be [M, F] = {(m, f)}, got {tuple(da.shape)}")
        if contiguous and not da.is_contiguous():
            raise ValueError(f"{name}: da must be contiguous, got strides {da.stride()}")
        if da.device != device:
            raise ValueError(f"{name}: da is on {da.device}, h on {device}")


def _check_backward_inputs(name: str, h: torch.Tensor, w, da, h_scale, contiguous: bool = True) -> int:
    """Validate the backward's operands, h bf16 [M, 2F] or (with h_scale) MXFP4 codes uint8 [M, F] and
    E8M0 scales uint8 [M, 2F/32] -> F."""
    if h_scale is None:
        return _check_inputs(name, h, w, da, contiguous)
    if not isinstance(h, torch.Tensor) or h.dtype != torch.uint8 or h.dim() != 2:
        raise TypeError(f"{name}: with h_scale, h must be the MXFP4 codes, uint8 [M, F], got "
                        f"{getattr(h, 'dtype', type(h))} {tuple(getattr(h, 'shape', ()))}")
    m, f = h.shape
    if f % FP8_TILE:
        raise ValueError(f"{name}: h must be [M, F] MXFP4 codes with F a multiple of {FP8_TILE}, got {tuple(h.shape)}")
    if not isinstance(h_scale, torch.Tensor) or h_scale.dtype != torch.uint8 or \
            tuple(h_scale.shape) != (m, 2 * f // MXFP4_BLOCK):
        raise ValueError(f"{name}: h_scale must be uint8 [M, 2F/{MXFP4_BLOCK}] = [{m}, {2 * f // MXFP4_BLOCK}], got "
                         f"{getattr(h_scale, 'dtype', type(h_scale))} {tuple(getattr(h_scale, 'shape', ()))}")
    if h_scale.device != h.device:
        raise ValueError(f"{name}: h_scale is on {h_scale.device}, h on {h.device}")
    if contiguous and not (h.is_contiguous() and h_scale.is_contiguous()):
        raise ValueError(f"{name}: h and h_scale must be contiguous, got strides {h.stride()}, {h_scale.stride()}")
    _check_w_da(name, m, f, h.device, w, da, contiguous)
    return f


def _to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 [...] -> bf16 [...] (RNE), NaN as the canonical 0x7FC0."""
    return with_canonical_nan(x.to(torch.bfloat16), torch.isnan(x))


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------

def swiglu_ref(h: torch.Tensor, w=None) -> torch.Tensor:
    """h: bf16 [M, 2F] = [gate | up], w: float32 [M] or None -> a: bf16 [M, F] = bf16(g * sigmoid(g)
    * u * w), multiplied left to right in float32 (w None: no multiply); NaN as 0x7FC0."""
    g, u = h.float().chunk(2, dim=-1)
    a = g * torch.sigmoid(g) * u
    if w is not None:
        a = a * w[:, None]
    return _to_bf16(a)


def swiglu_quantize_ref(h: torch.Tensor, w, write_h_mxfp4: bool, write_a_mxfp4: bool, write_a: bool = False):
    """h: bf16 [M, 2F] = [gate | up] (F % 128 == 0), w: float32 [M] or None
    -> ((data float8_e4m3fn [M, F], scale float32 [M, F/128] M-major),
        (data uint8 [M, F/2], scale uint8 [M, F/32]) or None,
        (data uint8 [M, F], scale uint8 [M, 2F/32]) or None,
        a bf16 [M, F] or None).

    a = swiglu_ref(h, w); the outputs are quantize_fp8_rowwise_ref(a), quantize_mxfp4_rowwise_ref(a)
    if write_a_mxfp4, quantize_mxfp4_rowwise_ref(h) if write_h_mxfp4, and a if write_a.
    """
    _check_inputs("swiglu_quantize_ref", h, w, contiguous=False)
    a = swiglu_ref(h, w)
    return (quantize_fp8_rowwise_ref(a),
            quantize_mxfp4_rowwise_ref(a) if write_a_mxfp4 else None,
            quantize_mxfp4_rowwise_ref(h) if write_h_mxfp4 else None,
            a if write_a else None)


def swiglu_backward_ref(h: torch.Tensor, da: torch.Tensor, w, h_scale: torch.Tensor | None = None):
    """h: bf16 [M, 2F] = [gate | up], or with h_scale the MXFP4 codes of [gate | up], uint8 [M, F], and
    their E8M0 scales uint8 [M, 2F/32] (h = dequantize_mxfp4_ref(h, h_scale, bf16)); da: bf16 [M, F];
    w: float32 [M] or None -> (dh bf16 [M, 2F], dw float32 [M] or None when w is None).

    In float32, left to right: s = sigmoid(g), silu = g * s, dgate = da * w * u * s * (1 + g * (1 - s)),
    dup = da * w * silu (w None: no multiply), dh = bf16([dgate | dup]) (NaN as 0x7FC0),
    dw = sum_j da * silu * u.
    """
    _check_backward_inputs("swiglu_backward_ref", h, w, da, h_scale, contiguous=False)
    if h_scale is not None:
        h = dequantize_mxfp4_ref(h, h_scale, torch.bfloat16)
    g, u = h.float().chunk(2, dim=-1)
    d = da.float()
    s = torch.sigmoid(g)
    silu = g * s
    dw_ = d if w is None else d * w[:, None]
    dgate = dw_ * u * s * (1 + g * (1 - s))
    dup = dw_ * silu
    dh = _to_bf16(torch.cat([dgate, dup], dim=1))
    return dh, (None if w is None else (d * silu * u).sum(dim=1))


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _swiglu_bits(g_bits, u_bits, w, HAS_W: tl.constexpr):
    """int32 fp32 bits of g, u; float32 w (broadcastable) -> int32 fp32 bits of bf16(g * sigmoid(g) * u * w)."""
    g = g_bits.to(tl.float32, bitcast=True)
    a = g * tl.sigmoid(g) * u_bits.to(tl.float32, bitcast=True)
    if HAS_W:
        a = a * w
    return bf16_rne_bits(a)


@triton.jit
def _swiglu_quantize_kernel(h_ptr, w_ptr, fp8_ptr, fscale_ptr, amx_ptr, amxs_ptr, hmx_ptr, hmxs_ptr, a_ptr,
                            M, NT, stride_w,
                            HAS_W: tl.constexpr, WRITE_H_MX: tl.constexpr, WRITE_A_MX: tl.constexpr,
                            WRITE_A: tl.constexpr, BLOCK_M: tl.constexpr, TILES: tl.constexpr,
                            ASM: tl.constexpr):
    # A program covers [BLOCK_M rows, TILES tiles of 128 columns of a] as [BM, TILES, 4, 16] pair
    # words, and reads the same columns of gate and up. F = 128 NT columns = 64 NT pair words; every
    # tensor is contiguous, so the row strides are multiples of NT (h, h_mx: 128 NT pair words/bytes;
    # a, FP8, a_mx: 64 NT; scales: 4 NT and 8 NT blocks).
    rows, t, mask_t, mask3, mask4, pair = tile_program(M, NT, BLOCK_M, TILES, True)
    HALF = NT * 64
    r4 = rows[:, None, None, None]
    h_off = r4 * (2 * HALF) + pair
    g_w = tl.load(h_ptr + h_off, mask=mask4, other=0)            # bf16 pair words, kept for h's MXFP4
    u_w = tl.load(h_ptr + h_off + HALF, mask=mask4, other=0)
    g_lo, g_hi = bf16_pair_bits(g_w)
    u_lo, u_hi = bf16_pair_bits(u_w)
    w = 1.0
    if HAS_W:
        w = tl.load(w_ptr + rows * stride_w, mask=rows < M, other=1.0)[:, None, None, None]
    a_lo = _swiglu_bits(g_lo, u_lo, w, HAS_W)
    a_hi = _swiglu_bits(g_hi, u_hi, w, HAS_W)

    a_off = r4 * HALF + pair
    word, scale = fp8_encode_tiles(a_lo, a_hi, ASM)
    tl.store(fp8_ptr + a_off, word, mask=mask4)
    tl.store(fscale_ptr + t[None, :].to(tl.int64) * M + rows[:, None], scale, mask=mask_t)  # M-major
    blk = (t * 4)[None, :, None] + tl.arange(0, 4)[None, None, :]                            # [1, TILES, 4]
    # a as bf16 pair words (bf16 of element 2i is the top half of a_lo -> low half of the word): the
    # MXFP4 encodes below work on bf16 pair words, two elements per operation (mx_encode_bf16_pairs).
    a_w = bf16_pair_word(a_lo, a_hi)
    if WRITE_A_MX:
        packed, sc = mx_encode_bf16_pairs(a_w, 3, ASM)
        tl.store(amx_ptr + a_off, packed.to(tl.uint8), mask=mask4)
        tl.store(amxs_ptr + rows[:, None, None] * (4 * NT) + blk, sc.to(tl.uint8), mask=mask3)
    if WRITE_H_MX:
        packed, sc = mx_encode_bf16_pairs(g_w, 3, ASM)
        tl.store(hmx_ptr + h_off, packed.to(tl.uint8), mask=mask4)
        tl.store(hmxs_ptr + rows[:, None, None] * (8 * NT) + blk, sc.to(tl.uint8), mask=mask3)
        packed, sc = mx_encode_bf16_pairs(u_w, 3, ASM)
        tl.store(hmx_ptr + h_off + HALF, packed.to(tl.uint8), mask=mask4)
        tl.store(hmxs_ptr + rows[:, None, None] * (8 * NT) + 4 * NT + blk, sc.to(tl.uint8), mask=mask3)
    if WRITE_A:
        tl.store(a_ptr + a_off, a_w, mask=mask4)


@triton.jit
def _swiglu_grad(g_bits, u_bits, d_bits, w, HAS_W: tl.constexpr):
    """int32 fp32 bits of g, u, da; float32 w -> (dgate bits, dup bits) of bf16, and da * silu * u float32."""
    g = g_bits.to(tl.float32, bitcast=True)
    u = u_bits.to(tl.float32, bitcast=True)
    d = d_bits.to(tl.float32, bitcast=True)
    s = tl.sigmoid(g)
    silu = g * s
    dwd = d
    if HAS_W:
        dwd = d * w
    dgate = dwd * u * s * (1 + g * (1 - s))
    dup = dwd * silu
    return bf16_rne_bits(dgate), bf16_rne_bits(dup), d * silu * u


@triton.jit
def _swiglu_backward_kernel(h_ptr, da_ptr, w_ptr, dh_ptr, dw_ptr, M, NT, stride_w,
                            HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    # A program owns BLOCK_M whole rows and walks their F columns in BLOCK_W pair words, so dw is a
    # plain register sum (no atomics, deterministic). h, dh: 128 NT pair words a row; da: 64 NT.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    rmask = rows < M
    HALF = NT * 64
    w = 1.0
    if HAS_W:
        w = tl.load(w_ptr + rows * stride_w, mask=rmask, other=1.0)[:, None]
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, HALF, BLOCK_W):
        c = c0 + tl.arange(0, BLOCK_W)
        mask = rmask[:, None] & (c < HALF)[None, :]
        h_off = rows[:, None] * (2 * HALF) + c[None, :]
        g_lo, g_hi = load_pairs_as_f32_bits(h_ptr, h_off, mask, tl.bfloat16)
        u_lo, u_hi = load_pairs_as_f32_bits(h_ptr, h_off + HALF, mask, tl.bfloat16)
        d_lo, d_hi = load_pairs_as_f32_bits(da_ptr, rows[:, None] * HALF + c[None, :], mask, tl.bfloat16)
        dg_lo, du_lo, t_lo = _swiglu_grad(g_lo, u_lo, d_lo, w, HAS_W)
        dg_hi, du_hi, t_hi = _swiglu_grad(g_hi, u_hi, d_hi, w, HAS_W)
        tl.store(dh_ptr + h_off, bf16_pair_word(dg_lo, dg_hi), mask=mask)
        tl.store(dh_ptr + h_off + HALF, bf16_pair_word(du_lo, du_hi), mask=mask)
        if HAS_W:
            acc += tl.sum(t_lo + t_hi, axis=1)  # masked lanes load zeros: their terms are 0
    if HAS_W:
        tl.store(dw_ptr + rows, acc, mask=rmask)


@triton.jit
def _swiglu_backward_mxfp4_kernel(h_ptr, hs_ptr, da_ptr, w_ptr, dh_ptr, dw_ptr, M, NT, stride_w,
                                  HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    # _swiglu_backward_kernel with h as fp4 keeps it: MXFP4 codes [M, 2F / 2] (one byte = one pair)
    # and E8M0 scales [M, 2F/32], decoded in registers. A chunk is [BLOCK_M, BLOCK_W / 16 blocks, 16
    # pairs]: each scale byte is loaded once for its 16 pairs (a per-pair load makes the kernel
    # instruction-bound, slower than dequantizing first). Each code is decoded exactly and saturated
    # (mxfp4_bytes_to_f32_bits: the bits of dequantize_mxfp4(h, bf16)), so dh equals swiglu_backward's
    # on that tensor. The two-codes-at-once fast path of the MXFP4 -> bf16 kernel needs every scale
    # byte in [2, 252], a check that would cost a host sync (or a per-chunk block-wide reduction) for
    # a few instructions a chunk.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    rmask = rows < M
    HALF = NT * 64                                       # pairs (bytes of codes) of F
    NB: tl.constexpr = BLOCK_W // 16
    r3 = rows[:, None, None]
    w = 1.0
    if HAS_W:
        w = tl.load(w_ptr + rows * stride_w, mask=rmask, other=1.0)[:, None, None]
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, HALF, BLOCK_W):
        blk = c0 // 16 + tl.arange(0, NB)[None, :, None]                                 # [1, NB, 1]
        c = blk * 16 + tl.arange(0, 16)[None, None, :]                                   # [1, NB, 16] pairs
        mask = rmask[:, None, None] & (c < HALF)
        smask = rmask[:, None, None] & (blk < HALF // 16)
        off = r3 * (2 * HALF) + c
        s_off = r3 * (HALF // 8) + blk
        g_lo, g_hi = _mxfp4_pairs(h_ptr, hs_ptr, off, s_off, mask, smask)
        u_lo, u_hi = _mxfp4_pairs(h_ptr, hs_ptr, off + HALF, s_off + HALF // 16, mask, smask)
        d_lo, d_hi = load_pairs_as_f32_bits(da_ptr, r3 * HALF + c, mask, tl.bfloat16)
        dg_lo, du_lo, t_lo = _swiglu_grad(g_lo, u_lo, d_lo, w, HAS_W)
        dg_hi, du_hi, t_hi = _swiglu_grad(g_hi, u_hi, d_hi, w, HAS_W)
        tl.store(dh_ptr + off, bf16_pair_word(dg_lo, dg_hi), mask=mask)
        tl.store(dh_ptr + off + HALF, bf16_pair_word(du_lo, du_hi), mask=mask)
        if HAS_W:
            acc += tl.sum(tl.sum(t_lo + t_hi, axis=2), axis=1)   # masked lanes decode zeros: terms 0
    if HAS_W:
        tl.store(dw_ptr + rows, acc, mask=rmask)


@triton.jit
def _mxfp4_pairs(h_ptr, hs_ptr, off, s_off, mask, smask):
    """-> (lo, hi) int32 fp32 bits of the MXFP4 pairs at byte offsets ``off`` [BM, NB, 16] whose block
    scales are at ``s_off`` [BM, NB, 1]: exact, the bits of dequantize_mxfp4 in bf16 (zeros where masked)."""
    b = tl.load(h_ptr + off, mask=mask, other=0).to(tl.int32)
    sb = tl.load(hs_ptr + s_off, mask=smask, other=127).to(tl.int32)
    return mxfp4_bytes_to_f32_bits(b, sb)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

# swiglu_quantize's (block_m, tiles, num_warps) by whether it writes h's MXFP4 (fp4's output set: 4 outputs):
# the fastest configurations of bench/swiglu.py --fwd on the H100 at 32768 x F 2048 (bench/RESULTS.md).
_SWIGLU_FWD_CONFIG = {True: (4, 2, 2), False: (8, 1, 2)}


def swiglu_quantize(h: torch.Tensor, w, write_h_mxfp4: bool, write_a_mxfp4: bool, write_a: bool = False,
                    block_m: int | None = None, tiles: int | None = None, num_warps: int | None = None,
                    asm: bool | None = None):
    """h: bf16 [M, 2F] = [gate | up] contiguous (F % 128 == 0), w: float32 [M] or None
    -> ((data float8_e4m3fn [M, F], scale float32 [M, F/128] M-major),
        (data uint8 [M, F/2], scale uint8 [M, F/32]) or None,
        (data uint8 [M, F], scale uint8 [M, 2F/32]) or None,
        a bf16 [M, F] or None), from one read of h in one launch.

    a = bf16(g * sigmoid(g) * u * w) in float32 (within SWIGLU_MAX_ULP of the reference's); the FP8 and
    a-MXFP4 outputs are bit-identical to quantize_fp8_rowwise_ref / quantize_mxfp4_rowwise_ref of
    this kernel's own a, the h-MXFP4 output to quantize_mxfp4_rowwise_ref(h). asm: None = the FP8
    encode's PTX rounding and the MXFP4 encodes' max.u16x2 / fma.rn.bf16x2 (mx_encode_bf16_pairs) on
    sm_90+ outside the interpreter (use_asm), True / False to force them or their pure-Triton twins.
    block_m, tiles, num_warps: None = _SWIGLU_FWD_CONFIG for the output set.
    """
    f = _check_inputs("swiglu_quantize", h, w)
    cfg = _SWIGLU_FWD_CONFIG[bool(write_h_mxfp4)]
    block_m, tiles, num_warps = (cfg[0] if block_m is None else block_m, cfg[1] if tiles is None else tiles,
                                 cfg[2] if num_warps is None else num_warps)
    m = h.shape[0]
    dev = h.device
    fp8 = torch.empty(m, f, dtype=torch.float8_e4m3fn, device=dev)
    fscale = empty_m_major(m, f // FP8_TILE, dev)
    amx = torch.empty(m, f // 2, dtype=torch.uint8, device=dev) if write_a_mxfp4 else None
    amxs = torch.empty(m, f // MXFP4_BLOCK, dtype=torch.uint8, device=dev) if write_a_mxfp4 else None
    hmx = torch.empty(m, f, dtype=torch.uint8, device=dev) if write_h_mxfp4 else None
    hmxs = torch.empty(m, 2 * f // MXFP4_BLOCK, dtype=torch.uint8, device=dev) if write_h_mxfp4 else None
    a = torch.empty(m, f, dtype=torch.bfloat16, device=dev) if write_a else None
    if m and f:
        nt = f // FP8_TILE
        tiles = min(tiles, triton.next_power_of_2(nt))
        fw = fp8.view(torch.int16)
        grid = row_column_grid(triton.cdiv(m, block_m), triton.cdiv(nt, tiles), rows_fastest=True)
        _swiglu_quantize_kernel[grid](
            words_view(h, torch.int32), fscale if w is None else w, fw, fscale,
            fw if amx is None else amx, fw if amxs is None else amxs,
            fw if hmx is None else hmx, fw if hmxs is None else hmxs,
            fw if a is None else a.view(torch.int32),
            m, nt, 0 if w is None else w.stride(0),
            HAS_W=w is not None, WRITE_H_MX=write_h_mxfp4, WRITE_A_MX=write_a_mxfp4, WRITE_A=write_a,
            BLOCK_M=block_m, TILES=tiles, ASM=use_asm(h) if asm is None else asm, num_warps=num_warps)
    return ((fp8, fscale), (amx, amxs) if write_a_mxfp4 else None, (hmx, hmxs) if write_h_mxfp4 else None, a)


def swiglu_backward(h: torch.Tensor, da: torch.Tensor, w, h_scale: torch.Tensor | None = None,
                    block_m: int = 2, block_w: int = 256, num_warps: int = 4):
    """h: bf16 [M, 2F] = [gate | up] contiguous (F % 128 == 0), or with h_scale the MXFP4 codes uint8
    [M, F] and scales uint8 [M, 2F/32] (as swiglu_quantize writes h for fp4), decoded in registers;
    da: bf16 [M, F] contiguous; w: float32 [M] or None
    -> (dh bf16 [M, 2F], dw float32 [M] or None when w is None), one launch.

    The math of swiglu_backward_ref: dh within SWIGLU_MAX_ULP bf16 ulps of it, dw within
    SWIGLU_DW_RTOL * sum_j |da * silu * u|. With MXFP4 h, dh is bit for bit this kernel's on
    dequantize_mxfp4(h, h_scale, bf16) (the decode is exact), dw its sum in the compiler's order.
    Defaults: the fastest of bench/swiglu.py's sweep on the H100 at M = 4096, F = 2048.
    """
    f = _check_backward_inputs("swiglu_backward", h, w, da, h_scale)
    m = h.shape[0]
    dh = torch.empty(m, 2 * f, dtype=torch.bfloat16, device=h.device)
    dw = None if w is None else torch.empty(m, dtype=torch.float32, device=h.device)
    if m and f:
        dhw = dh.view(torch.int32)
        da_w = words_view(da, torch.int32)
        grid = (triton.cdiv(m, block_m),)
        w_arg, dw_arg, stride_w = (dhw, dhw, 0) if w is None else (w, dw, w.stride(0))
        if h_scale is None:
            _swiglu_backward_kernel[grid](
                words_view(h, torch.int32), da_w, w_arg, dhw, dw_arg, m, f // FP8_TILE, stride_w,
                HAS_W=w is not None, BLOCK_M=block_m, BLOCK_W=block_w, num_warps=num_warps)
        else:
            _swiglu_backward_mxfp4_kernel[grid](
                h, h_scale, da_w, w_arg, dhw, dw_arg, m, f // FP8_TILE, stride_w,
                HAS_W=w is not None, BLOCK_M=block_m, BLOCK_W=block_w, num_warps=num_warps)
    return dh, dw
