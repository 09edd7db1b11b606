"""Row-wise FP8 1x128 producers (from BF16/FP16/FP32, fused with MXFP4, and from MXFP4) and FP8
dequantize: Triton kernels, launchers, and pure-torch references.

Each launcher ``name`` has a twin ``name_ref`` with the same signature on plain 2-D tensors;
``moe_fp4.formats._ops`` wraps them in the containers. FP8 scales come back in the M-major layout of
``FP8BlockTensor`` (strides (1, M)). A program covers [BLOCK_M rows, TILES x 128 columns] viewed as
[BLOCK_M, TILES, 4, 16] pair words: the FP8 tile amax is a max over the last two axes, the MXFP4
block amax over the last one, so one load serves both formats.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_fp4.kernels.mxfp4 import check_row_views, quantize_mxfp4_rowwise_ref, write_out
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
    to_output,
    unpack_nibbles,
)
from moe_fp4.kernels.triton_numerics import (
    bf16_pair_bits,
    fp8_encode_tiles,
    fp8_weight_block,
    load_pairs_as_f32_bits,
    mx_encode_bf16_pairs,
    mx_encode_tiles,
    mxfp4_words_to_e4m3,
    pair_view,
    pow2_f32,
    row_chunks,
    row_column_grid,
    row_column_program,
    tile_program,
    use_asm,
    words_view,
)

BLOCKS_PER_TILE = FP8_TILE // MXFP4_BLOCK
# float32 can hold 2^e exactly down to e = -149; a shift further down only multiplies E2M1 values
# (at most 6) that end up far below E4M3's smallest subnormal 2^-9 either way.
_MIN_SHIFT = -149


def empty_m_major(m: int, tiles: int, device) -> torch.Tensor:
    """-> float32 [m, tiles] with strides (1, m): the scale layout of FP8BlockTensor."""
    return torch.empty(tiles, m, dtype=torch.float32, device=device).t()


def m_major(scale: torch.Tensor) -> torch.Tensor:
    """scale: float32 [M, T] (any strides) -> the same values with strides (1, M), literally: with T = 1,
    ``scale.t().contiguous().t()`` may keep strides (1, 1), which torch 2.11's scaled_mm rejects."""
    m, t = scale.shape
    if scale.stride() == (1, m):
        return scale
    return empty_m_major(m, t, scale.device).copy_(scale)


def _repeat_tiles(t: torch.Tensor, k: int) -> torch.Tensor:
    """t: [M, ceil(K/128)] -> [M, K]: each tile's value repeated over its columns."""
    return t.repeat_interleave(FP8_TILE, dim=1)[:, :k]


def quantize_fp8_rowwise_ref(x: torch.Tensor, out=None):
    """x: bf16/fp16/fp32 [M, K] -> (data float8_e4m3fn [M, K], scale float32 [M, ceil(K/128)] M-major),
    or written into ``out`` = (data, scale) views of those shapes (data with unit column stride).

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
    return write_out(out, data, m_major(exp2_int(s)))


def quantize_fp8_and_mxfp4_ref(x: torch.Tensor):
    """x: bf16/fp16/fp32 [M, K], K % 128 == 0 -> ((data, scale) FP8 1x128, (data, scale) MXFP4):
    both quantizations of the same input, each bit-identical to its standalone twin (the Triton
    kernel reads x once and writes both)."""
    return quantize_fp8_rowwise_ref(x), quantize_mxfp4_rowwise_ref(x)


def fp8_values_ref(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """data: float8_e4m3fn [M, K], scale: float32 [M, ceil(K/128)] -> float32 [M, K] = data * scale as
    it is: exact unless the product exceeds float32's range (only possible for scales > 2^119), +-Inf
    there, NaN for the NaN byte. What the conversions from FP8 start from; a decode saturates instead
    (dequantize_fp8_ref)."""
    return data.float() * _repeat_tiles(scale, data.shape[1])


def dequantize_fp8_ref(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """data: float8_e4m3fn [M, K], scale: float32 [M, ceil(K/128)] -> dtype [M, K] = data * scale,
    rounded once to dtype (exact in float32), a value past dtype's largest finite magnitude saturated
    to it, sign kept (numerics.to_output: in float16 e.g. 255.875 * 2^8 rounds to 2^16 and gives
    65504); the NaN byte gives NaN."""
    q = data.float()
    return to_output(q * _repeat_tiles(scale, data.shape[1]), dtype, torch.isnan(q))


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


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _quantize_fp8_kernel(x_ptr, fp8_ptr, fscale_ptr, mx_ptr, mscale_ptr, M, NT,
                         stride_xm, stride_fm, stride_fsm, stride_fst, stride_mm, stride_msm,
                         IN_DTYPE: tl.constexpr, WRITE_MXFP4: tl.constexpr,
                         BLOCK_M: tl.constexpr, TILES: tl.constexpr, ASM: tl.constexpr):
    # x viewed as pair words [M, K/2]; a program covers [BLOCK_M, TILES * 128], loaded, encoded and
    # stored as [BM, TILES, 4 blocks, 16] pair words. Not the row_chunks layout reshaped to that view:
    # on sm90 with Triton 3.6 the reshape of a [BM, TILES * 8, 8] load ahead of the tile reduction gives
    # wrong tile maxima (scales a binade low) for some shapes, output strides and configs, while the
    # interpreter agrees with the reference (tests/formats/test_kernels.py
    # test_row_kernels_every_config_and_stride_gpu).
    rows, t, mask_t, mask3, mask4, pair = tile_program(M, NT, BLOCK_M, TILES)
    offs = rows[:, None, None, None] * stride_xm + pair
    if IN_DTYPE == tl.bfloat16:
        w = tl.load(x_ptr + offs, mask=mask4, other=0)
        lo, hi = bf16_pair_bits(w)                  # w itself feeds the MXFP4 half below
    else:
        lo, hi = load_pairs_as_f32_bits(x_ptr, offs, mask4, IN_DTYPE)
    word, fscale = fp8_encode_tiles(lo, hi, ASM)
    tl.store(fp8_ptr + rows[:, None, None, None] * stride_fm + pair, word, mask=mask4)
    # M-major for FP8BlockTensor (strides (1, M)); row-major inside each row of an all-to-all wire buffer.
    tl.store(fscale_ptr + t[None, :].to(tl.int64) * stride_fst + rows[:, None] * stride_fsm, fscale, mask=mask_t)
    if WRITE_MXFP4:
        # The MXFP4 byte of pair (t, b, p) is pair word t * 64 + b * 16 + p: the same offsets.
        if IN_DTYPE == tl.bfloat16:
            packed, sc = mx_encode_bf16_pairs(w, 3, ASM)
            packed = packed.to(tl.uint8)
            sc = sc.to(tl.uint8)
        else:
            packed, sc = mx_encode_tiles(lo, hi)
        tl.store(mx_ptr + rows[:, None, None, None] * stride_mm + pair, packed, mask=mask4)
        blk = (t * 4)[None, :, None] + tl.arange(0, 4)[None, None, :]
        tl.store(mscale_ptr + rows[:, None, None] * stride_msm + blk, sc, mask=mask3)


@triton.jit
def _mxfp4_to_fp8_kernel(d_ptr, s_ptr, o_ptr, os_ptr, M, NT, stride_dm, stride_sm, stride_om,
                         BLOCK_M: tl.constexpr, TILES: tl.constexpr, ASM: tl.constexpr):
    # MXFP4 codes as int16 words (4 codes each: [M, K/4]) and FP8 bytes as int32 words (4 bytes each:
    # [M, K/4]): input word i becomes output word i. A program covers [BLOCK_M, TILES * 128], loaded
    # and stored as [BM, TILES * 8 chunks, 4 words] (row_chunks) and decoded as [BM, TILES, 4 blocks,
    # 2, 4 words]: a last axis of 4 gives the int16 loads and the int32 stores the same 4 words per
    # thread, so both use one register layout (with an axis of 8 the compiler picks 8 per thread for
    # the 16-byte loads, 4 for the stores, and converts through shared memory).
    # ASM (CUDA only) decodes with two prmt per word; the pure-Triton twin gives the same bits.
    rows, t, mask_t, mask3, _mask4, _ = tile_program(M, NT, BLOCK_M, TILES)
    _rb, cb = row_column_program()
    word, mask_c = row_chunks(rows, M, cb * (TILES * 32), NT * 32, TILES * 32, 4)
    x = tl.load(d_ptr + rows[:, None, None] * stride_dm + word, mask=mask_c, other=0).to(tl.int32)
    x = tl.reshape(x, [BLOCK_M, TILES, 4, 2, 4])
    blk = (t * 4)[None, :, None] + tl.arange(0, 4)[None, None, :]                    # [1, TILES, 4]
    sb = tl.load(s_ptr + rows[:, None, None] * stride_sm + blk, mask=mask3, other=0).to(tl.int32)
    q, S = mxfp4_words_to_e4m3(x, sb, mask3, ASM)
    tl.store(o_ptr + rows[:, None, None] * stride_om + word, tl.reshape(q, [BLOCK_M, TILES * 8, 4]), mask=mask_c)
    tl.store(os_ptr + t[None, :].to(tl.int64) * M + rows[:, None], pow2_f32(S), mask=mask_t)


def _launch_quantize_fp8(x: torch.Tensor, write_mxfp4: bool, block_m: int, tiles: int, num_warps: int, out=None,
                         asm: bool | None = None):
    m, k = x.shape
    dev = x.device
    if out is None:
        fp8 = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=dev)
        fscale = empty_m_major(m, k // FP8_TILE, dev)
    else:
        fp8, fscale = check_row_views(out, m, k, k // FP8_TILE, torch.float8_e4m3fn, torch.float32)
    mx = torch.empty(m, k // 2, dtype=torch.uint8, device=dev) if write_mxfp4 else None
    ms = torch.empty(m, k // MXFP4_BLOCK, dtype=torch.uint8, device=dev) if write_mxfp4 else None
    if m and k:
        words, mode = pair_view(x.contiguous())
        nt = k // FP8_TILE
        tiles = min(tiles, triton.next_power_of_2(nt))
        fw = fp8.view(torch.int16)
        grid = row_column_grid(triton.cdiv(m, block_m), triton.cdiv(nt, tiles))
        _quantize_fp8_kernel[grid](
            words, fw, fscale, mx if write_mxfp4 else fw, ms if write_mxfp4 else fw, m, nt,
            words.stride(0), fw.stride(0), fscale.stride(0), fscale.stride(1),
            mx.stride(0) if write_mxfp4 else 0, ms.stride(0) if write_mxfp4 else 0,
            IN_DTYPE=mode, WRITE_MXFP4=write_mxfp4,
            BLOCK_M=block_m, TILES=tiles, ASM=use_asm(x) if asm is None else asm, num_warps=num_warps)
    return (fp8, fscale), (mx, ms)


def quantize_fp8_rowwise(x: torch.Tensor, out=None, block_m: int = 4, tiles: int = 8, num_warps: int = 2,
                        asm: bool | None = None):
    """x: bf16/fp16/fp32 [M, K], K % 128 == 0 -> (data float8_e4m3fn [M, K], scale float32 [M, K/128]
    M-major), or written into ``out`` = (data, scale) views of those shapes (data with unit column
    stride, scale any strides); bit-identical to quantize_fp8_rowwise_ref. asm: None = the PTX E4M3
    rounding (cvt.rn.satfinite.e4m3x2.f32) on sm_90+ outside the interpreter (use_asm), True / False
    to force it or its integer twin. Defaults (4 rows x 8 tiles on 2 warps) from the H200 sweep in
    bench/RESULTS.md, which the tile-view kernel keeps."""
    return _launch_quantize_fp8(x, False, block_m, tiles, num_warps, out, asm)[0]


def quantize_fp8_and_mxfp4(x: torch.Tensor, block_m: int = 2, tiles: int = 4, num_warps: int = 1,
                           asm: bool | None = None):
    """x: bf16/fp16/fp32 [M, K], K % 128 == 0 -> ((FP8 data, scale), (MXFP4 data, scale)) from one
    read of x; bit-identical to quantize_fp8_and_mxfp4_ref. asm as in quantize_fp8_rowwise; for BF16
    input it also selects the MXFP4 half's max.u16x2 and fma.rn.bf16x2 (mx_encode_bf16_pairs). Defaults
    (2 rows x 4 tiles on 1 warp) from the H100 sweep of the tile-view kernel in bench/RESULTS.md: 1 row
    x 8 tiles is as fast at 32768 rows but not at 65536, whose 65536 row programs spill onto a second
    grid axis."""
    return _launch_quantize_fp8(x, True, block_m, tiles, num_warps, None, asm)


def mxfp4_to_fp8_rowwise(data: torch.Tensor, scale: torch.Tensor, block_m: int = 4, tiles: int = 4,
                         num_warps: int = 2, asm: bool | None = None):
    """data uint8 [M, K/2], scale uint8 [M, K/32], K % 128 == 0 -> (data float8_e4m3fn [M, K], scale
    float32 [M, K/128] M-major); bit-identical to mxfp4_to_fp8_rowwise_ref. Defaults (4 rows x 4
    tiles on 2 warps) from the H200 sweep in bench/RESULTS.md (row_chunks layout).
    asm: None = the prmt decode on sm_90+ outside the interpreter (use_asm), True / False to force it
    or its pure-Triton twin."""
    m, half_k = data.shape
    k = 2 * half_k
    out = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=data.device)
    oscale = empty_m_major(m, k // FP8_TILE, data.device)
    if m and k:
        nt = k // FP8_TILE
        tiles = min(tiles, triton.next_power_of_2(nt))
        words = words_view(data if data.stride(1) == 1 else data.contiguous(), torch.int16)
        scale = scale if scale.stride(1) == 1 else scale.contiguous()
        ow = out.view(torch.int32)
        _mxfp4_to_fp8_kernel[row_column_grid(triton.cdiv(m, block_m), triton.cdiv(nt, tiles))](
            words, scale, ow, oscale, m, nt, words.stride(0), scale.stride(0), ow.stride(0),
            BLOCK_M=block_m, TILES=tiles, ASM=use_asm(data) if asm is None else asm, num_warps=num_warps)
    return out, oscale


# ---------------------------------------------------------------------------------------------
# Weights: 128x128 blocks (the FP8 GEMMs' B operand for fprop and dgrad).

WEIGHT_BLOCK = 128


@triton.jit
def weight_block(N, K, BLOCK: tl.constexpr):
    """This program's BLOCK x BLOCK block (bn, bk) of matrix e in an [E, N, K] stack (grid (N/BLOCK, K/BLOCK, E))
    -> (bn, bk, e, the block's int64 offsets in W [N, K], and in W^T [K, N] transposed: offs_t[c, r] is the
    element offs[r, c] moves to)."""
    bn = tl.program_id(0)
    bk = tl.program_id(1)
    e = tl.program_id(2)
    rows = bn * BLOCK + tl.arange(0, BLOCK)
    cols = bk * BLOCK + tl.arange(0, BLOCK)
    base = e.to(tl.int64) * N * K
    return (bn, bk, e, base + rows[:, None].to(tl.int64) * K + cols[None, :],
            base + cols[:, None].to(tl.int64) * N + rows[None, :])


@triton.jit
def _quantize_fp8_weight_kernel(w_ptr, q_ptr, qt_ptr, s_ptr, N, K, NB, KB,
                                WRITE_Q: tl.constexpr, WRITE_T: tl.constexpr, BLOCK: tl.constexpr,
                                ASM: tl.constexpr):
    # One program per 128x128 block (bn, bk) of matrix e: W [N, K] -> codes [N, K] and/or W^T codes [K, N].
    # ASM (CUDA only): the E4M3 rounding by PTX cvt (e4m3_rne_asm, same bytes as e4m3_rne, which is
    # about 15 integer operations per element: the kernel was instruction-bound at ~1/3 of copy speed).
    # W^T's codes are stored from the transposed tile (tl.trans, through shared memory), so that both
    # stores run along contiguous 128-byte rows.
    bn, bk, e, offs, offs_t = weight_block(N, K, BLOCK)
    q, S = fp8_weight_block(tl.load(w_ptr + offs).to(tl.float32), ASM)
    if WRITE_Q:
        tl.store(q_ptr + offs, q)
    if WRITE_T:
        tl.store(qt_ptr + offs_t, tl.trans(q))
    tl.store(s_ptr + (e * NB + bn) * KB + bk, pow2_f32(S))


def quantize_fp8_weight_128x128(w: torch.Tensor, write_q: bool = True, write_t: bool = False, num_warps: int = 16,
                                asm: bool | None = None):
    """w: bf16/fp16/fp32 [E, N, K] contiguous (N, K multiples of 128) -> (data float8_e4m3fn [E, N, K]
    or None, data_t float8_e4m3fn [E, K, N] (the codes of W^T) or None, scale float32 [E, N/128, K/128]).
    Bit-identical to quantize_fp8_weight_128x128_ref. asm: None = the PTX rounding on sm_90+ outside
    the interpreter (use_asm), True / False to force it or its pure-Triton twin. 16 warps per 128x128
    block: faster than 8 or 4 (bench/tools/weight_quant.py, bench/RESULTS.md)."""
    e, n, k = w.shape
    dev = w.device
    q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=dev) if write_q else None
    qt = torch.empty(e, k, n, dtype=torch.float8_e4m3fn, device=dev) if write_t else None
    scale = torch.empty(e, n // WEIGHT_BLOCK, k // WEIGHT_BLOCK, dtype=torch.float32, device=dev)
    if w.numel():
        dummy = scale.view(torch.uint8)
        _quantize_fp8_weight_kernel[(n // WEIGHT_BLOCK, k // WEIGHT_BLOCK, e)](
            w, q.view(torch.uint8) if write_q else dummy, qt.view(torch.uint8) if write_t else dummy, scale,
            n, k, n // WEIGHT_BLOCK, k // WEIGHT_BLOCK,
            WRITE_Q=write_q, WRITE_T=write_t, BLOCK=WEIGHT_BLOCK, ASM=use_asm(w) if asm is None else asm,
            num_warps=num_warps)
    return q, qt, scale


def quantize_fp8_weight_128x128_ref(w: torch.Tensor, write_q: bool = True, write_t: bool = False):
    """Pure-torch twin of quantize_fp8_weight_128x128: per block S = clamp(ceil(log2(amax/448)),
    -126, 127) over finite values, codes = E4M3 RNE of w / 2^S (NaN/Inf -> 0x7F)."""
    e, n, k = w.shape
    blocks = w.float().reshape(e, n // WEIGHT_BLOCK, WEIGHT_BLOCK, k // WEIGHT_BLOCK, WEIGHT_BLOCK)
    amax = blocks.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=(2, 4))
    scale = exp2_int(fp8_scale_exponent(amax))
    codes = encode_e4m3(blocks / scale[:, :, None, :, None]).reshape(e, n, k)
    return (codes if write_q else None), (codes.transpose(1, 2).contiguous() if write_t else None), scale


@triton.jit
def _transpose_fp8_weight_kernel(q_ptr, qt_ptr, N, K, BLOCK: tl.constexpr):
    # One program per 128x128 block (bn, bk) of matrix e: codes [N, K] -> codes [K, N]. The tile goes through
    # shared memory (tl.trans), so that the load and the store both run along contiguous 128-byte rows.
    _, _, _, offs, offs_t = weight_block(N, K, BLOCK)
    tl.store(qt_ptr + offs_t, tl.trans(tl.load(q_ptr + offs)))


def transpose_fp8_weight_128x128(q: torch.Tensor, num_warps: int = 8) -> torch.Tensor:
    """q: float8_e4m3fn [E, N, K] contiguous (N, K multiples of 128), a weight's codes -> float8_e4m3fn
    [E, K, N], the codes of W^T (with 128x128 blocks W^T's scales are W's transposed). A byte copy:
    bit-identical to transpose_fp8_weight_128x128_ref."""
    e, n, k = q.shape
    qt = torch.empty(e, k, n, dtype=q.dtype, device=q.device)
    if q.numel():
        _transpose_fp8_weight_kernel[(n // WEIGHT_BLOCK, k // WEIGHT_BLOCK, e)](
            q.view(torch.uint8), qt.view(torch.uint8), n, k, BLOCK=WEIGHT_BLOCK, num_warps=num_warps)
    return qt


def transpose_fp8_weight_128x128_ref(q: torch.Tensor) -> torch.Tensor:
    """Pure-torch twin of transpose_fp8_weight_128x128."""
    return q.transpose(1, 2).contiguous()
