"""Test helpers: input generators that stress block quantizers, and oracles independent of the
package's numerics (float64 comparisons, plain torch casts)."""

from __future__ import annotations

import contextlib
import math

import torch

import moe_fp4
import moe_fp4.formats.reference
from moe_fp4.formats import metrics as _metrics
from moe_fp4.kernels.fp8 import quantize_fp8_rowwise_ref

INPUT_KINDS = ("gaussian", "outlier_channels", "tiny", "subnormal", "zero_rows", "mixed_magnitudes")


# ---------------------------------------------------------------------------------------------
# SQNR for tests (docs/testing.md, "Floors, ceilings and the NaN rule"). The library's metrics.sqnr_db
# returns nan for a result holding NaN, and ``nan < floor`` is False: a floor written that way lets a
# NaN gradient through. Every SQNR a test bounds comes from sqnr_db below, and every bound is written
# so that a NaN fails it (``floor <= v <= ceiling``, or in_band / lowest).

def _non_finite(t: torch.Tensor) -> str | None:
    bad = ~torch.isfinite(t.detach())
    n = int(bad.sum())
    if not n:
        return None
    first = tuple(int(i) for i in bad.nonzero()[0]) if t.dim() else ()
    return f"{n} of {t.numel()} values are NaN or Inf (first at {first}: {t.detach()[first].item()})"


def sqnr_db(ref: torch.Tensor, test: torch.Tensor, what: str = "") -> float:
    """moe_fp4.formats.metrics.sqnr_db (dB, float64 sums, inf when equal) that fails with an
    AssertionError when either tensor holds NaN or Inf, instead of returning nan (which every
    ``v < floor`` comparison lets through)."""
    for name, t in (("reference", ref), ("result", test)):
        problem = _non_finite(t)
        assert problem is None, f"SQNR of {what or 'a result'}: the {name} is not finite: {problem}"
    return _metrics.sqnr_db(ref, test)


def in_band(value: float, floor: float, ceiling: float = math.inf, what: str = "") -> float:
    """Assert floor <= value <= ceiling (NaN fails) -> value. The ceiling is how a quantized result
    shows it was quantized at all: the unquantized (or wrongly formatted) path measures far above it."""
    assert floor <= value <= ceiling, (f"{what}: {value!r} dB outside [{floor}, {ceiling}]" if what
                                       else f"{value!r} outside [{floor}, {ceiling}]")
    return value


def sqnr_in_band(ref: torch.Tensor, test: torch.Tensor, floor: float, ceiling: float = math.inf,
                 what: str = "") -> float:
    """sqnr_db(ref, test) (non-finite inputs fail), asserted within [floor, ceiling] -> the dB value."""
    return in_band(sqnr_db(ref, test, what), floor, ceiling, what)


def lowest(values, what: str = "") -> float:
    """min over measured values that fails on NaN (``min`` drops a nan unless it comes first) and on
    an empty sequence (nothing measured is not a pass)."""
    values = list(values)
    assert values, f"{what}: nothing was measured"
    bad = [v for v in values if v != v]
    assert not bad, f"{what}: {len(bad)} of {len(values)} measured values are NaN"
    return min(values)


def highest(values, what: str = "") -> float:
    """max over measured values, failing on NaN and on an empty sequence, like :func:`lowest`."""
    values = list(values)
    assert values, f"{what}: nothing was measured"
    assert all(v == v for v in values), f"{what}: a measured value is NaN: {values}"
    return max(values)


@contextlib.contextmanager
def torch_references():
    """Inside the block moe_fp4 runs its pure-torch reference conversions on CPU tensors instead of the
    Triton kernels under the interpreter, as the ranks spawned by tests/distributed.py do. For tests of what
    the MoE layer or the saved-tensor hook does with the conversions, not of the kernels: every kernel they
    call is checked bit for bit against its reference (test_kernels.py, test_swiglu.py, test_cast_transpose.py,
    test_fp8_colwise.py, test_gemm.py), and the interpreter costs seconds per launch on the 2-core CI machine."""
    from moe_fp4.formats import conversions as api

    before = api._INTERPRET
    api._INTERPRET = False
    try:
        yield
    finally:
        api._INTERPRET = before


def make_input(shape, kind: str, dtype=torch.float32, seed: int = 0, device="cpu") -> torch.Tensor:
    """A tensor of `shape` whose values stress a block quantizer in the way `kind` names."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    k = shape[-1]
    if kind == "outlier_channels":
        cols = torch.randperm(k, generator=g)[: max(1, k // 16)]
        x[..., cols] *= 50.0
    elif kind == "tiny":
        x *= 1e-30
    elif kind == "subnormal":
        # float32 subnormals (and bf16 subnormals, same exponent range) next to tiny normals
        x *= 1e-39 if dtype != torch.float16 else 1e-6
    elif kind == "zero_rows":
        if x.dim() > 1 and x.shape[0] > 0:
            x[::2] = 0.0
    elif kind == "mixed_magnitudes":
        mags = torch.empty(shape).uniform_(-40, 40, generator=g).exp2()
        x *= mags
    elif kind != "gaussian":
        raise ValueError(kind)
    return x.to(dtype).to(device)


def binade_blocks(m: int, k: int, block: int, span: int, g: torch.Generator) -> torch.Tensor:
    """float32 [m, k] N(0, 1) values, each ``block`` consecutive columns of a row scaled by its own 2^e,
    e uniform in [-span, span): blocks over many binades, for quantizer tests."""
    e = torch.randint(-span, span, (m, k // block), generator=g).float()
    return torch.randn(m, k, generator=g) * torch.exp2(e).repeat_interleave(block, dim=1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Raw-byte equality (NaN == NaN when the bits agree; +0 != -0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Value equality where NaN matches NaN and the sign of zero must match."""
    if a.shape != b.shape:
        return False
    a, b = a.double(), b.double()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    a, b = a[~nan_a], b[~nan_b]
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


def pow2_ceil_exponent(amax: float, bound: float) -> int:
    """Smallest integer S with amax <= bound * 2^S, by exact float64 comparisons (independent of
    the package's bit arithmetic)."""
    assert amax > 0 and math.isfinite(amax)
    s = math.ceil(math.log2(amax / bound))
    while amax <= bound * 2.0 ** (s - 1):
        s -= 1
    while amax > bound * 2.0 ** s:
        s += 1
    return s


def dequant_transpose_quantize(q: moe_fp4.MXFP4Tensor):
    """The definition of mxfp4_to_fp8_colwise: exact FP32 dequantize -> transpose -> FP8 1x128 along
    tokens (a short last tile allowed). Pure torch: the dequantize is the reference twin, not the
    kernel (under the interpreter on CPU), so the oracle shares no Triton code with what it checks."""
    x = moe_fp4.formats.reference.dequantize_mxfp4(q, torch.float32).reshape(q.m, q.k)
    return quantize_fp8_rowwise_ref(x.t().contiguous())


def e4m3_byte_values() -> torch.Tensor:
    """float32 [256]: the value of every E4M3 byte 0x00..0xFF (0x7F and 0xFF are NaN)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
