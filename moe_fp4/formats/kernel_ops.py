"""Every conversion kernel as a ``torch.library`` op in the ``moe_fp4`` namespace, with a fake implementation.

torch.compile and AOTAutograd trace an op as one node (no graph break, no guard on its values) and run its fake
implementation to learn the outputs' shapes, dtypes and strides; CUDA graphs capture its launch. Each op takes
the kernel's tensors and scalars and a last ``use_triton`` flag: True runs the Triton launcher, False its
pure-torch twin (``name_ref``, the same signature and bits). The fake implementation is the twin itself, run on
fake tensors: the twins are shape-static torch code, so the fake's metadata is the twin's, which the launcher
matches (``torch.library.opcheck`` in tests/formats/test_kernel_ops.py compares them).

Ops return tensors only: a kernel's optional outputs come back as empty tensors and :func:`kernel` (what
:func:`moe_fp4.formats._ops._pick` hands out) gives the kernel's own return structure back, ``None`` included, so
a call site reads the same with or without the op. :func:`kernel` calls the op under torch.compile and on fake
tensors; an eager call on real tensors, and a call with ``out=`` (the exchange's wire buffers, written in
place), go to the launcher directly (the same results, without the op's dispatch).
"""

from __future__ import annotations

import contextlib

import torch

from moe_fp4.kernels import fp8 as _fp8
from moe_fp4.kernels import mxfp4 as _mxfp4
from moe_fp4.kernels import nvfp4 as _nvfp4
from moe_fp4.kernels import row_sum as _row_sum
from moe_fp4.kernels import swiglu as _swiglu
from moe_fp4.kernels import transpose as _transpose
from moe_fp4.kernels.numerics import Rounding

NAMESPACE = "moe_fp4"


def _none() -> torch.Tensor:
    return torch.empty(0)


def _or_none(t: torch.Tensor, present: bool):
    return t if present else None


def _flat_pair(pair, like: torch.Tensor):
    """(data, scale) or None -> two tensors (empty where absent: an op returns tensors only)."""
    if pair is None:
        return like.new_empty(0), like.new_empty(0)
    return pair


# name -> (module, schema of the op's arguments and results, flatten(kernel, use_triton, *args) -> tensors,
# unflatten(outputs, *args) -> the kernel's return value)
_SPECS: dict = {}


def _spec(module, name: str, schema: str, flatten=None, unflatten=None):
    _SPECS[name] = (module, schema, flatten, unflatten)


def _call(module, name: str, use_triton: bool):
    return getattr(module, name if use_triton else name + "_ref")


_spec(_mxfp4, "quantize_mxfp4_rowwise", "(Tensor x, bool use_triton) -> (Tensor, Tensor)")
_spec(_mxfp4, "quantize_mxfp4_stochastic",
      "(Tensor x, int seed, int step, int rank, bool use_triton) -> (Tensor, Tensor)")
_spec(_mxfp4, "quantize_mxfp4_from_fp8", "(Tensor data, Tensor scale, bool use_triton) -> (Tensor, Tensor)")
_spec(_mxfp4, "dequantize_mxfp4", "(Tensor data, Tensor scale, ScalarType dtype, bool use_triton) -> Tensor")
_spec(_fp8, "quantize_fp8_rowwise", "(Tensor x, bool use_triton) -> (Tensor, Tensor)")
_spec(_fp8, "mxfp4_to_fp8_rowwise", "(Tensor data, Tensor scale, bool use_triton) -> (Tensor, Tensor)")
_spec(_fp8, "quantize_fp8_and_mxfp4", "(Tensor x, bool use_triton) -> (Tensor, Tensor, Tensor, Tensor)",
      lambda fn, x: _flat_fp8_and_mxfp4(fn, x),
      lambda out, x: ((out[0], out[1]), (out[2], out[3])))
_spec(_fp8, "quantize_fp8_weight_128x128",
      "(Tensor w, bool write_q, bool write_t, bool use_triton) -> (Tensor, Tensor, Tensor)",
      lambda fn, w, write_q, write_t: _flat_weight(fn, w, write_q, write_t),
      lambda out, w, write_q, write_t: (_or_none(out[0], write_q), _or_none(out[1], write_t), out[2]))
_spec(_fp8, "transpose_fp8_weight_128x128", "(Tensor q, bool use_triton) -> Tensor")
_spec(_nvfp4, "quantize_nvfp4",
      "(Tensor x, Tensor? tensor_scale, str rounding, int seed, int step, int rank, bool use_triton) "
      "-> (Tensor, Tensor, Tensor)")
_spec(_nvfp4, "quantize_nvfp4_from_fp8",
      "(Tensor data, Tensor scale, Tensor? tensor_scale, str rounding, int seed, int step, int rank, "
      "bool use_triton) -> (Tensor, Tensor, Tensor)")
_spec(_nvfp4, "nvfp4_to_fp8_rowwise",
      "(Tensor data, Tensor scale, Tensor tensor_scale, bool use_triton) -> (Tensor, Tensor)")
_spec(_nvfp4, "nvfp4_to_fp8_colwise",
      "(Tensor data, Tensor scale, Tensor tensor_scale, bool use_triton) -> (Tensor, Tensor)")
_spec(_nvfp4, "dequantize_nvfp4",
      "(Tensor data, Tensor scale, Tensor tensor_scale, ScalarType dtype, bool use_triton) -> Tensor")
_spec(_transpose, "mxfp4_to_fp8_colwise",
      "(Tensor data, Tensor scale, Tensor? rows, bool use_triton) -> (Tensor, Tensor)")
_spec(_transpose, "fp8_to_fp8_colwise", "(Tensor data, Tensor scale, bool use_triton) -> (Tensor, Tensor)")
_spec(_transpose, "quantize_fp8_rowwise_colwise",
      "(Tensor x, bool rowwise, bool colwise, bool use_triton) -> (Tensor, Tensor, Tensor, Tensor)",
      lambda fn, x, rowwise, colwise: _flat_rows_cols(fn, x, rowwise, colwise),
      lambda out, x, rowwise, colwise: (_or_none((out[0], out[1]), rowwise), _or_none((out[2], out[3]), colwise)))
_spec(_swiglu, "swiglu_quantize",
      "(Tensor h, Tensor? w, bool write_h_mxfp4, bool write_a_mxfp4, bool use_triton) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
      lambda fn, h, w, write_h, write_a: _flat_swiglu(fn, h, w, write_h, write_a),
      lambda out, h, w, write_h, write_a: ((out[0], out[1]), _or_none((out[2], out[3]), write_a),
                                           _or_none((out[4], out[5]), write_h), None))
_spec(_swiglu, "swiglu_backward",
      "(Tensor h, Tensor da, Tensor? w, Tensor? h_scale, bool use_triton) -> (Tensor, Tensor)",
      lambda fn, h, da, w, h_scale: _flat_swiglu_backward(fn, h, da, w, h_scale),
      lambda out, h, da, w, h_scale: (out[0], _or_none(out[1], w is not None)))
_spec(_row_sum, "gather_sum", "(Tensor rows, Tensor slots, bool use_triton) -> Tensor")


def _flat_fp8_and_mxfp4(fn, x):
    (fd, fs), (md, ms) = fn(x)
    return fd, fs, md, ms


def _flat_weight(fn, w, write_q, write_t):
    q, qt, scale = fn(w, write_q=write_q, write_t=write_t)
    return (q if q is not None else w.new_empty(0, dtype=torch.float8_e4m3fn),
            qt if qt is not None else w.new_empty(0, dtype=torch.float8_e4m3fn), scale)


def _flat_rows_cols(fn, x, rowwise, colwise):
    rows, cols = fn(x, rowwise=rowwise, colwise=colwise)
    return (*_flat_pair(rows, x), *_flat_pair(cols, x))


def _flat_swiglu(fn, h, w, write_h, write_a):
    (fd, fs), a_mx, h_mx, _ = fn(h, w, write_h_mxfp4=write_h, write_a_mxfp4=write_a)
    return fd, fs, *_flat_pair(a_mx, h), *_flat_pair(h_mx, h)


def _flat_swiglu_backward(fn, h, da, w, h_scale):
    dh, dw = fn(h, da, w, h_scale=h_scale) if h_scale is not None else fn(h, da, w)
    return dh, dw if dw is not None else da.new_empty(0, dtype=torch.float32)


def _as_kernel_args(name: str, args: tuple) -> tuple:
    """The op's arguments (less use_triton) -> the kernel's: rounding back to its enum."""
    if name in ("quantize_nvfp4", "quantize_nvfp4_from_fp8"):
        *head, rounding, seed, step, rank = args
        return (*head, Rounding(rounding), seed, step, rank)
    return args


def _clone_aliases(out, args):
    """An op's results may not alias its inputs (a kernel that hands back a given tensor scale, or a view of
    it): those are copied."""
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    seq = out if isinstance(out, tuple) else (out,)
    fixed = tuple(t.clone() if any(torch._C._is_alias_of(t, a) for a in inputs) else t for t in seq)
    return fixed if isinstance(out, tuple) else fixed[0]


def _make_op(name: str):
    module, schema, flatten, _ = _SPECS[name]

    def impl(*args):
        *args, use_triton = args
        fn = _call(module, name, use_triton)
        kargs = _as_kernel_args(name, tuple(args))
        out = flatten(fn, *kargs) if flatten is not None else fn(*kargs)
        return _clone_aliases(tuple(out) if isinstance(out, (tuple, list)) else out, tuple(args))

    def fake(*args):
        return impl(*args[:-1], False)   # the pure-torch twin on fake tensors

    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    return op


# Registered at import: torch.compile traces a call of an op, not its registration.
_OPS = {name: _make_op(name) for name in _SPECS}


def op(name: str):
    """-> the ``moe_fp4::<name>`` op."""
    if name not in _OPS:
        raise KeyError(f"moe_fp4 has no kernel op {name!r}; ops: {', '.join(sorted(_OPS))}")
    return _OPS[name]


def kernel(module, name: str, use_triton: bool):
    """-> a callable with the signature and return value of ``module.<name>`` (use_triton) or its twin: through
    the op where there is one under torch.compile, on fake tensors and inside :func:`through_ops`; the function
    itself otherwise (an eager call, an ``out=`` call, a kernel without an op)."""
    if name not in _SPECS or _SPECS[name][0] is not module:
        return _call(module, name, use_triton)
    unflatten = _SPECS[name][3]
    raw = _call(module, name, use_triton)

    def call(*args, **kwargs):
        # Eager calls on real tensors go to the kernel itself: the op's dispatch costs host time (about 10 us
        # a call on the CI machine) and the results are the same. Under torch.compile, and on the fake
        # tensors an op's fake implementation runs on, the op.
        if kwargs.get("out") is not None or not (_THROUGH_OPS or torch.compiler.is_compiling() or _is_fake(args)):
            return raw(*args, **kwargs)
        args = _bind(name, args, kwargs)
        out = _OPS[name](*args, use_triton)
        return unflatten(out, *args) if unflatten is not None else out

    return call


_THROUGH_OPS: list = []   # non-empty inside through_ops()


@contextlib.contextmanager
def through_ops():
    """Inside the ``with`` block eager calls go through the ops too (as compiled code calls them)."""
    _THROUGH_OPS.append(True)
    try:
        yield
    finally:
        _THROUGH_OPS.pop()


def _is_fake(args) -> bool:
    return any(isinstance(a, torch.Tensor) and torch._subclasses.fake_tensor.is_fake(a) for a in args)


# The op's positional arguments (less use_triton) from a kernel-style call: defaults and keywords filled in.
_DEFAULTS = {
    "quantize_mxfp4_stochastic": (("seed", None), ("step", 0), ("rank", 0)),
    "quantize_fp8_weight_128x128": (("write_q", True), ("write_t", False)),
    "quantize_nvfp4": (("tensor_scale", None), ("rounding", Rounding.NEAREST), ("seed", 0), ("step", 0),
                       ("rank", 0)),
    "quantize_nvfp4_from_fp8": (("tensor_scale", None), ("rounding", Rounding.NEAREST), ("seed", 0), ("step", 0),
                                ("rank", 0)),
    "mxfp4_to_fp8_colwise": (("rows", None),),
    "quantize_fp8_rowwise_colwise": (("rowwise", True), ("colwise", True)),
    "swiglu_quantize": (("w", None), ("write_h_mxfp4", False), ("write_a_mxfp4", False)),
    "swiglu_backward": (("w", None), ("h_scale", None)),
}
_TENSOR_ARGS = {"quantize_mxfp4_stochastic": 1, "quantize_fp8_weight_128x128": 1, "quantize_nvfp4": 1,
                "quantize_nvfp4_from_fp8": 2, "mxfp4_to_fp8_colwise": 2, "quantize_fp8_rowwise_colwise": 1,
                "swiglu_quantize": 1, "swiglu_backward": 2}


def _bind(name: str, args: tuple, kwargs: dict) -> tuple:
    if name not in _DEFAULTS:
        if kwargs:
            raise TypeError(f"moe_fp4::{name}: unexpected keywords {sorted(kwargs)}")
        return args
    head = _TENSOR_ARGS[name]
    names = _DEFAULTS[name]
    rest = list(args[head:]) + [None] * (len(names) - len(args[head:]))
    out = list(args[:head])
    for i, (key, default) in enumerate(names):
        value = kwargs.pop(key, rest[i] if i < len(args) - head else default)
        if isinstance(value, Rounding):
            value = value.value
        out.append(value)
    if kwargs:
        raise TypeError(f"moe_fp4::{name}: unexpected keywords {sorted(kwargs)}")
    return tuple(out)


__all__ = ["NAMESPACE", "kernel", "op", "through_ops"]
