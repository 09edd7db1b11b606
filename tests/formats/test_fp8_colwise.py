"""FP8 rows -> FP8 columns (fp8_to_fp8_colwise) with M % 4 == 0: the float16x2 word kernel.

Its pieces (E4M3 -> float16x2 decode, float16x2 multiply, |max|, float16x2 -> E4M3 encode) against
torch on every input that matters, the element rule (decode, two multiplies, encode) exhaustively
against the definition, and the kernel on inputs built to take each of its paths. On CPU the pieces
are the pure-Triton twins under the interpreter; the `gpu` tests assert the PTX gives the same bytes.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from helpers import make_input, same_bits

from moe_fp4.kernels import fp8 as K8
from moe_fp4.kernels import transpose as KT
from moe_fp4.kernels.numerics import encode_e4m3, exp2_int, fp8_scale_exponent
from moe_fp4.kernels.triton_numerics import (
    e4m3x4_to_f16x2,
    e4m3x4_to_f16x2_asm,
    f16x2x2_to_e4m3x4,
    f16x2x2_to_e4m3x4_asm,
    max_abs_f16x2,
    max_abs_f16x2_asm,
    mul_f16x2,
    mul_f16x2_asm,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ASMS = [False] + ([True] if DEVICE == "cuda" else [])
F16_ALL = torch.arange(1 << 16, dtype=torch.int32)          # every float16 bit pattern
# The kernel's float16 path holds when the tile's row exponents lie within this many binades of the
# largest (for tokens with a nonzero byte) and every column's exponent within G_MAX of it.
D_MAX = 21
G_MAX = 22
S_REF_MAX = 100


@triton.jit
def _probe_pieces_kernel(x_ptr, a_ptr, b_ptr, out_ptr, n, ASM: tl.constexpr, BLOCK: tl.constexpr):
    # Per row: x (four E4M3 bytes), a, b (float16x2 words) -> decode lo, decode hi, a * b,
    # max(|a|, |b|), E4M3 bytes of (a, b): five words.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    a = tl.load(a_ptr + offs, mask=mask)
    b = tl.load(b_ptr + offs, mask=mask)
    if ASM:
        lo, hi = e4m3x4_to_f16x2_asm(x)
        p = mul_f16x2_asm(a, b)
        mx = max_abs_f16x2_asm(a, b)
        e = f16x2x2_to_e4m3x4_asm(a, b)
    else:
        lo, hi = e4m3x4_to_f16x2(x)
        p = mul_f16x2(a, b)
        mx = max_abs_f16x2(a, b)
        e = f16x2x2_to_e4m3x4(a, b)
    tl.store(out_ptr + 5 * offs, lo, mask=mask)
    tl.store(out_ptr + 5 * offs + 1, hi, mask=mask)
    tl.store(out_ptr + 5 * offs + 2, p, mask=mask)
    tl.store(out_ptr + 5 * offs + 3, mx, mask=mask)
    tl.store(out_ptr + 5 * offs + 4, e, mask=mask)


def _pieces(asm: bool):
    """Rows: x with every byte value in every byte lane (then random words); a with every float16
    pattern in each half; b cycling through 0 and the powers of two the kernel multiplies by (2^-14 ..
    2^15), then random patterns for b's second half of the rows -> (x, a, b, out [N, 5])."""
    n = 1 << 16
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    lanes = (torch.arange(256)[:, None] + 64 * torch.arange(4)[None, :]) % 256
    x.view(torch.uint8).view(n, 4)[:256] = lanes.to(torch.uint8)
    perm = torch.randperm(n, generator=g).to(torch.int32)
    a = F16_ALL | (perm << 16)
    factors = torch.tensor([0] + [(e + 15) << 10 for e in range(-14, 16)], dtype=torch.int32)
    fl = factors[torch.arange(n) % len(factors)]
    fh = factors[(torch.arange(n) // len(factors)) % len(factors)]
    b = fl | (fh << 16)
    b[n // 2:] = torch.randint(-2**31, 2**31, (n // 2,), generator=g, dtype=torch.int64).to(torch.int32)
    x, a, b = x.to(DEVICE), a.to(DEVICE), b.to(DEVICE)
    out = torch.empty(n, 5, dtype=torch.int32, device=DEVICE)
    _probe_pieces_kernel[(triton.cdiv(n, 8192),)](x, a, b, out, n, ASM=asm, BLOCK=8192)
    return x.cpu(), a.cpu(), b.cpu(), out.cpu()


def _halves(w: torch.Tensor) -> torch.Tensor:
    """int32 [N] float16x2 words -> float16 [N, 2] (low half first)."""
    return w.contiguous().view(torch.float16).view(-1, 2)


def _same_or_both_nan(got: torch.Tensor, want: torch.Tensor) -> bool:
    """float16 tensors: equal bits, except that a NaN may be any NaN."""
    nan = torch.isnan(want)
    return torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.filterwarnings("ignore:invalid value encountered")   # numpy on NaN / Inf products
def test_float16x2_pieces_against_torch():
    x, a, b, out = _pieces(asm=False)
    # Decode: every E4M3 byte in every lane is its exact float16 value (torch's conversion).
    want = x.view(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16).view(-1, 4)
    got = torch.stack([_halves(out[:, 0]), _halves(out[:, 1])], 1).view(-1, 4)
    assert _same_or_both_nan(got, want)
    # Multiply: the correctly rounded float16 product (torch computes it in float32 and rounds once),
    # subnormals kept, for every pattern times every factor the kernel uses and random pairs.
    assert _same_or_both_nan(_halves(out[:, 2]), _halves(a) * _halves(b))
    # Max magnitude with NaN left out (NaN only from two NaNs).
    ha, hb = _halves(a).abs(), _halves(b).abs()
    want = torch.where(torch.isnan(ha), hb, torch.where(torch.isnan(hb), ha, torch.maximum(ha, hb)))
    assert _same_or_both_nan(_halves(out[:, 3]), want)
    # Encode: RNE to E4M3 of every float16 pattern within +-448 (the kernel's outputs), NaN -> 0x7F.
    v = torch.stack([_halves(a), _halves(b)], 1).view(-1, 4).float()
    got = out[:, 4].contiguous().view(torch.uint8).view(-1, 4)
    use = torch.isnan(v) | (v.abs() <= 448)
    assert torch.equal(got[use], encode_e4m3(v[use]).view(torch.uint8))


@pytest.mark.gpu
def test_gpu_float16x2_ptx_equals_the_twins():
    # Same bits, except NaN payloads (any NaN for any NaN) and encodes past +-448, which the kernel
    # never produces (satfinite gives 0x7E / 0xFE there and 0x7E for Inf, the twin 0x7E and 0x7F).
    x, a, b, twin = _pieces(asm=False)
    _, _, _, ptx = _pieces(asm=True)
    for j in range(4):
        assert _same_or_both_nan(_halves(ptx[:, j]), _halves(twin[:, j]))
    v = torch.stack([_halves(a), _halves(b)], 1).view(-1, 4).float()
    use = torch.isnan(v) | (v.abs() <= 448)
    assert torch.equal(ptx[:, 4].contiguous().view(torch.uint8).view(-1, 4)[use],
                       twin[:, 4].contiguous().view(torch.uint8).view(-1, 4)[use])


@triton.jit
def _probe_element_rule_kernel(x_ptr, tf_ptr, cf_ptr, out_ptr, n, ASM: tl.constexpr, BLOCK: tl.constexpr):
    # The kernel's element rule on one word of four bytes: decode, times the token factor, times the
    # column factor, encode.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tf = tl.load(tf_ptr + offs, mask=mask)
    cf = tl.load(cf_ptr + offs, mask=mask)
    if ASM:
        lo, hi = e4m3x4_to_f16x2_asm(x)
        y = f16x2x2_to_e4m3x4_asm(mul_f16x2_asm(mul_f16x2_asm(lo, tf), cf), mul_f16x2_asm(mul_f16x2_asm(hi, tf), cf))
    else:
        lo, hi = e4m3x4_to_f16x2(x)
        y = f16x2x2_to_e4m3x4(mul_f16x2(mul_f16x2(lo, tf), cf), mul_f16x2(mul_f16x2(hi, tf), cf))
    tl.store(out_ptr + offs, y, mask=mask)


def _element_rule(asm: bool):
    """Every byte q x every token distance d in [0, D_MAX] x every column distance g in [0, G_MAX]:
    bytes of (q 2^(7 - d)) 2^(g - 7) -> (q [N, 4] float32 values, g - d [N], out bytes [N, 4])."""
    d, g = torch.meshgrid(torch.arange(D_MAX + 1), torch.arange(G_MAX + 1), indexing="ij")
    d, g = d.reshape(-1, 1).expand(-1, 64).reshape(-1), g.reshape(-1, 1).expand(-1, 64).reshape(-1)
    x = torch.arange(256, dtype=torch.uint8).view(64, 4).repeat(d.numel() // 64, 1)
    tf = ((22 - d) << 10).to(torch.int32) * 0x10001
    cf = ((g + 8) << 10).to(torch.int32) * 0x10001
    xw = x.contiguous().view(torch.int32).view(-1)
    out = torch.empty_like(xw, device=DEVICE)
    n = xw.numel()
    _probe_element_rule_kernel[(triton.cdiv(n, 8192),)](xw.to(DEVICE), tf.to(DEVICE), cf.to(DEVICE), out, n,
                                                        ASM=asm, BLOCK=8192)
    return x.view(torch.float8_e4m3fn).float(), g - d, out.cpu().view(torch.uint8).view(-1, 4)


@pytest.mark.parametrize("asm", ASMS)
def test_element_rule_every_byte_at_every_token_and_column_distance(asm):
    # One rounding: the float16 steps are exact or land below 2^-21, where E4M3 gives a signed zero
    # either way. Compared where |q| 2^(g - d) <= 448: the kernel's outputs never exceed it.
    q, shift, got = _element_rule(asm)
    v = q * torch.exp2(shift.float())[:, None]
    use = torch.isnan(v) | (v.abs() <= 448)
    assert use.sum() > 0.6 * use.numel()
    assert torch.equal(got[use], encode_e4m3(v[use]).view(torch.uint8))


def _word_path(data: torch.Tensor, scale: torch.Tensor, g: int) -> torch.Tensor:
    """The word kernel's choice, from the definition: bool [tiles, K / (16 g)], True where a program
    takes the float16 path (row exponents <= S_REF_MAX and >= -126; tokens more than D_MAX binades
    under the tile's largest all zero in the program's columns; every column with a finite nonzero
    within G_MAX binades of it)."""
    m, k = data.shape
    bk = 16 * g
    q = data.cpu().view(torch.uint8).long()
    s_r = torch.frexp(scale.cpu().float())[1] - 1                          # [M, K / 128]
    v = (data.cpu().float().nan_to_num(0.0).abs() * scale.cpu().float().repeat_interleave(128, 1))
    out = torch.zeros(-(-m // 128), k // bk, dtype=torch.bool)
    for t in range(out.shape[0]):
        rows = slice(128 * t, min(m, 128 * t + 128))
        for c in range(out.shape[1]):
            cols = slice(bk * c, bk * c + bk)
            sr = s_r[rows, bk * c // 128]
            s_ref = int(sr.max())
            ok = s_ref <= S_REF_MAX and int(sr.min()) >= -126
            far = (s_ref - sr) > D_MAX
            ok = ok and not bool(((q[rows][far][:, cols] & 0x7F) != 0).any())
            amax = v[rows, cols].amax(0)
            S = fp8_scale_exponent(amax)
            ok = ok and bool(((s_ref - S <= G_MAX) | (amax == 0)).all())
            out[t, c] = ok
    return out


def _check(data, scale, **kw):
    got = KT.fp8_to_fp8_colwise(data, scale, **kw)
    want = KT.fp8_to_fp8_colwise_ref(data, scale)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    assert got[1].stride() == want[1].stride()


@pytest.mark.parametrize("asm", ASMS)
def test_word_kernel_every_byte_at_every_row_distance(asm):
    # Token t has exponent 5 - (t mod 22) (d = 0 .. 21 from the tile's largest) and the bytes
    # (c + 37 t) mod 256 over its 256 columns: every byte, NaN included, at every d and in every
    # token lane of a quad. Every program takes the float16 path.
    m, k = 256, 256
    t = torch.arange(m)[:, None]
    data = ((torch.arange(k)[None, :] + 37 * t) % 256).to(torch.uint8).view(torch.float8_e4m3fn)
    scale = exp2_int((5 - t % 22).expand(m, 2).contiguous())
    assert _word_path(data, scale, 2).all()
    _check(data.to(DEVICE), scale.to(DEVICE), asm=asm)


def _path_cases():
    """M = 260 (a partial last tile), K = 256, row exponents in [-4, 3], with program-sized edits
    (g = 2: programs of 32 columns): returns (data, scale, {(tile, program): expected path})."""
    m, k = 260, 256
    gen = torch.Generator().manual_seed(11)
    data = torch.randint(0, 256, (m, k), generator=gen, dtype=torch.uint8)
    s = torch.randint(-4, 4, (m, 2), generator=gen, dtype=torch.int32)
    want = {}
    # Tile 0, row tile 0: token 5 sits 22 binades under the top. Nonzero in columns 0-31 (general),
    # all +-0 in columns 32-63 (float16 path, its values are zeros).
    s[5, 0] = int(s[:128, 0].max()) - 22
    data[5, 32:64] = torch.tensor([0, 0x80], dtype=torch.uint8).repeat(16)
    want[(0, 0)], want[(0, 1)] = False, True
    # Tile 1, row tile 1: a column (130) whose largest value is 2^23 under the top row's full scale:
    # the top row is zero there, the others 2^-9 at 6 binades down (general). Columns 160-191: an
    # all-zero column and an all-NaN column next to ordinary ones (float16 path). Rows 250-255 are
    # padding (zero, scale 2^-126: far below, but zero).
    r = slice(128, 256)
    s[r, 1] = -6
    s[128, 1] = 0
    data[r, 128:160] = 0x01
    data[128, 128:160] = 0
    want[(1, 4)] = False
    data[r, 165] = torch.tensor([0, 0x80], dtype=torch.uint8).repeat(64)
    data[r, 170] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8).repeat(64)
    data[250:256] = 0
    s[250:256] = -126
    want[(1, 5)] = True
    # Tile 2 (4 tokens): scales 2^100 (float16 path) and 2^101 (general).
    s[256:, 0] = 100
    s[256:, 1] = 101
    want[(2, 0)], want[(2, 4)] = True, False
    return data.view(torch.float8_e4m3fn), exp2_int(s), want


@pytest.mark.parametrize("asm", ASMS)
@pytest.mark.parametrize("g,num_warps", [(1, 1), (2, 1), (4, 2), (8, 4)])
def test_word_kernel_paths_and_program_shapes(g, num_warps, asm):
    data, scale, want = _path_cases()
    path = _word_path(data, scale, 2)
    assert all(bool(path[key]) == expected for key, expected in want.items())
    assert path.any() and not path.all()
    _check(data.to(DEVICE), scale.to(DEVICE), g=g, num_warps=num_warps, asm=asm)


def test_word_kernel_rejects_a_bad_program_width():
    data, scale = K8.quantize_fp8_rowwise_ref(torch.ones(4, 128))
    with pytest.raises(ValueError, match="g must be 1, 2, 4 or 8"):
        KT.fp8_to_fp8_colwise(data, scale, g=3)


@pytest.mark.parametrize("m", [4, 100, 132])
def test_word_kernel_on_quantized_activations(m):
    x = make_input((m, 256), "outlier_channels", seed=m)
    x[m // 2:] = 0                                                     # padding rows
    data, scale = K8.quantize_fp8_rowwise_ref(x)
    assert _word_path(data, scale, 2).all()
    _check(data.to(DEVICE), scale.to(DEVICE))


@pytest.mark.gpu
def test_gpu_word_kernel_ptx_path_equals_the_twin_path_and_the_definition():
    x = make_input((8192, 7168), "outlier_channels", torch.bfloat16, seed=3, device="cuda")
    x[-100:] = 0
    real = K8.quantize_fp8_rowwise(x)
    g = torch.Generator().manual_seed(4)
    spread = (torch.randint(0, 256, (4096, 2048), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn).cuda(),
              exp2_int(torch.randint(-12, 12, (4096, 16), generator=g, dtype=torch.int32)).cuda())
    data, scale, _ = _path_cases()
    for d, s in (real, spread, (data.cuda(), scale.cuda())):
        ptx = KT.fp8_to_fp8_colwise(d, s, asm=True)
        assert same_bits(ptx[0], KT.fp8_to_fp8_colwise(d, s, asm=False)[0])
        want = KT.fp8_to_fp8_colwise_ref(d, s)
        assert same_bits(ptx[0], want[0]) and same_bits(ptx[1], want[1])
