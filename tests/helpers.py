"""Test helpers: input generators that stress block quantizers, and oracles independent of the
package's numerics (float64 comparisons, plain torch casts)."""

from __future__ import annotations

import contextlib
import math

import torch

import moe_fp4
import moe_fp4.formats.reference
from moe_fp4.formats.metrics import sqnr_db  # noqa: F401  (re-exported for the tests)
from moe_fp4.kernels.fp8 import quantize_fp8_rowwise_ref

INPUT_KINDS = ("gaussian", "outlier_channels", "tiny", "subnormal", "zero_rows", "mixed_magnitudes")


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
