"""The grouped SwiGLU experts as an op pair for torch.compile: ``moe_fp4::experts_forward`` and
``moe_fp4::experts_backward``, differentiable through ``torch.library.register_autograd``.

Under torch.compile, :func:`moe_fp4.model.experts.grouped_swiglu_experts` calls :func:`experts` instead of its
autograd Function: Dynamo then sees two opaque nodes, and what the experts keep for backward (FP8, MXFP4 or
NVFP4 activations, each a few tensors) are outputs of the forward op that ``setup_context`` saves, so
AOTAutograd's partitioner and activation checkpointing see them as the saved tensors they are. Both ops run the
Function's own forward and backward bodies (the same kernels in the same order, so the compiled experts give
the eager bits); their fake implementations run the same bodies on fake tensors, where every kernel is an op
with a fake of its own. The FP8 weights come in as explicit tensors: the compiled region quantizes W instead of
looking it up in the process's cache, which keys on storage addresses; W^T comes in only when the caller made it,
else the backward op transposes W's codes, as the eager backward does.

The op pair takes device counts (an int tensor [E]): under compile nothing reads them on the host. Saved tensors
that are the forward's own inputs (the router weights, a kept FP8 input as received) are returned as copies: an
op's outputs may not alias its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_fp4.formats.containers import FP8BlockTensor, MXFP4Tensor
from moe_fp4.gemm.engines import FP8WeightTensor, quantize_fp8_weight
from moe_fp4.saved.hook import StorageFormat

_FUNCTION: list = []     # the experts' autograd Function (moe_fp4.model.experts registers it)
# (recipe, kept tensors' dtypes and ranks) -> the Function's kept specs without their shapes: static for a
# recipe, whatever the rows (symbolic under dynamic shapes, which a dict key cannot hold); the forward (real
# or fake) records them, the backward reads them and takes each container's shape from its data.
_SPECS: dict = {}


def _spec_key(recipe: str, kept) -> tuple:
    return recipe, tuple((t.dtype, t.dim()) for t in kept)


def _shapeless(specs) -> tuple:
    """The kept specs with each container's logical shape left out (every kept container is [R, K]: its
    shape follows from its data, :func:`_shaped`)."""
    out = []
    for name, spec in specs:
        if spec is not None and spec[0] is not None:
            (cls, other, names), n = spec
            spec = (cls, {k: v for k, v in other.items() if k != "shape"}, names), n
        out.append((name, spec))
    return tuple(out)


def _shaped(specs, kept) -> list:
    """:func:`_shapeless`'s specs with the shapes put back from the kept tensors: [R, K] with R the data's
    rows and K its columns (twice them for packed E2M1 codes, uint8 data)."""
    out, i = [], 0
    for name, spec in specs:
        if spec is not None and spec[0] is not None:
            (cls, other, names), n = spec
            data = kept[i + names.index("data")]
            k = data.shape[1] * (2 if data.dtype == torch.uint8 else 1)
            spec = (cls, {**other, "shape": torch.Size((data.shape[0], k))}, names), n
        out.append((name, spec))
        i += 0 if spec is None else spec[1]
    return out


@dataclass(frozen=True)
class Recipe:
    """What the experts' forward runs and keeps: precision, storage, recompute_swiglu and the kinds of the
    optional inputs (x_q: "" | "fp8" | "mxfp4"; x_saved with or without rows). Serialized for the ops' schema."""

    precision: str
    storage: str
    recompute_swiglu: bool
    x_q: str = ""
    x_saved: bool = False
    x_saved_rows: bool = False

    def __post_init__(self):
        if self.x_q not in ("", "fp8", "mxfp4"):
            raise ValueError(f"Recipe: x_q must be '', 'fp8' or 'mxfp4', got {self.x_q!r}")
        if self.x_saved_rows and not self.x_saved:
            raise ValueError("Recipe: x_saved_rows goes with x_saved")

    def encode(self) -> str:
        return "|".join((self.precision, self.storage, str(int(self.recompute_swiglu)), self.x_q,
                         str(int(self.x_saved)), str(int(self.x_saved_rows))))

    @staticmethod
    def decode(text: str) -> "Recipe":
        p, s, r, xq, xs, xr = text.split("|")
        return Recipe(p, s, r == "1", xq, xs == "1", xr == "1")


class _Ctx:
    """The stand-in ctx the Function's bodies write to and read from outside autograd."""

    def __init__(self, saved=(), needs=()):
        self.saved_tensors = tuple(saved)
        self.needs_input_grad = tuple(needs)

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _container(kind: str, data, scale):
    if kind == "":
        return None
    cls = MXFP4Tensor if kind == "mxfp4" else FP8BlockTensor
    k = data.shape[1] * (2 if kind == "mxfp4" else 1)
    return cls(data, scale, (data.shape[0], k), torch.bfloat16)


def _forward_impl(x, w13, w2, w13q, w13q_scale, w13t, w13t_scale, w2q, w2q_scale, w2t, w2t_scale, row_w, counts,
                  xq_data, xq_scale, xs_data, xs_scale, xs_rows, recipe):
    r = Recipe.decode(recipe)
    ctx = _Ctx()
    pairs = ((FP8WeightTensor(w13q, w13q_scale), _optional(w13t, w13t_scale)),
             (FP8WeightTensor(w2q, w2q_scale), _optional(w2t, w2t_scale)))
    fn = _FUNCTION[0]
    y = fn.forward(ctx, x, w13, w2, row_w, counts, fn.precision_of(r.precision), _container(r.x_q, xq_data, xq_scale),
                   r.recompute_swiglu, StorageFormat(r.storage), _container("mxfp4" if r.x_saved else "", xs_data,
                                                                            xs_scale), xs_rows, None, pairs)
    kept = ctx.saved_tensors[ctx.kept_head:]
    _SPECS[_spec_key(recipe, kept)] = _shapeless(ctx.kept_specs)
    inputs = [t for t in (x, row_w, xq_data, xq_scale, xs_data, xs_scale, xs_rows) if t is not None]
    out = [t.clone() if any(torch._C._is_alias_of(t, i) for i in inputs) else t for t in kept]
    return [y, *out]


def _optional(data, scale) -> FP8WeightTensor | None:
    return None if data is None else FP8WeightTensor(data, scale)


def _backward_impl(dy, w13, w2, w13q, w13q_scale, w13t, w13t_scale, w2q, w2q_scale, w2t, w2t_scale, counts, kept,
                   recipe, needs):
    r = Recipe.decode(recipe)
    fn = _FUNCTION[0]
    ctx = _Ctx((w13, w2, *kept), (*needs, *([False] * 9)))
    ctx.kept_specs = _shaped(_SPECS[_spec_key(recipe, kept)], kept)
    ctx.kept_head = 2
    ctx.precision, ctx.counts, ctx.grad_slot = fn.precision_of(r.precision), counts, None
    ctx.w13t, ctx.w2t = _optional(w13t, w13t_scale), _optional(w2t, w2t_scale)
    ctx.w13q = FP8WeightTensor(w13q, w13q_scale) if ctx.w13t is None else None
    ctx.w2q = FP8WeightTensor(w2q, w2q_scale) if ctx.w2t is None else None
    ctx.offs = fn.bf16_offsets(counts, dy.device) if r.precision == "bf16" else None
    dx, dw13, dw2, d_row = fn.backward(ctx, dy)[:4]
    return [dx if dx is not None else dy.new_empty(0), dw13 if dw13 is not None else w13.new_empty(0),
            dw2 if dw2 is not None else w2.new_empty(0),
            d_row if d_row is not None else dy.new_empty(0, dtype=torch.float32)]


_forward_op = torch.library.custom_op(
    "moe_fp4::experts_forward", _forward_impl, mutates_args=(),
    schema="(Tensor x, Tensor w13, Tensor w2, Tensor w13q, Tensor w13q_scale, Tensor? w13t, Tensor? w13t_scale, "
           "Tensor w2q, Tensor w2q_scale, Tensor? w2t, Tensor? w2t_scale, Tensor? row_w, Tensor counts, "
           "Tensor? xq_data, Tensor? xq_scale, Tensor? xs_data, Tensor? xs_scale, Tensor? xs_rows, str recipe) "
           "-> Tensor[]")
_forward_op.register_fake(_forward_impl)
_backward_op = torch.library.custom_op(
    "moe_fp4::experts_backward", _backward_impl, mutates_args=(),
    schema="(Tensor dy, Tensor w13, Tensor w2, Tensor? w13q, Tensor? w13q_scale, Tensor? w13t, Tensor? w13t_scale, "
           "Tensor? w2q, Tensor? w2q_scale, Tensor? w2t, Tensor? w2t_scale, Tensor counts, Tensor[] kept, str recipe, "
           "bool[] needs) -> Tensor[]")
_backward_op.register_fake(_backward_impl)


def _setup_context(ctx, inputs, output):
    (x, w13, w2, w13q, w13q_scale, w13t, w13t_scale, w2q, w2q_scale, w2t, w2t_scale, row_w, counts, *_,
     recipe) = inputs
    ctx.recipe, ctx.n_kept, ctx.has_row_w = recipe, len(output) - 1, row_w is not None
    # Backward reads W only where W^T was not given (it transposes W's codes then): W is not kept otherwise.
    if w13t is not None:
        w13q = w13q_scale = None
    if w2t is not None:
        w2q = w2q_scale = None
    ctx.save_for_backward(w13, w2, w13q, w13q_scale, w13t, w13t_scale, w2q, w2q_scale, w2t, w2t_scale, counts,
                          *output[1:])


def _backward(ctx, grads):
    w13, w2, *weights, counts = ctx.saved_tensors[:11]
    kept = list(ctx.saved_tensors[11:])
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    dx, dw13, dw2, d_row = _backward_op(grads[0], w13, w2, *weights, counts, kept, ctx.recipe, needs)
    pick = lambda t, need: t if need else None  # noqa: E731
    return (pick(dx, needs[0]), pick(dw13, needs[1]), pick(dw2, needs[2]), *([None] * 8),
            d_row if ctx.has_row_w and ctx.needs_input_grad[11] else None, *([None] * 7))


torch.library.register_autograd("moe_fp4::experts_forward", _backward, setup_context=_setup_context)


def experts(x, w13, w2, row_w, counts: torch.Tensor, recipe: Recipe, x_q=None, x_saved=None, x_saved_rows=None,
            pairs=None):
    """grouped_swiglu_experts' arguments (already checked; device counts) -> bf16 [R, H], through the op pair.
    The FP8 weights are ``pairs`` when given (W^T may be None: the backward op transposes W), else W made here,
    in the caller's graph."""
    if recipe.precision == "bf16":
        pairs = (_placeholder(w13), None), (_placeholder(w2), None)
    elif pairs is None:
        pairs = (quantize_fp8_weight(w13), None), (quantize_fp8_weight(w2), None)
    (w13q, w13t), (w2q, w2t) = pairs
    out = _forward_op(x, w13, w2, w13q.data, w13q.scale, *_parts(w13t), w2q.data, w2q.scale, *_parts(w2t),
                      row_w, counts, None if x_q is None else x_q.data, None if x_q is None else x_q.scale,
                      None if x_saved is None else x_saved.data, None if x_saved is None else x_saved.scale,
                      x_saved_rows, recipe.encode())
    return out[0]


def _parts(t: FP8WeightTensor | None) -> tuple:
    return (None, None) if t is None else (t.data, t.scale)


def _placeholder(w: torch.Tensor) -> FP8WeightTensor:
    """bf16 precision reads no FP8 weights: a 1x1 block of zeros in their place (the schema's tensors)."""
    return FP8WeightTensor(torch.zeros(*w.shape[:-2], 1, 1, dtype=torch.float8_e4m3fn, device=w.device),
                           torch.ones(*w.shape[:-2], 1, 1, device=w.device))


__all__ = ["Recipe", "experts"]
