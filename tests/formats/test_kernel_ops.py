"""The kernels as torch.library ops (moe_fp4.formats.kernel_ops): opcheck on every op, on its Triton launcher
(the interpreter on CPU) and on its pure-torch twin; the op's results bit for bit the kernel's; the public
conversions under ``torch.compile(fullgraph=True)`` with no graph break and the eager bits."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import moe_fp4
from moe_fp4.formats import kernel_ops
from moe_fp4.formats.containers import MXFP4Tensor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _x(m=128, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16).to(DEVICE)


def _cases():
    """op name -> its arguments less use_triton (small shapes: the interpreter runs them)."""
    x = _x()
    q, f = moe_fp4.quantize_mxfp4(x), moe_fp4.quantize_fp8(x)
    nv = moe_fp4.quantize_nvfp4(x)
    h = _x(32, 256, seed=1)   # 32 rows: the SwiGLU kernels are the interpreter's slowest
    h_mx = moe_fp4.quantize_mxfp4(h)
    w = torch.rand(32, device=DEVICE)
    rows = torch.randint(0, 128, (128,), device=DEVICE)
    slots = torch.randint(-1, 129, (64, 3), device=DEVICE)
    return {
        "quantize_mxfp4_rowwise": (x,),
        "quantize_mxfp4_stochastic": (x, 7, 1, 2),
        "quantize_mxfp4_from_fp8": (f.data, f.scale),
        "dequantize_mxfp4": (q.data, q.scale, torch.bfloat16),
        "quantize_fp8_rowwise": (x,),
        "mxfp4_to_fp8_rowwise": (q.data, q.scale),
        "quantize_fp8_and_mxfp4": (x,),
        "quantize_fp8_weight_128x128": (x.float().view(1, 128, 256), True, True),
        "transpose_fp8_weight_128x128": (x.float().view(1, 128, 256).to(torch.float8_e4m3fn),),
        "quantize_nvfp4": (x, None, "nearest", 0, 0, 0),
        "quantize_nvfp4_from_fp8": (f.data, f.scale, None, "stochastic", 3, 0, 1),
        "nvfp4_to_fp8_rowwise": (nv.data, nv.scale, nv.tensor_scale),
        "nvfp4_to_fp8_colwise": (nv.data, nv.scale, nv.tensor_scale),
        "dequantize_nvfp4": (nv.data, nv.scale, nv.tensor_scale, torch.float32),
        "mxfp4_to_fp8_colwise": (q.data, q.scale, rows),
        "fp8_to_fp8_colwise": (f.data, f.scale),
        "quantize_fp8_rowwise_colwise": (x, True, False),
        "swiglu_quantize": (h, w, True, True),
        "swiglu_backward": (h_mx.data, _x(32, 128, seed=2), w, h_mx.scale),
        "gather_sum": (x, slots),
    }


CASES = _cases()
# opcheck's schema test compares inputs before and after the call with arithmetic that float8 lacks.
FP8_INPUTS = {n for n, args in CASES.items() if any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn
                                                   for a in args)}


def test_every_op_has_a_case():
    assert set(CASES) == set(kernel_ops._SPECS)


@pytest.mark.parametrize("use_triton", [False, True], ids=["twin", "triton"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name, use_triton):
    utils = ("test_faketensor", "test_aot_dispatch_dynamic") if name in FP8_INPUTS else \
        ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    opcheck(kernel_ops.op(name), (*CASES[name], use_triton), test_utils=utils)


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out if o is not None for t in _flat(o)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_results_are_the_kernels_bits(name):
    module = kernel_ops._SPECS[name][0]
    args = CASES[name]
    for use_triton in (False, True):
        raw = getattr(module, name if use_triton else name + "_ref")
        via = kernel_ops.kernel(module, name, use_triton)
        kw = {}
        if name == "swiglu_backward":
            args, kw = args[:3], {"h_scale": args[3]}
        elif name == "mxfp4_to_fp8_colwise":
            args, kw = args[:2], {"rows": args[2]}
        elif name == "quantize_fp8_weight_128x128":
            args, kw = args[:1], {"write_q": True, "write_t": True}
        elif name == "quantize_fp8_rowwise_colwise":
            args, kw = args[:1], {"rowwise": True, "colwise": False}
        with kernel_ops.through_ops():   # the op itself, as compiled code calls it
            got = via(*args, **kw)
        want = raw(*args, **kw)
        assert [None if o is None else 0 for o in (want if isinstance(want, tuple) else (want,))] == \
            [None if o is None else 0 for o in (got if isinstance(got, tuple) else (got,))]
        for a, b in zip(_flat(want), _flat(got)):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b)
        args = CASES[name]


def _conversions(x):
    q = moe_fp4.quantize_mxfp4(x)
    f = moe_fp4.quantize_fp8(x)
    nv = moe_fp4.quantize_nvfp4(x)
    f2, q2 = moe_fp4.quantize_fp8_and_mxfp4(x)
    return (moe_fp4.dequantize_mxfp4(q), moe_fp4.dequantize_fp8(f), moe_fp4.mxfp4_to_fp8(q).data,
            moe_fp4.mxfp4_to_fp8_colwise(q).data, moe_fp4.fp8_to_fp8_colwise(f).scale,
            moe_fp4.quantize_mxfp4(f).data, moe_fp4.dequantize_nvfp4(nv), moe_fp4.nvfp4_to_fp8(nv).data,
            moe_fp4.quantize_nvfp4(f).data, f2.scale, q2.scale,
            moe_fp4.quantize_mxfp4(x, rounding="stochastic", seed=5).data)


def test_public_conversions_compile_fullgraph_without_breaks_and_keep_their_bits():
    # fullgraph=True: a graph break is an error, not a fallback.
    x = _x(128, 256, seed=4)
    torch._dynamo.reset()
    compiled = torch.compile(_conversions, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(x), _conversions(x)):
        as_bytes = lambda t: t.flatten().contiguous().view(torch.uint8)  # noqa: E731
        assert got.dtype == want.dtype and torch.equal(as_bytes(got), as_bytes(want))


def test_containers_cross_a_compiled_function():
    x = _x(128, 256, seed=6)

    def roundtrip(x):
        q = moe_fp4.quantize_mxfp4(x)
        return MXFP4Tensor(q.data, q.scale, q.shape, q.dtype).dequantize(torch.float32)

    torch._dynamo.reset()
    got = torch.compile(roundtrip, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, roundtrip(x))
