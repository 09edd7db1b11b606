"""The fused SwiGLU kernels (kernels/swiglu.py) against their pure-torch twins.

bf16 outputs (a, dh) may differ from the reference by SWIGLU_MAX_ULP bf16 ulps (exp differs in the
last float32 ulp between Triton and torch) and must be equal in the vast majority of elements; every
quantized output must equal the reference quantizer applied to the kernel's own bf16 a (or to h),
raw bytes (rtol=0, atol=0); dw is within SWIGLU_DW_RTOL of the reference, relative to sum |terms|.
On CPU the kernels run under the Triton interpreter; the `gpu` test repeats this at MoE size.
"""

from __future__ import annotations

import pytest
import torch
from helpers import same_bits

from moe_fp4.kernels import swiglu as KS
from moe_fp4.kernels.fp8 import quantize_fp8_rowwise_ref
from moe_fp4.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4_rowwise, quantize_mxfp4_rowwise_ref

# The interpreter evaluates exp / products of non-finite and huge inputs in numpy, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Share of bf16 elements that must be bit-equal to the reference (measured: all but a handful in
# 10^5; every differing one is one ulp off).
MIN_EQUAL_FRACTION = 0.99
# The interpreter's time grows with the number of programs: the larger shapes on CPU use bigger
# blocks (still partial in rows and, for the backward, in columns); the small tests and the GPU use
# the launchers' defaults.
FWD_KW = {} if torch.cuda.is_available() else dict(block_m=32)
BWD_KW = {} if torch.cuda.is_available() else dict(block_m=16, block_w=128)


def _inputs(m: int, f: int, weighted: bool, seed: int, device=DEVICE):
    """h bf16 [m, 2F] ~ N(0, 3^2) (gate over silu's negative dip and positive branch), w float32 [m]
    in (0, 1] (router probabilities) or None, da bf16 [m, F] ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    h = (3 * torch.randn(m, 2 * f, generator=g)).bfloat16()
    w = (1 - torch.rand(m, generator=g)) if weighted else None
    da = torch.randn(m, f, generator=g).bfloat16()
    return h.to(device), None if w is None else w.to(device), da.to(device)


def _bf16_order(x: torch.Tensor) -> torch.Tensor:
    """bf16 [...] -> int32 [...] monotone in the value, consecutive bf16 values one apart (+0 == -0)."""
    v = x.view(torch.int16).int()
    return torch.where(v < 0, -(v & 0x7FFF), v)


def _check_bf16_close(got: torch.Tensor, want: torch.Tensor, max_ulp: int = KS.SWIGLU_MAX_ULP):
    """Same shape/dtype, NaN (canonical 0x7FC0) where want is NaN, elsewhere at most max_ulp bf16 ulps
    apart and bit-equal in at least MIN_EQUAL_FRACTION of the elements."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert same_bits(got[nan], want[nan])
    if want.numel() == 0:
        return
    d = (_bf16_order(got) - _bf16_order(want)).abs()[~nan]
    assert d.numel() == 0 or d.max().item() <= max_ulp, d.max().item()
    assert (got.view(torch.int16) == want.view(torch.int16)).float().mean().item() >= MIN_EQUAL_FRACTION


def _check_dw(h, da, dw, dw_ref):
    """Rows whose terms t = da * silu * u have sum |t| below float32's max (no partial sum can
    overflow, in any order): |dw - dw_ref| <= SWIGLU_DW_RTOL * sum |t|, the error scale of a float32
    sum in any order. Rows with a NaN term: NaN in both. Other rows (an Inf term, or a sum that may
    overflow depending on the order) are not compared."""
    if dw_ref is None:
        assert dw is None
        return
    assert dw.shape == dw_ref.shape and dw.dtype == torch.float32
    g, u = h.float().chunk(2, dim=1)
    t = da.float() * (g * torch.sigmoid(g)) * u
    scale = t.double().abs().sum(dim=1)
    nan_row = torch.isnan(t).any(dim=1)
    assert torch.all(torch.isnan(dw[nan_row])) and torch.all(torch.isnan(dw_ref[nan_row]))
    ok = scale < torch.finfo(torch.float32).max
    err = (dw[ok].double() - dw_ref[ok].double()).abs()
    assert torch.all(err <= KS.SWIGLU_DW_RTOL * scale[ok]), (err / scale[ok]).max().item()


def _check_forward(h, w, write_h_mxfp4=True, write_a_mxfp4=True, **kw):
    fp8, a_mx, h_mx, a = KS.swiglu_quantize(h, w, write_h_mxfp4, write_a_mxfp4, write_a=True, **kw)
    want = KS.swiglu_quantize_ref(h, w, write_h_mxfp4, write_a_mxfp4, write_a=True)
    _check_bf16_close(a, want[3])
    # Bit-identical to the reference quantizers applied to the kernel's own bf16 a.
    fd, fs = quantize_fp8_rowwise_ref(a)
    assert fp8[0].dtype == torch.float8_e4m3fn and same_bits(fp8[0], fd)
    assert same_bits(fp8[1], fs) and fp8[1].t().is_contiguous()  # M-major
    if write_a_mxfp4:
        assert all(same_bits(g, r) for g, r in zip(a_mx, quantize_mxfp4_rowwise_ref(a)))
    else:
        assert a_mx is None
    if write_h_mxfp4:
        assert all(same_bits(g, r) for g, r in zip(h_mx, want[2]))
    else:
        assert h_mx is None
    return a


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("f", [128, 384])
@pytest.mark.parametrize("m", [0, 1, 7, 130])
def test_forward_matches_reference(m, f, weighted):
    h, w, _ = _inputs(m, f, weighted, seed=m * 7 + f + weighted)
    _check_forward(h, w, **FWD_KW)


@pytest.mark.parametrize("write_h_mxfp4,write_a_mxfp4", [(False, False), (True, False), (False, True)])
def test_forward_output_selection(write_h_mxfp4, write_a_mxfp4):
    h, w, _ = _inputs(9, 256, True, seed=5)
    _check_forward(h, w, write_h_mxfp4, write_a_mxfp4)
    out = KS.swiglu_quantize(h, w, write_h_mxfp4, write_a_mxfp4)
    assert out[3] is None and (out[1] is None) != write_a_mxfp4 and (out[2] is None) != write_h_mxfp4
    ref = KS.swiglu_quantize_ref(h, w, write_h_mxfp4, write_a_mxfp4)
    assert ref[3] is None and (ref[1] is None) != write_a_mxfp4 and (ref[2] is None) != write_h_mxfp4


@pytest.mark.parametrize("weighted", [False, True])
def test_references_match_autograd(weighted):
    """The references' hand-written forward and backward against torch autograd of the same float32
    function: the float32 results differ only in operation order, so the bf16 outputs are within
    SWIGLU_MAX_ULP and dw within SWIGLU_DW_RTOL."""
    h, w, da = _inputs(64, 128, weighted, seed=5, device="cpu")
    hf = h.float().requires_grad_()
    wf = None if w is None else w.clone().requires_grad_()
    g, u = hf.chunk(2, dim=-1)
    a = g * torch.sigmoid(g) * u * (1.0 if wf is None else wf[:, None])
    a.backward(da.float())
    _check_bf16_close(KS.swiglu_ref(h, w), a.detach().bfloat16())
    dh, dw = KS.swiglu_backward_ref(h, da, w)
    _check_bf16_close(dh, hf.grad.bfloat16())
    if weighted:
        _check_dw(h, da, dw, wf.grad)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("f", [128, 384])
@pytest.mark.parametrize("m", [0, 1, 7, 130])
def test_backward_matches_reference(m, f, weighted):
    h, w, da = _inputs(m, f, weighted, seed=m * 11 + f + weighted)
    dh, dw = KS.swiglu_backward(h, da, w, **BWD_KW)
    dh_ref, dw_ref = KS.swiglu_backward_ref(h, da, w)
    _check_bf16_close(dh, dh_ref)
    _check_dw(h, da, dw, dw_ref)


@pytest.mark.parametrize("up_scale", [1.0, 1e30])
def test_every_bf16_gate_value(up_scale):
    """gate runs through all 2^16 bf16 bit patterns (subnormals, the cancellation of 1 + g(1 - s) near
    g = -1.28, exp's overflow edges near +-88, Inf, NaN), against random up, da and w; up * 1e30
    makes the tiny silu of gates near -88 visible in a, and overflows others to Inf."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(256, 256)
    _, w, da = _inputs(256, 256, True, seed=1)
    up = (_inputs(256, 128, False, seed=2)[0].float() * up_scale).bfloat16()
    h = torch.cat([gate.to(DEVICE), up], dim=1)
    for wt in (None, w):
        _check_forward(h, wt, **FWD_KW)
        dh, dw = KS.swiglu_backward(h, da, wt, **BWD_KW)
        dh_ref, dw_ref = KS.swiglu_backward_ref(h, da, wt)
        _check_bf16_close(dh, dh_ref)
        _check_dw(h, da, dw, dw_ref)


def test_non_finite_and_huge_inputs():
    """NaN / +-Inf in gate and up, and finite products that overflow to Inf in float32 or bf16: those
    elements of a are NaN or Inf, so their FP8 bytes are 0x7F and their MXFP4 blocks get scale 0xFF
    (the quantizers' rules), while the rest of each tile / block is quantized normally."""
    h, w, da = _inputs(7, 256, True, seed=3)
    h[0, 5] = float("nan")                  # gate NaN -> a NaN
    h[1, 256 + 40] = float("inf")           # up Inf, silu(g) != 0 -> a +-Inf
    h[2, 130] = float("-inf")               # gate -Inf: silu = -Inf * 0 = NaN
    h[3, 7] = float("inf")                  # gate +Inf: silu = Inf
    h[4, 0], h[4, 256] = 3e38, 3e38         # finite gate and up, product overflows float32
    h[5, 64], h[5, 320] = -100.0, 1e30      # exp(100) overflows: sigmoid = 0, silu = -0, a = -0
    h[5, 65], h[5, 321] = -88.5, 1e30       # sigmoid(-88.5) = 3.7e-39, a float32 subnormal: a ~ -3e-7
    # 1.4140625^2 * 2^127 = 3.402e38: a finite float32 that rounds to bf16 Inf (w = 1 on this row)
    h[6, 200], h[6, 456], w[6] = 1.4140625 * 2.0**64, 1.4140625 * 2.0**63, 1.0
    a = _check_forward(h, w)
    bad = ~torch.isfinite(a.float())
    assert bad.sum().item() >= 5
    fp8, a_mx, _, _ = KS.swiglu_quantize(h, w, False, True)
    assert torch.all(fp8[0].view(torch.uint8)[bad] == 0x7F)
    blocks_bad = bad.view(7, -1, 32).any(dim=-1)
    assert torch.all(a_mx[1][blocks_bad] == 0xFF) and torch.all(a_mx[1][~blocks_bad] != 0xFF)
    dh, dw = KS.swiglu_backward(h, da, w)
    dh_ref, dw_ref = KS.swiglu_backward_ref(h, da, w)
    _check_bf16_close(dh, dh_ref)
    _check_dw(h, da, dw, dw_ref)
    assert torch.isnan(dw).any()


def test_unaligned_storage_offset():
    """A contiguous h whose first element is not 4-byte aligned (a slice): the pair-word view copies."""
    h, w, da = _inputs(3, 128, True, seed=4)
    buf = torch.empty(h.numel() + 1, dtype=torch.bfloat16, device=DEVICE)
    h_odd = buf[1:].view(3, 256)
    h_odd.copy_(h)
    _check_forward(h_odd, w)
    assert same_bits(KS.swiglu_backward(h_odd, da, w)[0], KS.swiglu_backward(h, da, w)[0])


def test_strided_router_weight():
    h, w, da = _inputs(5, 128, True, seed=6)
    w2 = torch.stack([w, torch.zeros_like(w)], dim=1)[:, 0]  # stride 2
    assert same_bits(KS.swiglu_quantize(h, w2, True, True, True)[3], KS.swiglu_quantize(h, w, True, True, True)[3])
    got, want = KS.swiglu_backward(h, da, w2), KS.swiglu_backward(h, da, w)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


_BAD_INPUTS = [
    (lambda h, w, da: (h.float(), w, da), TypeError, "h must be bfloat16"),
    (lambda h, w, da: (h[0], w, da), ValueError, "2-D"),
    (lambda h, w, da: (h[:, :192], w, da), ValueError, "multiple of 128"),
    (lambda h, w, da: (h.t().contiguous().t(), w, da), ValueError, "contiguous"),
    (lambda h, w, da: (h, w.double(), da), TypeError, "w must be a float32"),
    (lambda h, w, da: (h, w[:-1], da), ValueError, r"w must be \[M\]"),
    (lambda h, w, da: (h, w[:, None], da), ValueError, r"w must be \[M\]"),
]
_BAD_DA = [
    (lambda da: da.float(), TypeError, "da must be a bfloat16"),
    (lambda da: da[:, :128], ValueError, r"da must be \[M, F\]"),
    (lambda da: da.t().contiguous().t(), ValueError, "da must be contiguous"),
]


@pytest.mark.parametrize("bad", range(len(_BAD_INPUTS)))
def test_input_validation(bad):
    h, w, da = _inputs(4, 128, True, seed=0)
    make, exc, msg = _BAD_INPUTS[bad]
    h2, w2, da2 = make(h, w, da)
    with pytest.raises(exc, match=f"^swiglu_quantize: .*{msg}"):
        KS.swiglu_quantize(h2, w2, True, True)
    with pytest.raises(exc, match=f"^swiglu_backward: .*{msg}"):
        KS.swiglu_backward(h2, da2, w2)


@pytest.mark.parametrize("bad", range(len(_BAD_DA)))
def test_backward_gradient_validation(bad):
    h, w, da = _inputs(4, 256, True, seed=0)
    make, exc, msg = _BAD_DA[bad]
    with pytest.raises(exc, match=f"^swiglu_backward: .*{msg}"):
        KS.swiglu_backward(h, make(da), w)


# ---- backward from fp4's MXFP4 h (decoded in the kernel) ---------------------------------------

def _check_backward_mxfp4(h, da, w, **kw):
    """h bf16 -> its MXFP4 codes and scales (quantize_mxfp4_rowwise), through swiglu_backward(h_scale=):
    dh bit for bit the bf16 kernel's on the dequantized h, dw within SWIGLU_DW_RTOL of it (the sum's
    order is the compiler's); the reference likewise against swiglu_backward_ref on that tensor."""
    d, sc = quantize_mxfp4_rowwise(h)
    return _check_backward_mxfp4_codes(d, sc, da, w, **kw)


def _check_backward_mxfp4_codes(d, sc, da, w, **kw):
    hb = dequantize_mxfp4(d, sc, torch.bfloat16)
    dh, dw = KS.swiglu_backward(d, da, w, h_scale=sc, **kw)
    dh_b, dw_b = KS.swiglu_backward(hb, da, w, **kw)
    assert same_bits(dh, dh_b)
    _check_dw(hb, da, dw, dw_b)
    dh_ref, dw_ref = KS.swiglu_backward_ref(d, da, w, h_scale=sc)
    want = KS.swiglu_backward_ref(hb, da, w)
    assert same_bits(dh_ref, want[0])
    _check_dw(hb, da, dw_ref, want[1])
    _check_bf16_close(dh, dh_ref)
    return dh, dw


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("m,f", [(0, 128), (1, 128), (7, 384), (130, 128)])
def test_backward_mxfp4_matches_bf16_kernel(m, f, weighted):
    """Odd and zero row counts, F a multiple of 128 but not of the kernel's 256-pair chunk (384)."""
    h, w, da = _inputs(m, f, weighted, seed=m * 17 + f + weighted)
    _check_backward_mxfp4(h, da, w, **BWD_KW)


def test_backward_mxfp4_extreme_scales():
    """Every E2M1 code under the E8M0 bytes that leave the normal range: 0 and 1 (float32 subnormal
    values), 253 and 254 (6 * 2^127 and 4 * 2^127 overflow to Inf), 255 (a NaN block); the NaN / Inf
    they give in h make dh NaN / Inf and dw NaN exactly as the bf16 kernel's on the decoded h."""
    _, w, da = _inputs(8, 256, True, seed=7)
    g = torch.Generator().manual_seed(8)
    d = torch.randint(0, 256, (8, 256), dtype=torch.uint8, generator=g)
    d[0, :128] = torch.arange(128, dtype=torch.uint8) * 2 + 1        # every code pair, low and high nibble
    sc = torch.randint(100, 140, (8, 16), dtype=torch.uint8, generator=g)
    sc[0, :4] = torch.tensor([0, 1, 253, 254], dtype=torch.uint8)
    sc[1, 3], sc[2, 9], sc[3, 0] = 255, 0, 254
    dh, dw = _check_backward_mxfp4_codes(d.to(DEVICE), sc.to(DEVICE), da, w)
    assert torch.isnan(dh).any() and torch.isinf(dh).any() and torch.isnan(dw).any()


def test_backward_mxfp4_validation():
    h, w, da = _inputs(4, 128, True, seed=0)
    d, sc = quantize_mxfp4_rowwise(h)
    fn = KS.swiglu_backward
    cases = [
        (lambda: fn(h, da, w, h_scale=sc), TypeError, "MXFP4 codes"),
        (lambda: fn(d[:, :64], da, w, h_scale=sc[:, :4]), ValueError, "multiple of 128"),
        (lambda: fn(d, da, w, h_scale=sc[:, :4]), ValueError, r"h_scale must be uint8 \[M, 2F/32\]"),
        (lambda: fn(d, da, w, h_scale=sc.int()), ValueError, "h_scale must be uint8"),
        (lambda: fn(d.t().contiguous().t(), da, w, h_scale=sc), ValueError, "must be contiguous"),
        (lambda: fn(d, da[:, :64], w, h_scale=sc), ValueError, r"da must be \[M, F\]"),
        (lambda: fn(d, da.float(), w, h_scale=sc), TypeError, "da must be a bfloat16"),
        (lambda: fn(d, da, w[:-1], h_scale=sc), ValueError, r"w must be \[M\]"),
        (lambda: fn(d, da, w.double(), h_scale=sc), TypeError, "w must be a float32"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=f"^swiglu_backward: .*{msg}"):
            call()
    with pytest.raises(TypeError, match="^swiglu_backward_ref: .*MXFP4 codes"):
        KS.swiglu_backward_ref(h, da, w, h_scale=sc)


# ---- real size on a GPU ------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_fp8_encode_ptx_path_equals_the_twin_path():
    h, w, _ = _inputs(4096, 2048, True, seed=10, device="cuda")
    for hm, am in ((False, False), (True, True)):
        ptx = KS.swiglu_quantize(h, w, hm, am, write_a=True, asm=True)
        twin = KS.swiglu_quantize(h, w, hm, am, write_a=True, asm=False)
        for p, t in zip(ptx, twin):
            if p is None:
                assert t is None
                continue
            for x, y in zip(p, t) if isinstance(p, tuple) else ((p, t),):
                assert same_bits(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [False, True])
def test_gpu_moe_size(weighted):
    h, w, da = _inputs(4096, 2048, weighted, seed=9, device="cuda")
    _check_forward(h, w)
    dh, dw = KS.swiglu_backward(h, da, w)
    dh_ref, dw_ref = KS.swiglu_backward_ref(h, da, w)
    _check_bf16_close(dh, dh_ref)
    _check_dw(h, da, dw, dw_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [False, True])
def test_gpu_backward_mxfp4_moe_size(weighted):
    """32768 x F 2048 (dsv3's expert rows): MXFP4 h decoded in the kernel gives the bf16 kernel's dh on
    the dequantized h bit for bit."""
    h, w, da = _inputs(32768, 2048, weighted, seed=13, device="cuda")
    _check_backward_mxfp4(h, da, w)
