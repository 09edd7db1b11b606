"""FSDP2 all-gathers of expert weights in FP8: 128x128-block codes and scales instead of bf16.

:class:`FP8GatherWeight` wraps a sharded expert weight (the master, any float dtype) as FSDP2's sharded local
tensor. Its ``fsdp_pre_all_gather`` quantizes the local shard to W's FP8 codes (uint8) and float32 block scales;
the all-gather sends those (1 byte a parameter and 4 bytes per 128x128 block, against bf16's 2 bytes a
parameter); its ``fsdp_post_all_gather`` makes the unsharded parameter a :class:`GatheredFP8Weight`, which holds
only W's codes and scales while FSDP keeps the layer unsharded. The experts read it as their FP8 weight
(:meth:`moe_fp4.gemm.engines.FP8WeightCache.weight` returns it without quantizing), and the gradient they make
for it is a plain tensor of the parameter's dtype, which FSDP reduce-scatters as before.

Exact: each block's scale depends on its own 128 x 128 values only, so quantizing each shard gives the codes and
scales that quantizing the unsharded weight gives, provided the shards split the weight at block boundaries.
``Shard(0)`` over experts always does; an uneven split (experts not divisible by the shards), a weight whose last
two dimensions are not multiples of 128 and any other placement gather in the parameter dtype instead (said once
per reason, as a warning). Under FSDP's mixed precision the shard is cast to ``param_dtype`` before it is
quantized, as the unsharded layer would quantize the cast weight.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils import _pytree as pytree

from moe_fp4.gemm.engines import WEIGHT_BLOCK, FP8WeightTensor, quantize_fp8_weight

# FSDP2 shards, pads, copies and moves the sharded tensor with these ops: their results stay wrapped, so the
# padded local shard FSDP all-gathers from is an FP8GatherWeight too.
_PRESERVED = {
    torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default, torch.ops.aten.alias.default,
}
_WARNED: set = set()


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"moe_fp4 FP8 all-gather: {reason}; this weight is all-gathered in its own dtype", stacklevel=3)


class FP8GatherWeight(torch.Tensor):
    """A sharded expert weight [E_shard, N, K] (FSDP2's local tensor) whose all-gather sends FP8.

    Behaves as the wrapped tensor (the optimizer steps it in place); only FSDP2's all-gather extension differs.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def __repr__(self):
        return f"FP8GatherWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return FP8GatherWeight(args[0]._tensor.detach())
        args, kwargs = pytree.tree_map_only(FP8GatherWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVED:
            return out
        return pytree.tree_map_only(torch.Tensor, FP8GatherWeight, out)

    def __reduce_ex__(self, protocol):
        # Saved (torch.save, DCP) as the plain tensor it wraps: a checkpoint holds the master weights alone, loads
        # without moe_fp4 and under weights_only, and loads back into a wrapped parameter through copy_.
        return self._tensor.__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, _meta, _outer_size, _outer_stride):
        return FP8GatherWeight(inner["_tensor"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """-> ((codes uint8 [E_shard, N, K], scales float32 [E_shard, N/128, K/128]), ("fp8",)), or
        ((the shard in the parameter dtype,), ("native",)) where the FP8 gather would not be exact."""
        w = self._tensor
        dtype = getattr(mp_policy, "param_dtype", None) or w.dtype
        reason = None
        if w.dim() != 3 or len(outer_size) != 3:
            reason = f"a [E, N, K] expert weight is expected, got a shape of {tuple(outer_size)}"
        elif outer_size[-1] % WEIGHT_BLOCK or outer_size[-2] % WEIGHT_BLOCK:
            reason = f"N and K of {tuple(outer_size)} are not multiples of {WEIGHT_BLOCK}"
        elif tuple(w.shape[1:]) != tuple(outer_size[1:]) or outer_size[0] % mesh.size():
            reason = (f"the shards of {tuple(outer_size)} over {mesh.size()} ranks are not whole experts of equal "
                      f"count (the placement must be Shard(0) with E divisible by the shards)")
        if reason is not None:
            _warn_once(reason)
            # FSDP pads dim 0 to equal shards; a short (or empty) dim-0 shard sends its padded size
            rows = -(-outer_size[0] // mesh.size())
            w = w.to(dtype)
            if w.dim() == len(outer_size) and tuple(w.shape[1:]) == tuple(outer_size[1:]) and w.shape[0] != rows:
                padded = w.new_zeros((rows, *outer_size[1:]))
                padded[:w.shape[0]] = w
                w = padded
            return (w,), ("native",)
        with torch.no_grad():
            q = quantize_fp8_weight(w.to(dtype))
        return (q.data.view(torch.uint8), q.scale), ("fp8",)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """outputs: what the ranks' pre-all-gathers sent, gathered -> (the unsharded parameter, the tensors FSDP
        frees on reshard); with ``out``: nothing (out's tensors are the gather's buffers, refilled in place)."""
        if metadata[0] == "native":
            (w,) = outputs
            return None if out is not None else (w, (w,))
        data, scale = outputs
        if out is not None:
            return None
        data = data.view(torch.float8_e4m3fn)
        return GatheredFP8Weight(data, scale, param_dtype), (data, scale)


class GatheredFP8Weight(torch.Tensor):
    """The unsharded expert weight while FSDP2 holds it: shape [E, N, K] and the parameter's dtype, holding only
    W's FP8 codes (float8_e4m3fn [E, N, K]) and block scales (float32 [E, N/128, K/128]). ``fp8_weight`` gives
    them as an FP8WeightTensor. Any op that would need the weight's values in its own dtype raises: they are not
    here (the master is the sharded FP8GatherWeight)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(), dtype=dtype,
                                                   layout=data.layout, device=data.device, requires_grad=requires_grad)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False):
        self._data, self._scale = data, scale

    @property
    def fp8_weight(self) -> FP8WeightTensor:
        return FP8WeightTensor(self._data, self._scale)

    def __repr__(self):
        return f"GatheredFP8Weight(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = args[0]
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return GatheredFP8Weight(me._data, me._scale, me.dtype)
        if func in (torch.ops.aten.as_strided.default, torch.ops.aten.view.default) and \
                tuple(args[1]) == tuple(me.shape) and (func is torch.ops.aten.view.default
                                                      or tuple(args[2]) == tuple(me.stride())):
            return GatheredFP8Weight(me._data, me._scale, me.dtype)
        raise NotImplementedError(
            f"{func}: this expert weight is all-gathered by FSDP2 in FP8 (moe_fp4.model.fsdp) and holds only its "
            f"FP8 codes while unsharded; moe_fp4's fp8 / fp4 experts read those. Use the layer in fp8 or fp4, or "
            f"shard it without moe_fp4.model.fsdp.fp8_all_gather to read the weight in {me.dtype}")

    def __tensor_flatten__(self):
        return ["_data", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, _outer_size, _outer_stride):
        return GatheredFP8Weight(inner["_data"], inner["_scale"], dtype)


def gather_in_fp8(module: torch.nn.Module, names, where: str = "") -> list[str]:
    """module's parameters ``names`` (those it has, not None, not yet wrapped) made FP8GatherWeight parameters, for
    FSDP2 to all-gather in FP8 -> the names wrapped (prefixed with ``where``). Call it before ``fully_shard``: a
    parameter that is already a DTensor raises."""
    from torch.distributed.tensor import DTensor

    done = []
    for name in names:
        p = getattr(module, name, None)
        if p is None or isinstance(p, FP8GatherWeight):
            continue
        if isinstance(p, DTensor):
            raise RuntimeError(f"gather_in_fp8: call it before fully_shard ({where}{name} is already a DTensor)")
        setattr(module, name, torch.nn.Parameter(FP8GatherWeight(p.data), requires_grad=p.requires_grad))
        done.append(where + name)
    return done


__all__ = ["FP8GatherWeight", "GatheredFP8Weight", "gather_in_fp8"]
