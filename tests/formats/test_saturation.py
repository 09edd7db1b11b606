"""No finite encoded value decodes to Inf: every decode saturates at the output dtype's largest finite
magnitude (sign kept), NaN stays NaN, and kernels equal their references bit for bit at the edge.

The inputs sit at the top of each dtype's range (fp16: 57344, 61440, 65504, where RCEIL and E4M3's
rounding reach 2^16; bf16 and fp32 maxima, where MXFP4 reaches 2^128) and every format's output is
decoded to every output dtype (docs/formats.md, "Decoding: saturation at the range edge").
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from helpers import same_bits

import moe_fp4
from moe_fp4.kernels import fp8 as K8
from moe_fp4.kernels import mxfp4 as KMX
from moe_fp4.kernels import nvfp4 as N
from moe_fp4.kernels import transpose as KT
from moe_fp4.kernels.numerics import FINITE_MAX_BITS, NAN_BITS, e2m1_values, to_output, with_canonical_nan
from moe_fp4.kernels.row_sum import gather_sum_fp8, gather_sum_fp8_ref
from moe_fp4.kernels.triton_numerics import f32_to_out_bits, in_bits_to_f32_bits, tl_dtype

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIGH = [torch.bfloat16, torch.float16, torch.float32]
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}

# Per input dtype, magnitudes at the top of its range (each becomes a row's largest |x|).
EDGE = {
    torch.float16: [57344.0, 61440.0, 65504.0, 63488.0, 63456.0, 49152.0],
    torch.bfloat16: [torch.finfo(torch.bfloat16).max, 3.0 * 2.0**126, 1.5 * 2.0**127, 65504.0],
    torch.float32: [torch.finfo(torch.float32).max, 1.5 * 2.0**127, 1.75 * 2.0**127, 6.0 * 2.0**125, 65504.0],
}
# A row's values as fractions of its edge magnitude: the edge itself in both signs and values below.
_PATTERN = torch.tensor([1.0, -1.0, 0.96, -0.9, 0.5, -0.25, 0.0, 0.01])


def _edge_input(dtype: torch.dtype, k: int = 256) -> torch.Tensor:
    """dtype [2 * len(EDGE[dtype]), k]: per edge magnitude a row of the pattern and its negation."""
    rows = []
    for v in EDGE[dtype]:
        r = (v * _PATTERN.double()).repeat(k // _PATTERN.numel())
        rows += [r, -r.roll(1)]
    return torch.stack(rows).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).to(DEVICE)


def _finite_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def _check_decoded(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, source: torch.Tensor | None = None):
    """got (kernel) and want (reference): the same bits, no Inf; where source is given (the quantized input,
    finite), a source value at least dtype's largest finite decodes to it, sign kept."""
    assert got.dtype == want.dtype == dtype
    assert same_bits(got, want)
    assert not torch.isinf(got).any(), "a finite encoded value decoded to Inf"
    if source is not None:
        top = source.double().abs() >= _finite_max(dtype)
        assert torch.equal(got.double()[top].abs(), torch.full_like(got.double()[top], _finite_max(dtype)))
        assert torch.equal(torch.signbit(got[top]), torch.signbit(source[top]))


@pytest.mark.parametrize("in_dtype", HIGH)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_mxfp4_decodes_finite_at_the_range_edge(in_dtype, rounding):
    x = _edge_input(in_dtype)
    if rounding == "nearest":
        d, s = KMX.quantize_mxfp4_rowwise(x)
        assert same_bits(d, KMX.quantize_mxfp4_rowwise_ref(x)[0])
    else:
        d, s = KMX.quantize_mxfp4_stochastic(x, seed=3, step=1)
        assert same_bits(d, KMX.quantize_mxfp4_stochastic_ref(x, seed=3, step=1)[0])
    for out in HIGH:
        got = KMX.dequantize_mxfp4(d, s, out)
        # Nearest: a value at the top rounds up past the dtype (to 2^128 or 2^16) and decodes to its
        # largest finite; stochastic rounding may go down instead.
        src = x.to(out) if out != torch.float16 and rounding == "nearest" else None
        _check_decoded(got, KMX.dequantize_mxfp4_ref(d, s, out), out, src)
        if out == torch.float16 and in_dtype == torch.float16 and rounding == "nearest":
            # 57344, 61440 and 65504 all reach 2^16 in MXFP4 (scale 2^14, 3.5 -> 4): each decodes to 65504.
            top = x.double().abs() >= 57344
            assert torch.equal(got.double()[top].abs(), torch.full_like(got.double()[top], 65504.0))


def test_every_mxfp4_byte_at_every_scale_decodes_saturated():
    # 256 scale bytes x every byte (two codes): the decode is the exact value, rounded once to the output
    # dtype, saturated at its largest finite magnitude; byte 0xFF is NaN.
    scale = torch.arange(256, dtype=torch.uint8).repeat_interleave(16)[:, None]
    data = (torch.arange(4096) % 16 * 16)[:, None] + torch.arange(16)[None, :]
    data = data.to(torch.uint8)
    codes = torch.stack([data & 15, data >> 4], -1).flatten(1).long()
    exact = e2m1_values().double()[codes] * torch.pow(2.0, scale.double() - 127)   # float64: exact
    nan = (scale == 255).expand_as(exact)
    # The 4096 blocks as 64 rows of 64 (a row's blocks consecutive): the same pairs, 64x fewer programs.
    data, scale = data.reshape(64, 64 * 16).to(DEVICE), scale.reshape(64, 64).to(DEVICE)
    exact, nan = exact.reshape(64, 64 * 32), nan.reshape(64, 64 * 32)
    for out in HIGH:
        top = _finite_max(out)
        want = torch.where(exact.abs() > top, exact.sign() * top, exact).to(out)
        want = with_canonical_nan(want, nan)
        got = KMX.dequantize_mxfp4(data, scale, out)
        assert same_bits(got.cpu(), want)
        assert same_bits(KMX.dequantize_mxfp4_ref(data, scale, out).cpu(), want)


@pytest.mark.parametrize("in_dtype", HIGH)
def test_fp8_and_its_conversions_decode_finite_at_the_range_edge(in_dtype):
    # FP8 1x128 from x (row-wise and fused with MXFP4), MXFP4 -> FP8 rows, FP8 -> MXFP4, and both
    # column-wise conversions: every result decodes finite to every dtype, the edge saturating.
    x = _edge_input(in_dtype)
    fd, fs = K8.quantize_fp8_rowwise(x)
    (fd2, fs2), (md, ms) = K8.quantize_fp8_and_mxfp4(x)
    assert same_bits(fd2, fd) and same_bits(fs2, fs)
    fp8s = {"rows": (fd, fs), "from mxfp4": K8.mxfp4_to_fp8_rowwise(md, ms),
            "mxfp4 columns": KT.mxfp4_to_fp8_colwise(md, ms), "fp8 columns": KT.fp8_to_fp8_colwise(fd, fs)}
    assert same_bits(fp8s["from mxfp4"][0], K8.mxfp4_to_fp8_rowwise_ref(md, ms)[0])
    assert same_bits(fp8s["mxfp4 columns"][0], KT.mxfp4_to_fp8_colwise_ref(md, ms)[0])
    # From bf16 / fp32 maxima the FP8 rows hold 256 * 2^120 = 2^128, past float32: the reference's
    # saturating decode and the kernel's exact value give the same column scales and bytes.
    want = KT.fp8_to_fp8_colwise_ref(fd, fs)
    assert same_bits(fp8s["fp8 columns"][0], want[0]) and same_bits(fp8s["fp8 columns"][1], want[1])
    mx_from_fp8 = KMX.quantize_mxfp4_from_fp8(fd, fs)
    assert same_bits(mx_from_fp8[0], KMX.quantize_mxfp4_from_fp8_ref(fd, fs)[0])
    for out in HIGH:
        for name, (d, s) in fp8s.items():
            got = K8.dequantize_fp8_ref(d, s, out)
            assert not torch.isinf(got).any(), name
            assert not torch.isnan(got).any(), name
        src = x.to(out) if out != torch.float16 else None
        dec = K8.dequantize_fp8_ref(fd, fs, out)
        if src is not None:
            _check_decoded(dec, dec, out, src)
        _check_decoded(KMX.dequantize_mxfp4(*mx_from_fp8, out), KMX.dequantize_mxfp4_ref(*mx_from_fp8, out), out)
    if in_dtype == torch.float16:
        # 65504 = 255.875 * 2^8, and E4M3 rounds 255.875 up to 256 (scale 2^8): 2^16, decoded as 65504;
        # so does 63488 = 248 * 2^8 (a tie, to the even 256), not 63456 (to 240: 61440).
        dec = K8.dequantize_fp8_ref(fd, fs, torch.float16)
        for v, want in ((65504, 65504), (-65504, -65504), (63488, 65504), (63456, 61440)):
            assert dec[x == v].tolist() == [float(want)] * int((x == v).sum()), v


def test_fp8_decode_of_every_byte_at_large_scales():
    # Every E4M3 byte at scales up to 2^127: the float32 product overflows past 448 * 2^119; each output
    # dtype gets the value rounded once, saturated (never Inf); the NaN byte gives NaN.
    data = torch.arange(256, dtype=torch.uint8).repeat(6, 1).view(torch.float8_e4m3fn)
    exps = torch.tensor([0, 8, 9, 119, 120, 127], dtype=torch.float64)
    scale = torch.pow(2.0, exps)[:, None].float().expand(6, 2).contiguous()
    exact = data.float().double().view(6, 2, 128) * torch.pow(2.0, exps)[:, None, None]
    exact = exact.view(6, 256)
    for out in HIGH:
        top = _finite_max(out)
        want = with_canonical_nan(torch.where(exact.abs() > top, exact.sign() * top, exact).to(out), exact.isnan())
        assert same_bits(K8.dequantize_fp8_ref(data, scale, out), want)


@pytest.mark.parametrize("out", HIGH)
def test_gather_sum_fp8_decodes_saturated_and_sums_with_overflow(out):
    # The rows' decode saturates (as dequantize_fp8); their float32 sum is rounded to dtype without
    # saturation: two rows at the edge sum past it.
    # Every E4M3 byte under scales 2^127 (past every dtype from 2^1 up) and 2^9 (past fp16 from 2^7 up).
    d = torch.arange(256, dtype=torch.uint8).view(2, 128).view(torch.float8_e4m3fn)
    s = torch.tensor([[2.0**127], [2.0**9]])
    d, s = d.to(DEVICE), s.to(DEVICE)
    slots = torch.tensor([[0, -1], [1, -1], [0, 0], [1, 1]], device=DEVICE)
    got = gather_sum_fp8(d, s, slots, out)
    assert same_bits(got, gather_sum_fp8_ref(d, s, slots, out))
    single = got[:2][~torch.isnan(got[:2])]
    assert not torch.isinf(single).any(), "one decoded row is finite"
    assert torch.isinf(got[2]).any(), "a sum past the range is Inf"


def _hard_nvfp4_edge(dtype):
    x = _edge_input(dtype)
    return x.float().clamp(-3e38, 3e38).to(dtype) if dtype != torch.float16 else x


@pytest.mark.parametrize("in_dtype", HIGH)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_nvfp4_decodes_finite_at_the_range_edge(in_dtype, rounding):
    x = _hard_nvfp4_edge(in_dtype)
    r = N.Rounding(rounding)
    big_ts = torch.tensor(2.0**120, device=DEVICE)   # e2m1 * e4m3 * 2^120 overflows float32
    for ts in (None, big_ts):
        d, s, s_t = N.quantize_nvfp4(x, ts, r, 5, 6, 7)
        dr, sr, _ = N.quantize_nvfp4_ref(x, ts, r, 5, 6, 7)
        assert same_bits(d, dr) and same_bits(s, sr)
        for out in HIGH:
            got = N.dequantize_nvfp4(d, s, s_t, out)
            _check_decoded(got, N.dequantize_nvfp4_ref(d, s, s_t, out), out)
        # FP8 <-> NVFP4: encoded bytes unchanged (a product past float32 is the NaN byte in FP8)
        assert same_bits(N.nvfp4_to_fp8_rowwise(d, s, s_t)[0], N.nvfp4_to_fp8_rowwise_ref(d, s, s_t)[0])
        assert same_bits(N.nvfp4_to_fp8_colwise(d, s, s_t)[0], N.nvfp4_to_fp8_colwise_ref(d, s, s_t)[0])
    fd, fs = K8.quantize_fp8_rowwise(x)
    d, s, s_t = N.quantize_nvfp4_from_fp8(fd, fs, None, r, 1, 2, 3)
    assert same_bits(d, N.quantize_nvfp4_from_fp8_ref(fd, fs, None, r, 1, 2, 3)[0])
    for out in HIGH:
        _check_decoded(N.dequantize_nvfp4(d, s, s_t, out), N.dequantize_nvfp4_ref(d, s, s_t, out), out)


@pytest.mark.parametrize("in_dtype", HIGH)
def test_nan_stays_nan_and_inf_inputs_decode_to_nan(in_dtype):
    # An Inf input marks its MXFP4 / NVFP4 block NaN and is the NaN byte in FP8: it decodes to NaN,
    # as NaN does, in every output dtype (docs/formats.md).
    x = _edge_input(in_dtype)
    x[0, 3], x[1, 40], x[2, 200] = float("nan"), float("inf"), float("-inf")
    bad = torch.zeros_like(x, dtype=torch.bool)
    bad[0, 3] = bad[1, 40] = bad[2, 200] = True
    md, ms = KMX.quantize_mxfp4_rowwise(x)
    fd, fs = K8.quantize_fp8_rowwise(x)
    nd, ns, nt = N.quantize_nvfp4(x)
    for out in HIGH:
        mx = KMX.dequantize_mxfp4(md, ms, out)
        f8 = K8.dequantize_fp8_ref(fd, fs, out)
        nv = N.dequantize_nvfp4(nd, ns, nt, out)
        assert torch.isnan(f8[bad]).all() and not torch.isnan(f8[~bad]).any()
        for dec in (mx, nv, f8):
            assert torch.isnan(dec[bad]).all() and not torch.isinf(dec).any()
            assert same_bits(dec[torch.isnan(dec)], torch.full((int(torch.isnan(dec).sum()),), NAN_BITS[out],
                                                                    dtype=_BITS[out], device=DEVICE).view(out))


@triton.jit
def _probe_out_bits_kernel(v_ptr, o_ptr, N, OUT_DTYPE: tl.constexpr, SATURATE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs, mask=offs < N, other=0.0)
    tl.store(o_ptr + offs, f32_to_out_bits(v, v != v, OUT_DTYPE, SATURATE), mask=offs < N)


@triton.jit
def _probe_in_bits_kernel(r_ptr, o_ptr, N, IN_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    raw = tl.load(r_ptr + offs, mask=offs < N, other=0)
    tl.store(o_ptr + offs, in_bits_to_f32_bits(raw, IN_DTYPE), mask=offs < N)


def _edge_floats() -> torch.Tensor:
    """float32: every bf16 pattern, fp16's and float32's overflow thresholds and their neighbours."""
    every_bf16 = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    pts = torch.tensor([65504.0, 65519.0, 65520.0, 65536.0, 131008.0, 6.1e-5, 5.96e-8, 2.98e-8, 1.0e-45],
                       dtype=torch.float32)
    fmax = torch.tensor([torch.finfo(torch.float32).max, 3.3895313892515355e38, 3.3961775292304e38])
    around = torch.cat([pts, fmax])
    up = torch.nextafter(around, torch.tensor(float("inf")))
    down = torch.nextafter(around, torch.tensor(0.0))
    v = torch.cat([every_bf16, around, up, down])
    return torch.cat([v, -v])


@pytest.mark.parametrize("out", HIGH)
def test_f32_to_out_bits_equals_to_output(out):
    # The one float32 -> output-bits rule of every decode kernel against numerics.to_output (SATURATE)
    # and against torch's cast with the canonical NaN (SATURATE=False, the sums).
    v = _edge_floats().to(DEVICE)
    nan = torch.isnan(v)
    for saturate in (True, False):
        bits = torch.empty(v.numel(), dtype=torch.int32, device=DEVICE)
        _probe_out_bits_kernel[(triton.cdiv(v.numel(), 1024),)](v, bits, v.numel(), OUT_DTYPE=tl_dtype(out),
                                                                  SATURATE=saturate, BLOCK=1024)
        want = to_output(v, out, nan) if saturate else with_canonical_nan(v.to(out), nan)
        got = bits.to(_BITS[out]).view(out)
        assert same_bits(got, want), (out, saturate)
        if saturate:
            assert not torch.isinf(got).any()
            top = FINITE_MAX_BITS[out]
            assert int((got.view(_BITS[out]).int() & (0x7FFFFFFF if out == torch.float32 else 0x7FFF)).max()) in (
                top, NAN_BITS[out])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_bits_to_f32_bits_is_the_exact_widening(dtype):
    raw = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).to(DEVICE)
    got = torch.empty(raw.numel(), dtype=torch.int32, device=DEVICE)
    _probe_in_bits_kernel[(triton.cdiv(raw.numel(), 1024),)](raw, got, raw.numel(), IN_DTYPE=tl_dtype(dtype),
                                                               BLOCK=1024)
    want = raw.view(dtype).float()
    keep = ~torch.isnan(want)
    assert torch.equal(got[keep], want.view(torch.int32)[keep])
    assert torch.isnan(got.view(torch.float32)[~keep]).all()


def test_tl_dtype_is_the_one_map():
    assert [tl_dtype(d) for d in HIGH + [torch.float8_e4m3fn]] == [tl.bfloat16, tl.float16, tl.float32, tl.float8e4nv]
    with pytest.raises(TypeError, match="unsupported dtype"):
        tl_dtype(torch.int8)


def test_to_output_saturates_keeps_signs_and_nan():
    v = torch.tensor([65504.0, 65520.0, -65536.0, float("inf"), -float("inf"), float("nan"), -0.0, 3.4e38])
    got = to_output(v, torch.float16, torch.isnan(v))
    assert got[:5].tolist() == [65504.0, 65504.0, -65504.0, 65504.0, -65504.0]
    assert got[5].view(torch.int16).item() == NAN_BITS[torch.float16]
    assert torch.signbit(got[6]) and got[7].item() == 65504.0
    b = to_output(torch.tensor([3.4e38, -float("inf")]), torch.bfloat16)
    assert b.tolist() == [torch.finfo(torch.bfloat16).max, -torch.finfo(torch.bfloat16).max]
    f = to_output(torch.tensor([float("inf"), -float("inf")]), torch.float32)
    assert f.tolist() == [torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max]


@pytest.mark.parametrize("v", [57344.0, 61440.0, 65504.0, -65504.0])
def test_fp16_container_restores_finite(v):
    # What the saved-tensor hook does with an fp16 activation: quantize, then dequantize() in the
    # tensor's own dtype (MXFP4, FP8 1x128 and NVFP4 containers alike).
    x = torch.full((2, 128), v, dtype=torch.float16, device=DEVICE)
    for q in (moe_fp4.quantize_mxfp4(x), moe_fp4.quantize_fp8(x), moe_fp4.quantize_nvfp4(x)):
        y = q.dequantize()
        assert y.dtype == torch.float16 and torch.isfinite(y).all(), type(q).__name__
        assert (y.abs() <= 65504).all() and torch.equal(torch.signbit(y), torch.signbit(x))
    assert moe_fp4.quantize_mxfp4(x).dequantize().abs().min().item() == 65504.0
