"""Cast + transpose: quantize_fp8_rowwise_colwise (FP8 1x128 of X and of X^T from one read of X)
against its twin, raw bytes equal, and its rows against the existing row-wise Triton quantizer.

The twin is built from quantize_fp8_rowwise_ref: rows = ref(x), cols = ref(x.t().contiguous()).
On CPU the kernel runs under the Triton interpreter (conftest sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch
from helpers import INPUT_KINDS, make_input, same_bits

from moe_fp4.kernels import fp8 as K8
from moe_fp4.kernels import transpose as KT

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIGH = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(0, 128), (128, 128), (384, 256), (256, 640)]
NAME = "quantize_fp8_rowwise_colwise"
# The existing row-wise Triton quantizer, with programs of whole 128-row tiles under the interpreter
# (its default 8-row programs cost ~20x the time there; the tuning does not change the result).
_ROWWISE_TUNING = {} if DEVICE == "cuda" else {"block_m": 128, "tiles": 8}


# The sweep below uses whole-block slices under the interpreter (a third of the time of the default
# 32-column slices); the tests after it cover every slice width, the default included.
_SWEEP_TUNING = {} if DEVICE == "cuda" else {"slice_k": 128}


def _rowwise_kernel(x):
    return K8.quantize_fp8_rowwise(x, **_ROWWISE_TUNING)


def _check_pair(got, want, lead: int):
    """got/want: (data, scale) or None; data raw bytes equal, scale bits equal with strides (1, lead)."""
    if want is None:
        assert got is None
        return
    (gd, gs), (wd, ws) = got, want
    assert gd.dtype == wd.dtype == torch.float8_e4m3fn and gd.shape == wd.shape
    assert gs.dtype == ws.dtype == torch.float32 and gs.shape == ws.shape
    assert same_bits(gd, wd)
    assert same_bits(gs, ws)
    if lead:
        assert gs.stride() == (1, lead) and ws.stride() == (1, lead)


def _check(x, rowwise=True, colwise=True, **tuning):
    m, k = x.shape
    got = KT.quantize_fp8_rowwise_colwise(x, rowwise=rowwise, colwise=colwise, **tuning)
    want = KT.quantize_fp8_rowwise_colwise_ref(x, rowwise=rowwise, colwise=colwise)
    _check_pair(got[0], want[0], m)
    _check_pair(got[1], want[1], k)
    return got


def _with_nonfinite(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    if x.numel():
        x.view(-1)[3] = float("nan")
        x.view(-1)[-1] = float("inf")
        x[x.shape[0] // 2, 100] = float("-inf")
    return x


# Per dtype: a huge finite magnitude (near the format's maximum) and a subnormal one.
_HUGE = {torch.bfloat16: 3.0e38, torch.float16: 6.0e4, torch.float32: 3.0e38}
_SUBNORMAL = {torch.bfloat16: 1e-39, torch.float16: 1e-6, torch.float32: 1e-40}


def _special(dtype) -> torch.Tensor:
    """[384, 256] = 3 x 2 tiles of 128 x 128, each stressing one rule in both directions."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(384, 256, generator=g)
    t = lambda i, j: x[128 * i: 128 * (i + 1), 128 * j: 128 * (j + 1)]  # noqa: E731
    a = t(0, 0)                      # gaussian with a NaN row, an Inf column and scattered non-finites
    a[5, :] = float("nan")
    a[:, 7] = float("inf")
    a[9, 9], a[10, 10], a[11, 12] = float("-inf"), float("nan"), -float("nan")
    b = t(0, 1)                      # all zeros, half of them negative
    b.zero_()
    b[:, ::2] = -0.0
    t(1, 0).mul_(_SUBNORMAL[dtype])  # subnormal-only tile
    d = t(1, 1)                      # huge values (one +Inf among them)
    d.copy_(d.sign() * _HUGE[dtype] * torch.rand(128, 128, generator=g).add_(1).div_(2))
    d[64, 64] = float("inf")
    t(2, 0).fill_(float("nan"))      # all NaN: scale 2^-126 both ways, every byte 0x7F
    f = t(2, 1)                      # scale boundaries and underflow next to a row/column maximum
    f.mul_(2.0 ** -12)
    f[:, 0] = 448.0 * 2.0 ** torch.arange(128).remainder(13).sub(6).float()  # exactly on boundaries
    f[0, :] = 448.0 * (1 + 2.0 ** -7)  # just over a boundary: the next scale up
    f[1, 1::3] = 2.0 ** -9 * 448       # 2^-9 under the row maximum, far under the column maximum
    x = x.to(dtype)
    assert torch.isfinite(x[128:256, 128:256]).sum() == 128 * 128 - 1  # the huge values did not overflow
    return x.to(DEVICE)


def _check_all(x):
    """Both outputs against the twin, and the rows against the existing row-wise Triton kernel."""
    (rd, rs), _ = _check(x, **_SWEEP_TUNING)
    kd, ks = _rowwise_kernel(x)
    assert same_bits(rd, kd) and same_bits(rs, ks)


@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize("shape", SHAPES)
def test_shapes(shape, dtype):
    _check_all(_with_nonfinite(make_input(shape, "gaussian", dtype, seed=shape[0] * 31 + shape[1], device=DEVICE)))


@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_input_kinds(kind, dtype):
    # 3 token tiles x 2 column tiles
    _check_all(make_input((384, 256), kind, dtype, seed=INPUT_KINDS.index(kind), device=DEVICE))


@pytest.mark.parametrize("slice_k", [128, 32])
@pytest.mark.parametrize("dtype", HIGH)
def test_special_values_in_both_directions(dtype, slice_k):
    x = _special(dtype)
    (rd, rs), (cd, cs) = _check(x, slice_k=slice_k)
    kd, ks = _rowwise_kernel(x)
    assert same_bits(rd, kd) and same_bits(rs, ks)
    # Spot checks that do not go through the twin: every non-finite element is 0x7F both ways, the
    # all-NaN tile has scale 2^-126 both ways, zeros keep their sign.
    nonfinite = ~torch.isfinite(x.float())
    assert bool((rd.view(torch.uint8)[nonfinite] == 0x7F).all())
    assert bool((cd.view(torch.uint8).t()[nonfinite] == 0x7F).all())
    assert bool((rs[256:, 0] == 2.0 ** -126).all()) and bool((cs[:128, 2] == 2.0 ** -126).all())
    zeros = rd.view(torch.uint8)[:128, 128:]
    assert bool((zeros[:, ::2] == 0x80).all()) and bool((zeros[:, 1::2] == 0).all())


@pytest.mark.parametrize("dtype", HIGH)
def test_rowwise_only_and_colwise_only(dtype):
    x = _with_nonfinite(make_input((384, 256), "outlier_channels", dtype, seed=11, device=DEVICE))
    both = _check(x, **_SWEEP_TUNING)
    rows_only = _check(x, colwise=False)
    cols_only = _check(x, rowwise=False)
    assert rows_only[1] is None and cols_only[0] is None
    _check_pair(rows_only[0], both[0], 384)
    _check_pair(cols_only[1], both[1], 256)
    assert KT.quantize_fp8_rowwise_colwise(x, rowwise=False, colwise=False) == (None, None)


@pytest.mark.parametrize("tiles_k,slice_k,num_warps", [(2, 16, 4), (3, 64, 8), (5, 32, 4), (8, 128, 8)])
def test_tuning(tiles_k, slice_k, num_warps):
    # K/128 = 5: tiles_k 2, 3 are reduced to 1, 5 and 8 to 5 (one program per token tile)
    x = _with_nonfinite(make_input((256, 640), "mixed_magnitudes", torch.bfloat16, seed=tiles_k, device=DEVICE))
    _check(x, tiles_k=tiles_k, slice_k=slice_k, num_warps=num_warps)


def test_zero_sized():
    for shape in [(0, 256), (256, 0), (0, 0)]:
        x = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
        _check(x)


def test_rejects_bad_inputs():
    x = torch.zeros(128, 256, device=DEVICE)
    bad = [
        (TypeError, x.double()),
        (TypeError, x.to(torch.int32)),
        (TypeError, x.to(torch.float8_e4m3fn)),
        (TypeError, [[0.0] * 128] * 128),
        (ValueError, torch.zeros(256, 128, device=DEVICE).t()),          # not contiguous
        (ValueError, torch.zeros(128, 512, device=DEVICE)[:, ::2]),      # not contiguous
        (ValueError, torch.zeros(100, 128, device=DEVICE)),              # M % 128
        (ValueError, torch.zeros(128, 96, device=DEVICE)),               # K % 128
        (ValueError, torch.zeros(128 * 128, device=DEVICE)),             # 1-D
        (ValueError, torch.zeros(2, 128, 128, device=DEVICE)),           # 3-D
    ]
    for exc, arg in bad:
        with pytest.raises(exc, match=NAME):
            KT.quantize_fp8_rowwise_colwise(arg)
        with pytest.raises(exc, match=NAME + "_ref"):
            KT.quantize_fp8_rowwise_colwise_ref(arg)
    for tuning in [{"tiles_k": 0}, {"num_warps": 0}, {"slice_k": 48}, {"slice_k": 256}]:
        with pytest.raises(ValueError, match=NAME):
            KT.quantize_fp8_rowwise_colwise(x, **tuning)


# ---- real sizes on a GPU ------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_moe_size_bf16():
    x = _with_nonfinite(make_input((8192, 7168), "outlier_channels", torch.bfloat16, seed=1, device="cuda"))
    for tuning in [{}, {"slice_k": 128}, {"tiles_k": 4, "slice_k": 64, "num_warps": 4}]:
        (rd, rs), _ = _check(x, **tuning)
        kd, ks = K8.quantize_fp8_rowwise(x)
        assert same_bits(rd, kd) and same_bits(rs, ks)


@pytest.mark.gpu
def test_gpu_ptx_rounding_equals_the_twin_path():
    # Every dtype, the special values (NaN, +-Inf, huge, subnormal) included: asm=True against asm=False.
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for x in (_with_nonfinite(make_input((1024, 2048), "mixed_magnitudes", dtype, seed=2, device="cuda")),
                  _special(dtype).cuda()):
            for tuning in ({}, {"slice_k": 128}):
                ptx = KT.quantize_fp8_rowwise_colwise(x, asm=True, **tuning)
                twin = KT.quantize_fp8_rowwise_colwise(x, asm=False, **tuning)
                m, k = x.shape
                for got, want, lead in ((ptx[0], twin[0], m), (ptx[1], twin[1], k)):
                    _check_pair(got, want, lead)


@pytest.mark.gpu
def test_gpu_int64_offsets_past_2_31_elements():
    # M * K > 2^31 + 2^20: token * K (rows) and column * M (cols) overflow int32 in the last tiles.
    k = 7168
    m = -(-(2**31 + 2**20) // k // 128) * 128 + 128
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    (rd, rs), (cd, cs) = KT.quantize_fp8_rowwise_colwise(x)
    tail = x[m - 128:]
    wr, wc = KT.quantize_fp8_rowwise_colwise_ref(tail)
    assert same_bits(rd[m - 128:], wr[0]) and same_bits(rs[m - 128:], wr[1])
    assert same_bits(cd[:, m - 128:], wc[0]) and same_bits(cs[:, -1:], wc[1])
