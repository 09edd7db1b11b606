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
from moe_fp4.kernels.transpose import quantize_fp8_rowwise_colwise, quantize_fp8_rowwise_colwise_ref

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


# ---- backward straight to dh's FP8 rows and columns (swiglu_backward_quantize) ------------------

def _mxfp4_h(h):
    """bf16 h -> (codes uint8 [M, F], scales uint8 [M, 2F/32], the bf16 values they decode to)."""
    d, s = quantize_mxfp4_rowwise(h)
    return d, s, dequantize_mxfp4(d, s, torch.bfloat16)


def _check_backward_quantize(h, da, w, h_scale=None, rowwise=True, **kw):
    """The fused kernel against the chain it replaces (swiglu_backward of the bf16 h, or of MXFP4 h
    decoded, then the FP8 rows / columns of that dh): bytes and scales bit for bit, dw to SWIGLU_DW_RTOL
    (its sums run per 128-column tile); and against the reference quantizers of the chain's own dh."""
    hb = h if h_scale is None else dequantize_mxfp4(h, h_scale, torch.bfloat16)
    rows, cols, dw = KS.swiglu_backward_quantize(h, da, w, h_scale, rowwise=rowwise, **kw)
    dh, dw_chain = KS.swiglu_backward(hb, da, w)
    for got, want in ((rows, quantize_fp8_rowwise_colwise(dh, rowwise, True)[0]),
                      (cols, quantize_fp8_rowwise_colwise_ref(dh)[1]),
                      (rows, quantize_fp8_rowwise_colwise_ref(dh, rowwise, False)[0])):
        if not rowwise and got is rows:
            assert got is None and want is None
            continue
        assert got[0].dtype == torch.float8_e4m3fn and same_bits(got[0], want[0])
        assert same_bits(got[1], want[1]) and got[1].stride() == want[1].stride()   # M-major scales
    _check_dw(hb, da, dw, dw_chain)
    # The reference (torch throughout): the same chain with swiglu_backward_ref's dh, within one ulp.
    ref = KS.swiglu_backward_quantize_ref(h, da, w, h_scale, rowwise=rowwise)
    dh_ref, dw_ref = KS.swiglu_backward_ref(hb, da, w)
    _check_bf16_close(dh, dh_ref)
    assert all(same_bits(a, b) for a, b in zip(ref[1], quantize_fp8_rowwise_colwise_ref(dh_ref)[1]))
    _check_dw(hb, da, ref[2], dw_ref)
    return rows, cols, dw


@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("m,f", [(0, 128), (128, 128), (256, 384)])
def test_backward_quantize_matches_the_chain(m, f, weighted, mxfp4):
    h, w, da = _inputs(m, f, weighted, seed=m * 13 + f + weighted)
    if mxfp4:
        d, sc, _ = _mxfp4_h(h)
        _check_backward_quantize(d, da, w, sc)
    else:
        _check_backward_quantize(h, da, w)


@pytest.mark.parametrize("mxfp4", [False, True])
def test_backward_quantize_without_rows(mxfp4):
    h, w, da = _inputs(128, 256, True, seed=21)
    args = _mxfp4_h(h)[:2] if mxfp4 else (h, None)
    _check_backward_quantize(args[0], da, w, args[1], rowwise=False)


def test_backward_quantize_non_finite_and_extreme_blocks():
    """bf16 h with NaN / Inf gates and ups and overflowing products; MXFP4 h with a NaN block (scale
    0xFF), blocks at E8M0 bytes 0, 1 (float32 subnormal values) and 254 (codes >= 2 decode to Inf):
    their dh elements are NaN / Inf, which take no part in any amax and encode as 0x7F."""
    h, w, da = _inputs(128, 256, True, seed=3)
    h[0, 5] = float("nan")
    h[1, 256 + 40] = float("inf")
    h[2, 130] = float("-inf")
    h[4, 0], h[4, 256] = 3e38, 3e38
    h[5, 64], h[5, 320] = -100.0, 1e30
    rows, cols, _ = _check_backward_quantize(h, da, w)
    assert (rows[0].view(torch.uint8) == 0x7F).any() and (cols[0].view(torch.uint8) == 0x7F).any()
    d, sc, _ = _mxfp4_h(_inputs(128, 256, True, seed=4)[0])
    sc[3, 2], sc[7, 9], sc[8, 1], sc[9, 12] = 255, 0, 1, 254
    d[9, 12 * 16:13 * 16] = 0x7F   # codes 15 and 7 (-6, 6): Inf at scale 2^127
    rows, cols, _ = _check_backward_quantize(d, da, w, sc)
    assert (cols[0].view(torch.uint8) == 0x7F).any()


def test_backward_quantize_validation():
    h, w, da = _inputs(128, 128, True, seed=0)
    d, sc, _ = _mxfp4_h(h)
    fn = KS.swiglu_backward_quantize
    cases = [
        (lambda: fn(h[:100], da[:100], w[:100]), ValueError, "M must be a multiple of 128"),
        (lambda: fn(h.float(), da, w), TypeError, "h must be bfloat16"),
        (lambda: fn(h, da[:, :64], w), ValueError, r"da must be \[M, F\]"),
        (lambda: fn(h, da, w[:-1]), ValueError, r"w must be \[M\]"),
        (lambda: fn(h, da, w, sc), TypeError, "MXFP4 codes"),
        (lambda: fn(d, da, w, sc[:, :4]), ValueError, "h_scale must be uint8"),
        (lambda: fn(d, da, w, sc.int()), ValueError, "h_scale must be uint8"),
        (lambda: fn(d.t().contiguous().t(), da, w, sc), ValueError, "contiguous"),
        (lambda: fn(d, da.float(), w, sc), ValueError, "da must be a contiguous bfloat16"),
        (lambda: fn(d, da, w.double(), sc), TypeError, "w must be a float32"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=f"^swiglu_backward_quantize: .*{msg}"):
            call()
        # the reference validates the same way
    with pytest.raises(ValueError, match="^swiglu_backward_quantize_ref: .*multiple of 128"):
        KS.swiglu_backward_quantize_ref(h[:100], da[:100], w[:100])


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
@pytest.mark.parametrize("mxfp4", [False, True])
def test_gpu_backward_quantize_moe_size(mxfp4):
    """32768 x F 2048 (dsv3's expert rows): the fused kernel equals the chain bit for bit, with the PTX
    rounding and with its pure-Triton twin."""
    h, w, da = _inputs(32768, 2048, True, seed=12, device="cuda")
    args = _mxfp4_h(h)[:2] if mxfp4 else (h, None)
    ptx = _check_backward_quantize(args[0], da, w, args[1])
    twin = KS.swiglu_backward_quantize(args[0], da, w, args[1], asm=False)
    assert all(same_bits(a, b) for a, b in zip(ptx[0] + ptx[1], twin[0] + twin[1]))
