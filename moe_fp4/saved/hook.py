"""Store the activations an existing model saves for backward in MXFP4, without rewriting the model.

Two entry points, both built on :class:`torch.autograd.graph.saved_tensors_hooks`:

- :class:`compress_saved_activations` (a context manager shaped like ``torch.autograd.graph.save_on_cpu``):
  every tensor autograd saves inside it is quantized to MXFP4 when it is saved (pack) and dequantized
  to its original dtype, shape and device when backward needs it (unpack).
- :func:`register_activation_compression`: enters that context around the forward of selected modules
  (default: the MoE expert modules, found by structure) through forward pre-hooks and forward hooks,
  and returns a handle with ``.remove()`` and ``.stats``.

Decisions (each one tested in ``tests/saved/test_hook.py``):

- **What is compressed.** A saved bf16/fp16/fp32 tensor with at least ``config.min_numel`` elements and at
  least one dimension. Passed through untouched, each counted in ``stats.skipped`` under its
  :class:`SkipReason`: ``nn.Parameter`` s, other leaf tensors that require grad, and views of either (e.g.
  ``weight.t()`` or ``experts_weight[e]``; their owner keeps the storage alive, so a compressed copy would
  add memory, not save it, and would make weight operands lossy), tensor subclasses (``type(t) is not
  torch.Tensor``), non-float tensors, float8 tensors (a bare float8 tensor has no scale we could use;
  moe_fp4's own FP8 Functions compress theirs through :func:`current_compression`), the tensors of
  moe_fp4's own kept activations (tagged by ``moe_fp4.saved.accounting.keep``: MXFP4 / FP8 containers and the exact
  router weights; ``SkipReason.QUANTIZED``, counted once per container), float64, sparse or
  other non-strided layouts, devices other than CPU/CUDA, zero-size tensors, 0-d tensors, tensors below
  ``min_numel``, tensors whose padded MXFP4 form would not be smaller than the original, and (only with
  ``check_finite=True``) tensors holding NaN/Inf.
- **Blocks and shapes.** 32-element blocks run along the last dimension. A 1-D tensor [K] is quantized as
  [1, K]. A last dimension that is not a multiple of 32 is zero-padded before quantizing and sliced off at
  unpack. Views and non-contiguous tensors are copied to a contiguous layout first; unpack restores the
  shape, dtype and device (contiguous strides).
- **Quantize at save time, never alias.** The MXFP4 copy is made in the pack hook, so an in-place change
  of the tensor after it was saved does not reach backward (backward uses the values it had when saved).
  Passed-through tensors are held as they are; since torch skips its own version-counter check when
  saved-tensor hooks are active, the hook does that check itself and raises the same RuntimeError torch
  would on an in-place change after the save.
- **Dedupe.** Within one entry of the context, saving the same view of the same storage at the same
  version again (e.g. ``x * x``) reuses the first MXFP4 copy while it is alive (``stats.shared``). The key
  holds a weak reference to the storage, so a new tensor at a reused address is never mistaken for an old
  one. While one unpacked tensor is alive, unpacking the same copy again returns a tensor on the same storage.
- **Unpack is pure.** It never changes the packed data: ``retain_graph=True`` and a second backward give
  identical gradients.
- **NaN/Inf.** Not checked by default (a check costs a device sync per tensor): MXFP4 marks a 32-block that
  holds a NaN or Inf as NaN, so such a value poisons the 31 other values of its block after unpack, and
  nothing non-finite comes back finite. ``check_finite=True`` stores such tensors unquantized instead.
- **Double backward** (``create_graph=True``) works: torch re-attaches every unpacked tensor to the graph
  node it was saved from, so higher-order gradients flow; they are computed from the dequantized values.
- **Activation checkpointing** (``torch.utils.checkpoint``). A context entered *around* a checkpoint call
  sees only the tensors the checkpoint saves itself, its inputs (both ``use_reentrant=True`` and
  ``False`` save them): those are compressed, and backward recomputes the function from their dequantized
  values; the function's own activations are recomputed, not stored. A context entered *inside* the
  checkpointed function (e.g. :func:`register_activation_compression` on the experts of a checkpointed
  layer) is innermost, so that part's saves are compressed and stored instead of recomputed. Non-reentrant:
  in forward; should the recomputation in backward run that part again (it stops early by default once it
  has what it needs, see ``torch.utils.checkpoint.set_checkpoint_early_stop``), it compresses and counts
  them again, with identical gradients. Reentrant: the forward runs without grad, so the saves happen in
  the recomputation, where the function's input is a detached leaf (passed through).
- **torch.compile.** Eager only. :func:`register_activation_compression` refuses a compiled model (RuntimeError
  naming what to use instead: the experts' own MXFP4 storage), and warns once per process when dynamo traces
  its module hooks (the model was compiled after registration); inside a compiled region its hooks do nothing,
  so nothing is compressed there.
- **Threads.** Scopes live on a thread-local stack; :func:`current_compression` answers for the calling
  thread only.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from moe_fp4.saved.accounting import CompressionStats, HookStats
from moe_fp4.saved.packing import (
    _COMPILE_MSG,
    ActiveCompression,
    _is_compiling,
    _warn_once,
    as_current,
    compress_saved_activations,
    current_compression,
    pause_compression,
)
from moe_fp4.saved.policy import CompressionConfig, SkipReason, StorageFormat, is_expert_module, select_modules


class CompressionHandle:
    """What :func:`register_activation_compression` returns.

    modules: names of the wrapped modules. kept: names of the submodules whose saves stay full precision.
    stats: HookStats (per module and total). remove(): removes every hook (idempotent); the model then
    behaves exactly as before registration. Also a context manager that removes on exit.
    """

    def __init__(self, scopes: dict[str, compress_saved_activations], kept: list[str], handles: list):
        self._scopes = scopes
        self.kept = kept
        self._handles = handles
        self.stats = HookStats({name: sc.stats for name, sc in scopes.items()})

    @property
    def modules(self) -> list[str]:
        return list(self._scopes)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "CompressionHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"CompressionHandle(modules={self.modules!r}, kept={self.kept!r}, active={bool(self._handles)})"


def _is_compiled(model: nn.Module) -> bool:
    """torch.compile(model) wraps it in an OptimizedModule (with ``_orig_mod``); model.compile() sets
    ``_compiled_call_impl`` on the module."""
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def register_activation_compression(model: nn.Module, config: CompressionConfig | None = None) -> CompressionHandle:
    """Store the activations the selected modules of ``model`` save for backward in MXFP4, no model rewrite.

    model: any nn.Module (e.g. a Hugging Face transformers MoE model). config: CompressionConfig (default:
    MoE expert modules, see :func:`is_expert_module`).
    -> CompressionHandle with ``.remove()`` and ``.stats`` (per module name and total).

    Each selected module gets a forward pre-hook (prepended, so it runs first) that enters a
    :class:`compress_saved_activations` scope named after the module, and a forward hook with
    ``always_call=True`` that exits it, also when the forward raises. Submodules matching
    ``config.keep_modules`` get hooks that pause compression around their forward. Raises ValueError when
    nothing is selected or a keep pattern matches no submodule of a selected module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"register_activation_compression: expected an nn.Module, got {type(model).__name__}")
    if config is None:
        config = CompressionConfig()
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"register_activation_compression: expected a CompressionConfig, got {type(config).__name__}")
    if _is_compiled(model):
        raise RuntimeError(f"register_activation_compression: {_COMPILE_MSG}")
    selected = select_modules(model, config)
    if not selected:
        what = "MoE expert modules (is_expert_module)" if config.modules is None else f"modules={config.modules!r}"
        raise ValueError(f"register_activation_compression: no module of {type(model).__name__} matched {what}")
    selected_names = [n for n, _ in selected]
    kept: list[tuple[str, nn.Module]] = []
    for pattern in config.keep_modules:
        hits = [(n, m) for n, m in model.named_modules()
                if fnmatch.fnmatchcase(n, pattern) and any(n.startswith(s + ".") or s == "" for s in selected_names)]
        if not hits:
            raise ValueError(f"register_activation_compression: keep_modules pattern {pattern!r} matches no submodule "
                             f"of the selected modules {selected_names}")
        kept.extend(h for h in hits if all(h[1] is not k[1] for k in kept))

    handles, scopes = [], {}
    try:
        for name, mod in selected:
            scope = compress_saved_activations(config, name=name or "<model>", params=mod.parameters)
            scopes[name] = scope
            handles.append(mod.register_forward_pre_hook(_enter_hook(scope), prepend=True))
            handles.append(mod.register_forward_hook(_exit_hook(scope), always_call=True))
        for _, mod in kept:
            pause = pause_compression()
            handles.append(mod.register_forward_pre_hook(_enter_hook(pause), prepend=True))
            handles.append(mod.register_forward_hook(_exit_hook(pause), always_call=True))
    except BaseException:
        for h in handles:
            h.remove()
        raise
    return CompressionHandle(scopes, [n for n, _ in kept], handles)


def _warn_compiled() -> None:
    _warn_once("compile", _COMPILE_MSG)


def _enter_hook(scope: compress_saved_activations | pause_compression):
    # Disabled for torch.compile here, when a hook is registered, not at import: torch.compiler.disable
    # imports torch._dynamo, which would make ``import moe_fp4`` pay for it.
    warn_compiled = torch.compiler.disable(_warn_compiled)

    def pre_hook(module, args):
        if _is_compiling():
            warn_compiled()
            return
        scope.__enter__()

    return pre_hook


def _exit_hook(scope: compress_saved_activations | pause_compression):
    def hook(module, args, output):
        if not _is_compiling():
            scope.__exit__(None, None, None)

    return hook


# The hook's whole API in one place (the scope and the policy live beside it in packing.py and policy.py).
__all__ = ["ActiveCompression", "CompressionConfig", "CompressionHandle", "CompressionStats", "HookStats", "SkipReason",
           "StorageFormat", "as_current", "compress_saved_activations", "current_compression", "is_expert_module",
           "pause_compression", "register_activation_compression", "select_modules"]
