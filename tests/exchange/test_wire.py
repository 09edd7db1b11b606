"""The all-to-all wire format (moe_fp4.exchange.wire): pack -> unpack equals the direct API conversion bit for
bit, for every wire format and every output, on plain, special-value and empty inputs; row sizes;
containers travel unchanged; a wider ``out`` buffer keeps its extra columns. Single process. The
stochastic formats are packed right after ``seed_stochastic_rounding(SR_SEED)`` (``_pack``), so their
bytes are the quantizers' at (SR_SEED, step 0, rank 0)."""

from __future__ import annotations

import pytest
import torch
from helpers import INPUT_KINDS, make_input, same_bits, torch_references

import moe_fp4
from moe_fp4.exchange.wire import (
    HIDDEN_MULTIPLE,
    OutputFormat,
    WireFormat,
    row_bytes,
    seed_stochastic_rounding,
    unpack,
    views,
)
from moe_fp4.exchange.wire import pack as _wire_pack

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROWS, HIDDEN = 6, 256   # small: the kernels run in the Triton interpreter on CPU
FILL = 0xA5             # marker byte for columns pack must not touch
SR_SEED = 17
SR = {"rounding": "stochastic", "seed": SR_SEED, "step": 0, "rank": 0}


def pack(x, fmt, out=None):
    """wire.pack at step 0 of the stochastic formats' count (each call draws the same bits)."""
    seed_stochastic_rounding(SR_SEED)
    return _wire_pack(x, fmt, out=out)


def _special(x: torch.Tensor) -> torch.Tensor:
    """x [6, 256] with a NaN block, +Inf and -Inf values, an all-zero block and an all-zero tile."""
    x = x.clone()
    x[1, :32] = float("nan")
    x[2, 40] = float("inf")
    x[3, 200] = -float("inf")
    x[4, 128:160] = 0.0
    x[5, :128] = 0.0
    return x


def _input(kind: str, dtype, seed: int = 0) -> torch.Tensor:
    if kind == "special":
        return _special(make_input((ROWS, HIDDEN), "gaussian", dtype, seed))
    return make_input((ROWS, HIDDEN), kind, dtype, seed)


def _container_bytes(c) -> torch.Tensor:
    """A container's rows in the DESIGN wire layout: [codes | scales] (FP8 scales as float32 bytes; NVFP4:
    [codes | E4M3 scales | the tensor scale's 4 bytes])."""
    if isinstance(c, moe_fp4.MXFP4Tensor):
        return torch.cat([c.data, c.scale], dim=1)
    if isinstance(c, moe_fp4.NVFP4Tensor):
        s_t = c.tensor_scale.reshape(1).view(torch.uint8).expand(c.data.shape[0], 4)
        return torch.cat([c.data, c.scale.view(torch.uint8), s_t], dim=1)
    return torch.cat([c.data.view(torch.uint8), c.scale.contiguous().view(torch.uint8)], dim=1)


def _wire_bytes(fmt: WireFormat, x: torch.Tensor) -> torch.Tensor:
    """The wire rows as the DESIGN table defines them, assembled from the API's containers (its pure-torch
    twins, helpers.torch_references: on CPU only pack / unpack run the kernels in the interpreter)."""
    with torch_references():
        if fmt in (WireFormat.MXFP4, WireFormat.NVFP4, WireFormat.MXFP4_SR, WireFormat.NVFP4_SR):
            return _container_bytes(_fp4(fmt, x))
        if fmt is WireFormat.FP8:
            return _container_bytes(moe_fp4.quantize_fp8(x))
        if fmt is WireFormat.BF16:
            return x.to(torch.bfloat16).contiguous().view(torch.uint8)   # the values rounded to bfloat16
        return x.contiguous().view(torch.uint8)                           # native: the tensor's own bytes


def _direct(fmt: WireFormat, output: OutputFormat, x: torch.Tensor):
    """What a receiver of x sent in ``fmt`` should hold as ``output``, by the public API alone (its
    pure-torch twins, as in _wire_bytes)."""
    with torch_references():
        return _direct_api(fmt, output, x)


def _fp4(fmt: WireFormat, x: torch.Tensor):
    """The container a 4-bit wire format sends for x (stochastic: at SR_SEED, step 0, rank 0)."""
    quant = moe_fp4.quantize_nvfp4 if fmt in (WireFormat.NVFP4, WireFormat.NVFP4_SR) else moe_fp4.quantize_mxfp4
    return quant(x, **SR) if fmt in (WireFormat.MXFP4_SR, WireFormat.NVFP4_SR) else quant(x)


def _direct_api(fmt: WireFormat, output: OutputFormat, x: torch.Tensor):
    if fmt in (WireFormat.MXFP4, WireFormat.MXFP4_SR):
        q = _fp4(fmt, x)
        return {OutputFormat.BF16: lambda: q.dequantize(), OutputFormat.FP8: lambda: moe_fp4.mxfp4_to_fp8(q),
                OutputFormat.MXFP4: lambda: q}[output]()
    if fmt in (WireFormat.NVFP4, WireFormat.NVFP4_SR):
        if output is OutputFormat.FP8:
            return moe_fp4.nvfp4_to_fp8(_fp4(fmt, x))   # one conversion of the float32 values (rule 6)
        x = _fp4(fmt, x).dequantize()          # what arrives: the NVFP4 values in the tensor's dtype
    if fmt is WireFormat.FP8:
        f = moe_fp4.quantize_fp8(x)
        return {OutputFormat.BF16: lambda: f.dequantize(), OutputFormat.FP8: lambda: f,
                OutputFormat.MXFP4: lambda: moe_fp4.quantize_mxfp4(f)}[output]()
    if fmt is WireFormat.BF16:
        x = x.to(torch.bfloat16).to(x.dtype)   # what arrives: the bfloat16 values in the tensor's dtype
    return {OutputFormat.BF16: lambda: x, OutputFormat.FP8: lambda: moe_fp4.quantize_fp8(x),
            OutputFormat.MXFP4: lambda: moe_fp4.quantize_mxfp4(x)}[output]()


def assert_same_output(got, want, output: OutputFormat, dtype):
    if output is OutputFormat.BF16:
        assert isinstance(got, torch.Tensor) and got.dtype == dtype
        assert same_bits(got, want)
        return
    cls = moe_fp4.MXFP4Tensor if output is OutputFormat.MXFP4 else moe_fp4.FP8BlockTensor
    assert isinstance(got, cls) and isinstance(want, cls)
    assert tuple(got.shape) == tuple(want.shape) and got.dtype == want.dtype == dtype
    assert same_bits(got.data, want.data)
    assert same_bits(got.scale, want.scale)


@pytest.mark.parametrize("output", list(OutputFormat), ids=lambda o: o.value)
@pytest.mark.parametrize("fmt", list(WireFormat), ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", (*INPUT_KINDS, "special"))
def test_pack_unpack_equals_the_direct_conversion(kind, dtype, fmt, output):
    x = _input(kind, dtype, seed=INPUT_KINDS.index(kind) if kind in INPUT_KINDS else 99)
    wire = pack(x, fmt)
    assert wire.dtype == torch.uint8 and tuple(wire.shape) == (ROWS, row_bytes(fmt, HIDDEN, dtype))
    assert same_bits(wire, _wire_bytes(fmt, x)), "the layout is [codes | scales] per row"
    assert_same_output(unpack(wire, fmt, HIDDEN, output, dtype), _direct(fmt, output, x), output, dtype)


def test_row_bytes_match_design():
    # DESIGN's table for a 7168 hidden size (bf16 values).
    assert row_bytes(WireFormat.MXFP4, 7168) == 3808
    assert row_bytes(WireFormat.FP8, 7168) == 7392
    assert row_bytes(WireFormat.BF16, 7168) == 14336
    for dtype in DTYPES:
        # bf16 means bfloat16 on the wire whatever the dtype; native sends the dtype's own bytes
        assert row_bytes("bf16", 7168, dtype) == 7168 * 2
        assert row_bytes("native", 7168, dtype) == 7168 * dtype.itemsize
        # mxfp4 / fp8 rows do not depend on the source dtype
        assert row_bytes("mxfp4", 7168, dtype) == 3808 and row_bytes("fp8", 7168, dtype) == 7392
    for h in (128, 256, 384, 7168):
        q, f = moe_fp4.quantize_mxfp4(torch.ones(1, h)), moe_fp4.quantize_fp8(torch.ones(1, h))
        assert row_bytes("mxfp4", h) == q.nbytes and row_bytes("fp8", h) == f.nbytes
    assert HIDDEN_MULTIPLE == {WireFormat.MXFP4: 32, WireFormat.FP8: 128, WireFormat.BF16: 1, WireFormat.NATIVE: 1,
                               WireFormat.NVFP4: 16, WireFormat.MXFP4_SR: 32, WireFormat.NVFP4_SR: 16}
    assert row_bytes("nvfp4", 7168) == row_bytes("nvfp4-sr", 7168) == moe_fp4.quantize_nvfp4(torch.ones(1, 7168)).nbytes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ("gaussian", "special"))
def test_packing_a_container_sends_its_bytes(kind, dtype):
    x = _input(kind, dtype, seed=3)
    q, f = moe_fp4.quantize_mxfp4(x), moe_fp4.quantize_fp8(x)
    # A container of the wire's own format: its bytes, unchanged.
    assert same_bits(pack(q, "mxfp4"), _container_bytes(q))
    assert same_bits(pack(f, "fp8"), _container_bytes(f))
    # Round trip through the wire returns the same container bit for bit.
    assert_same_output(unpack(pack(q, "mxfp4"), "mxfp4", HIDDEN, "mxfp4", dtype), q, OutputFormat.MXFP4, dtype)
    assert_same_output(unpack(pack(f, "fp8"), "fp8", HIDDEN, "fp8", dtype), f, OutputFormat.FP8, dtype)
    # Another format: the direct conversions (FP8 -> MXFP4 on codes, MXFP4 -> FP8), or the values.
    assert same_bits(pack(f, "mxfp4"), _container_bytes(moe_fp4.quantize_mxfp4(f)))
    assert same_bits(pack(q, "fp8"), _container_bytes(moe_fp4.mxfp4_to_fp8(q)))
    assert same_bits(pack(q, "native"), q.dequantize().view(torch.uint8))
    assert same_bits(pack(f, "native"), f.dequantize().view(torch.uint8))
    assert same_bits(pack(q, "bf16"), q.dequantize().to(torch.bfloat16).view(torch.uint8))


@pytest.mark.parametrize("fmt", list(WireFormat), ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("source", ("float", "mxfp4", "fp8"))
def test_pack_into_a_wider_buffer_leaves_the_extra_columns(source, dtype, fmt):
    x = _input("special", dtype, seed=4)
    src = {"float": x, "mxfp4": moe_fp4.quantize_mxfp4(x), "fp8": moe_fp4.quantize_fp8(x)}[source]
    width = row_bytes(fmt, HIDDEN, dtype)
    extra = 12   # keeps the row stride a multiple of 4 (fp8 scale views) and of every itemsize
    out = torch.full((ROWS, width + extra), FILL, dtype=torch.uint8)
    got = pack(src, fmt, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == out.shape
    assert same_bits(out[:, :width], pack(src, fmt))
    assert bool((out[:, width:] == FILL).all()), "pack wrote past the row's payload"
    # unpack reads the payload columns of the wide rows (the EP layer appends routing data there)
    for output in OutputFormat:
        assert_same_output(unpack(out, fmt, HIDDEN, output, dtype), unpack(pack(src, fmt), fmt, HIDDEN, output, dtype),
                           output, dtype)


@pytest.mark.parametrize("output", list(OutputFormat), ids=lambda o: o.value)
@pytest.mark.parametrize("fmt", list(WireFormat), ids=lambda f: f.value)
def test_zero_rows(fmt, output):
    x = torch.empty(0, HIDDEN, dtype=torch.bfloat16)
    wire = pack(x, fmt)
    assert tuple(wire.shape) == (0, row_bytes(fmt, HIDDEN)) and wire.dtype == torch.uint8
    got = unpack(wire, fmt, HIDDEN, output, torch.bfloat16)
    assert_same_output(got, _direct(fmt, output, x), output, torch.bfloat16)
    if output is OutputFormat.BF16:
        assert tuple(got.shape) == (0, HIDDEN)
    else:
        assert got.m == 0 and got.k == HIDDEN


def test_views_are_strided_windows_of_the_rows():
    x = _input("gaussian", torch.bfloat16, seed=5)
    wire = pack(x, "fp8")
    codes, scales = views(wire, "fp8", HIDDEN)
    f = moe_fp4.quantize_fp8(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert codes.data_ptr() == wire.data_ptr() and scales.data_ptr() == wire.data_ptr() + HIDDEN
    assert same_bits(codes, f.data) and same_bits(scales, f.scale)
    d, s = views(pack(x, "mxfp4"), "mxfp4", HIDDEN)
    q = moe_fp4.quantize_mxfp4(x)
    assert same_bits(d, q.data) and same_bits(s, q.scale)
    values, none = views(pack(x, "bf16"), "bf16", HIDDEN)
    assert none is None and same_bits(values, x)


def test_unpack_rejects_an_integer_dtype():
    wire = pack(_input("gaussian", torch.bfloat16), "mxfp4")
    with pytest.raises(TypeError, match="dtype must be bfloat16, float16 or float32"):
        unpack(wire, "mxfp4", HIDDEN, "bf16", torch.int32)


@pytest.mark.parametrize("dtype", (torch.float16, torch.float32), ids=str)
def test_bf16_wire_sends_bfloat16_and_native_the_dtype(dtype):
    # Issue 28: "bf16" on the wire means bfloat16 whatever the tensor's dtype, rounded to nearest even
    # (1 + 2^-8 is a tie between 1 and 1 + 2^-7: it goes to the even 1.0; 1 + 3 * 2^-9 rounds up), and
    # the receiver gets its own dtype back; "native" sends the dtype's bytes unchanged.
    x = _input("gaussian", dtype, seed=6)
    x[0, :3] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -9, -(1 + 2 ** -8)], dtype=dtype)
    wire = pack(x, "bf16")
    assert tuple(wire.shape) == (ROWS, 2 * HIDDEN)
    values, _ = views(wire, "bf16", HIDDEN, dtype)
    assert values.dtype == torch.bfloat16
    assert values[0, :3].tolist() == [1.0, 1 + 2 ** -7, -1.0]
    back = unpack(wire, "bf16", HIDDEN, "bf16", dtype)
    assert back.dtype == dtype and same_bits(back, x.to(torch.bfloat16).to(dtype))
    native = pack(x, "native")
    assert tuple(native.shape) == (ROWS, HIDDEN * dtype.itemsize)
    assert same_bits(unpack(native, "native", HIDDEN, "bf16", dtype), x)
