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
- **torch.compile.** Eager only. :func:`register_activation_compression` warns once per process when it is
  registered on a compiled model, or when dynamo traces its module hooks (the model was compiled after
  registration); inside a compiled region its hooks do nothing, so nothing is compressed there.
- **Threads.** Scopes live on a thread-local stack; :func:`current_compression` answers for the calling
  thread only.
"""

from __future__ import annotations

import enum
import fnmatch
import math
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from moe_fp4.formats.conversions import quantize_mxfp4, quantize_nvfp4
from moe_fp4.formats.containers import HIGH_PRECISION_DTYPES
from moe_fp4.kernels.numerics import MXFP4_BLOCK
from moe_fp4.kernels.nvfp4 import NVFP4_BLOCK
from moe_fp4.saved.accounting import kept_tag, note_packed

ModulePredicate = Callable[[str, nn.Module], bool]

_FLOAT8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
)
_DEVICES = ("cpu", "cuda")


class StorageFormat(str, enum.Enum):
    """What the hook stores a saved tensor as."""

    MXFP4 = "mxfp4"   # E2M1 + an E8M0 scale per 32: 17 bytes a block
    NVFP4 = "nvfp4"   # E2M1 + an E4M3 scale per 16 + a float32 per tensor: 9 bytes a block


# Elements per block of each storage format; a block stores half a byte an element and one scale byte.
_BLOCK = {StorageFormat.MXFP4: MXFP4_BLOCK, StorageFormat.NVFP4: NVFP4_BLOCK}


class SkipReason(str, enum.Enum):
    """Why a saved tensor was passed through uncompressed (the keys of ``CompressionStats.skipped``)."""

    PARAMETER = "parameter"
    LEAF = "leaf"
    SUBCLASS = "subclass"
    NON_FLOAT = "non_float"
    FLOAT8 = "float8"
    DTYPE = "dtype"
    LAYOUT = "layout"
    DEVICE = "device"
    EMPTY = "empty"
    SCALAR = "0-d"
    SMALL = "small"
    NO_SAVING = "no_saving"
    NON_FINITE = "non_finite"
    KEPT = "kept"
    QUANTIZED = "quantized"   # moe_fp4's own kept activation (moe_fp4.saved.accounting.keep): already in its format


def is_expert_module(name: str, module: nn.Module) -> bool:
    """The default module selector: True for an MoE expert module, found by class and structure.

    - a module holding at least two 3-D parameters of its own that share their first dimension (the
      expert count), e.g. Hugging Face transformers 5.x ``MixtralExperts``/``Qwen3MoeExperts`` with
      ``gate_up_proj`` [E, 2F, H] and ``down_proj`` [E, H, F]; or one 3-D parameter when the module's own
      name contains "expert". Convolutions (3-D weights) never match.
    - an ``nn.ModuleList``/``nn.ModuleDict`` named ``experts`` (a list of expert MLPs); it has no forward of
      its own, so :func:`register_activation_compression` hooks each of its elements.
    """
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return leaf == "experts"
    if isinstance(module, nn.modules.conv._ConvNd):
        return False
    p3 = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    if len(p3) >= 2 and len({p.shape[0] for p in p3}) == 1:
        return True
    return bool(p3) and "expert" in leaf.lower()


@dataclass(frozen=True)
class CompressionConfig:
    """What the hook compresses.

    modules: which modules :func:`register_activation_compression` wraps: a predicate
        ``(name, module) -> bool`` over ``model.named_modules()``, or a tuple of fnmatch patterns on the
        full module name (e.g. ``("*.mlp.experts",)``); None (default) selects MoE expert modules with
        :func:`is_expert_module`. A selected ``nn.ModuleList``/``nn.ModuleDict`` stands for its elements;
        a module inside an already selected one is not selected again.
    keep_modules: fnmatch patterns on full module names of submodules *inside* the selected modules whose
        saved tensors stay in full precision (e.g. ``("*.experts.act_fn",)`` keeps the activation input).
        Saved tensors carry no names, so "which tensors to keep" is expressed by the module that saves
        them: compression is paused around those submodules' forward. Only for
        :func:`register_activation_compression` (it needs module names); each pattern must match.
    min_numel: tensors with fewer elements pass through (SkipReason.SMALL).
    compress_fp8: whether moe_fp4's own FP8 Functions, which keep their saved FP8 tensors as ctx
        attributes, store them in the ``storage`` format when inside a compression scope (read through
        :func:`current_compression`). Bare float8 tensors seen by the hook are never compressed.
    check_finite: check every candidate tensor for NaN/Inf (a device sync each) and store those that hold
        any unquantized (SkipReason.NON_FINITE). Off by default: a NaN/Inf then turns its 32-block to NaN.
    storage: the format the hook stores tensors in: ``StorageFormat.MXFP4`` (default; 4.25 bits an
        element) or ``StorageFormat.NVFP4`` (E4M3 scales per 16 and a float32 scale per tensor: 4.5 bits,
        about 1.5 dB more SQNR; issue 27). moe_fp4's own FP8 activations (``compress_fp8``) are converted
        to the same format straight from their codes (FP8 -> MXFP4 or FP8 -> NVFP4).
    """

    modules: ModulePredicate | tuple[str, ...] | None = None
    keep_modules: tuple[str, ...] = ()
    min_numel: int = 4096
    compress_fp8: bool = True
    check_finite: bool = False
    storage: StorageFormat = StorageFormat.MXFP4

    def __post_init__(self):
        m = self.modules
        if isinstance(m, str):
            raise TypeError(f"CompressionConfig.modules: expected a tuple of fnmatch patterns, got the string {m!r}; "
                            f"write ({m!r},)")
        if isinstance(m, (list, tuple)):
            if not m or not all(isinstance(p, str) and p for p in m):
                raise ValueError(f"CompressionConfig.modules: expected a non-empty tuple of non-empty pattern strings, "
                                 f"got {m!r}")
            object.__setattr__(self, "modules", tuple(m))
        elif m is not None and not callable(m):
            raise TypeError(f"CompressionConfig.modules: expected None, a tuple of patterns or a callable "
                            f"(name, module) -> bool, got {type(m).__name__}")
        k = self.keep_modules
        if isinstance(k, str):
            raise TypeError(f"CompressionConfig.keep_modules: expected a tuple of fnmatch patterns, got the string "
                            f"{k!r}; write ({k!r},)")
        if not isinstance(k, (list, tuple)) or not all(isinstance(p, str) and p for p in k):
            raise TypeError(f"CompressionConfig.keep_modules: expected a tuple of non-empty pattern strings, got {k!r}")
        object.__setattr__(self, "keep_modules", tuple(k))
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int):
            raise TypeError(f"CompressionConfig.min_numel: expected an int, got {type(self.min_numel).__name__}")
        if self.min_numel < 1:
            raise ValueError(f"CompressionConfig.min_numel: must be >= 1, got {self.min_numel}")
        for f in ("compress_fp8", "check_finite"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"CompressionConfig.{f}: expected a bool, got {type(getattr(self, f)).__name__}")
        try:
            object.__setattr__(self, "storage", StorageFormat(self.storage))
        except ValueError:
            raise ValueError(f"CompressionConfig.storage: expected one of "
                             f"{', '.join(f.value for f in StorageFormat)}, got {self.storage!r}") from None

    def selects(self, name: str, module: nn.Module) -> bool:
        """Whether ``config.modules`` selects the module ``name`` (before container expansion and nesting)."""
        if self.modules is None:
            return is_expert_module(name, module)
        if isinstance(self.modules, tuple):
            return any(fnmatch.fnmatchcase(name, p) for p in self.modules)
        return bool(self.modules(name, module))


@dataclass
class CompressionStats:
    """Counters of one scope (a module, or a :class:`compress_saved_activations` object).

    seen: tensors the pack hook received (= compressed + shared + sum(skipped.values())).
    compressed: tensors stored in MXFP4 by the hook. shared: saves that reused an earlier MXFP4 copy.
    internal: tensors moe_fp4's own Functions stored compressed themselves (:meth:`ActiveCompression.record_internal`).
    skipped: {SkipReason value: count} of tensors passed through.
    bytes_before / bytes_after: logical bytes of the compressed and internal tensors before, and of their
        MXFP4 storage after (padding included); each stored copy counted once.
    bytes_skipped: logical bytes of passed-through tensors other than parameters and grad-requiring leaves.
    """

    seen: int = 0
    compressed: int = 0
    shared: int = 0
    internal: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0
    bytes_skipped: int = 0

    @property
    def ratio(self) -> float:
        """bytes_after / bytes_before (nan when nothing was compressed)."""
        return self.bytes_after / self.bytes_before if self.bytes_before else math.nan

    def __add__(self, other: "CompressionStats") -> "CompressionStats":
        skipped = dict(self.skipped)
        for k, v in other.skipped.items():
            skipped[k] = skipped.get(k, 0) + v
        return CompressionStats(self.seen + other.seen, self.compressed + other.compressed, self.shared + other.shared,
                                self.internal + other.internal, skipped, self.bytes_before + other.bytes_before,
                                self.bytes_after + other.bytes_after, self.bytes_skipped + other.bytes_skipped)

    def reset(self) -> None:
        self.seen = self.compressed = self.shared = self.internal = 0
        self.bytes_before = self.bytes_after = self.bytes_skipped = 0
        self.skipped.clear()


class ActiveCompression:
    """One entry of a compression scope on one thread (what :func:`current_compression` returns).

    config: the CompressionConfig in force. name: the module name ("" for a bare context).
    stats: the scope's CompressionStats (shared by every entry of the same scope).
    """

    __slots__ = ("config", "name", "stats", "_cache")

    def __init__(self, config: CompressionConfig, stats: CompressionStats, name: str = ""):
        self.config = config
        self.name = name
        self.stats = stats
        self._cache: dict[tuple, tuple[StorageWeakRef, weakref.ref]] = {}

    def record_internal(self, bytes_before: int, bytes_after: int) -> None:
        """Count one tensor that moe_fp4's own Function stored compressed itself (e.g. FP8 -> MXFP4 directly).

        bytes_before: the bytes it would have stored (e.g. the FP8BlockTensor's nbytes);
        bytes_after: the bytes it stores (e.g. the MXFP4Tensor's nbytes).
        """
        for what, v in (("bytes_before", bytes_before), ("bytes_after", bytes_after)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"record_internal: {what} must be a non-negative int, got {v!r}")
        self.stats.internal += 1
        self.stats.bytes_before += bytes_before
        self.stats.bytes_after += bytes_after

    def __repr__(self) -> str:
        return f"ActiveCompression(name={self.name!r}, config={self.config!r})"


_PAUSED = object()
_local = threading.local()


def _stack() -> list:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


def current_compression() -> ActiveCompression | None:
    """The innermost active compression scope on this thread (None outside any, or while paused)."""
    s = _stack()
    if not s or s[-1] is _PAUSED:
        return None
    return s[-1]


class as_current:
    """Context manager: :func:`current_compression` returns ``scope`` (None: no scope) on this thread inside
    it, without installing that scope's saved-tensor hooks. For a recomputation (``moe_fp4.model.moe.checkpoint``)
    that must take the decisions its first run took under ``scope`` (fp8 keeps MXFP4 under a
    ``compress_fp8`` scope) while the checkpoint's own hooks receive what it saves."""

    def __init__(self, scope: "ActiveCompression | None"):
        self.scope = scope

    def __enter__(self):
        _stack().append(_PAUSED if self.scope is None else self.scope)
        return self

    def __exit__(self, *exc) -> None:
        _stack().pop()


class pause_compression:
    """Context manager: saves inside it stay in full precision (SkipReason.KEPT) and
    :func:`current_compression` returns None, until a scope is entered again inside it."""

    def __enter__(self):
        _stack().append(_PAUSED)
        return self

    def __exit__(self, *exc) -> None:
        s = _stack()
        if s and s[-1] is _PAUSED:
            s.pop()


_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, UserWarning, stacklevel=3)


_COMPILE_MSG = ("moe_fp4 activation compression is eager-only: under torch.compile the compiled region's saved "
                "tensors may be held outside the hook or the hook may break the graph; run the model uncompiled "
                "to store activations in MXFP4.")


def _is_compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except Exception:
        return False


_resurrect = getattr(torch.UntypedStorage, "_new_with_weak_ptr", None)


class _Packed:
    """An MXFP4 or NVFP4 copy of a saved tensor: q holds it as [M, Kp] (Kp = K rounded up to the block)."""

    __slots__ = ("q", "shape", "dtype", "k", "_out", "__weakref__")

    def __init__(self, q, shape: torch.Size, dtype: torch.dtype, k: int):
        self.q, self.shape, self.dtype, self.k = q, shape, dtype, k
        self._out: tuple[StorageWeakRef, tuple, tuple] | None = None

    def unpack(self) -> torch.Tensor:
        out = self._out
        if out is not None and _resurrect is not None:
            storage = _resurrect(out[0].cdata)
            if storage is not None:
                return torch.empty(0, dtype=self.dtype, device=self.q.device).set_(storage, 0, out[1], out[2])
        x = self.q.dequantize(self.dtype)
        if x.shape[-1] != self.k:
            x = x[:, : self.k].contiguous()
        x = x.view(self.shape)
        self._out = (StorageWeakRef(x.untyped_storage()), tuple(x.shape), tuple(x.stride()))
        return x


class _Passthrough:
    """A tensor saved uncompressed, with its version at save time (torch skips its check under hooks)."""

    __slots__ = ("t", "version", "reason")

    def __init__(self, t: torch.Tensor, reason: SkipReason):
        self.t, self.version, self.reason = t, t._version, reason

    def unpack(self) -> torch.Tensor:
        if self.t._version != self.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{self.t.type()} {list(self.t.shape)}] is at version {self.t._version}; expected version "
                f"{self.version} instead. (moe_fp4 hook: this tensor was saved uncompressed, reason "
                f"{self.reason.value!r}, and checked as torch would without saved-tensor hooks.)")
        return self.t


def _storage_ptrs(p: torch.Tensor) -> set[int]:
    """The data pointers of the storages behind a parameter: its own for a plain tensor; for a tensor
    subclass, those of the inner tensors ``__tensor_flatten__`` names, recursively: a DTensor's local
    shard (what a module computes with after ``to_local()``, e.g. transformers' expert-parallel experts,
    FSDP2's sharded parameters) or the weight inside torchao's FP8 training wrapper. A wrapper subclass
    has no storage of its own (asking for one raises), and one that does not flatten contributes none."""
    if type(p) in (torch.Tensor, nn.Parameter):
        return {p.untyped_storage().data_ptr()}
    flatten = getattr(p, "__tensor_flatten__", None)
    if flatten is None:
        try:
            return {p.untyped_storage().data_ptr()}
        except RuntimeError:   # a wrapper without storage that says nothing of its contents
            return set()
    names, _ = flatten()
    return set().union(*(_storage_ptrs(getattr(p, n)) for n in names))


def _skip_reason(t: torch.Tensor, config: CompressionConfig, param_ptrs=frozenset()) -> SkipReason | None:
    base = t._base if t._is_view() else None
    if isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter):
        return SkipReason.PARAMETER
    if type(t) is not torch.Tensor:   # (before any storage access: a wrapper subclass has none)
        return SkipReason.SUBCLASS
    # Not a Parameter but its storage: a tensor-subclass parameter's inner tensor (a DTensor's local
    # shard reached through to_local(), the weight inside torchao's wrapper).
    if param_ptrs and t.untyped_storage().data_ptr() in param_ptrs:
        return SkipReason.PARAMETER
    if (t.is_leaf and t.requires_grad) or (base is not None and base.is_leaf and base.requires_grad):
        return SkipReason.LEAF
    if t.dtype in _FLOAT8_DTYPES:
        return SkipReason.FLOAT8
    if not t.is_floating_point():
        return SkipReason.NON_FLOAT
    if t.dtype not in HIGH_PRECISION_DTYPES:
        return SkipReason.DTYPE
    if t.layout != torch.strided:
        return SkipReason.LAYOUT
    if t.device.type not in _DEVICES:
        return SkipReason.DEVICE
    if t.numel() == 0:
        return SkipReason.EMPTY
    if t.dim() == 0:
        return SkipReason.SCALAR
    if t.numel() < config.min_numel:
        return SkipReason.SMALL
    k = t.shape[-1]
    block = _BLOCK[config.storage]
    rows = t.numel() // k
    if rows * -(-k // block) * (block // 2 + 1) + (4 if config.storage is StorageFormat.NVFP4 else 0) \
            >= t.numel() * t.element_size():
        return SkipReason.NO_SAVING
    if config.check_finite and not bool(torch.isfinite(t).all()):
        return SkipReason.NON_FINITE
    return None


def _quantize(t: torch.Tensor, storage: StorageFormat = StorageFormat.MXFP4) -> _Packed:
    x = t.detach()
    k = x.shape[-1]
    x = x.reshape(-1, k)
    pad = -k % _BLOCK[storage]
    x = torch.nn.functional.pad(x, (0, pad)) if pad else x.contiguous()
    q = quantize_nvfp4(x) if storage is StorageFormat.NVFP4 else quantize_mxfp4(x)
    return _Packed(q, t.shape, t.dtype, k)


def _dedupe_key(t: torch.Tensor):
    storage = t.untyped_storage()
    return (storage._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version), storage


class compress_saved_activations(torch.autograd.graph.saved_tensors_hooks):
    """Context manager under which tensors saved for backward are stored in MXFP4 (see the module docstring
    for what is compressed and what passes through).

    config: a CompressionConfig (default: CompressionConfig()); its ``modules``/``keep_modules`` select
        modules for :func:`register_activation_compression` and are not used here (a non-empty
        ``keep_modules`` is a ValueError: use :func:`pause_compression` around the saves to keep).
    name: the scope's name as :class:`ActiveCompression` reports it.

    The object is reusable and re-entrant; ``.stats`` (a CompressionStats) accumulates over all entries.
    Saved bf16/fp16/fp32 tensors [..., K] become MXFP4 (data uint8 [M, ceil(K/32)*16], scale uint8
    [M, ceil(K/32)]) and come back as tensors of their original shape, dtype and device.

        with moe_fp4.compress_saved_activations():
            loss = model(x).sum()
        loss.backward()
    """

    def __init__(self, config: CompressionConfig | None = None, *, name: str = "", params=None):
        if config is None:
            config = CompressionConfig()
        if not isinstance(config, CompressionConfig):
            raise TypeError(f"compress_saved_activations: expected a CompressionConfig, got {type(config).__name__}")
        if config.keep_modules and not name:
            raise ValueError("compress_saved_activations: config.keep_modules needs module names; use it with "
                             "register_activation_compression, or pause_compression() around the saves to keep")
        self.config = config
        self.name = name
        # A callable -> the parameters whose storages are never compressed. Read at the first save of
        # each entry, i.e. inside the module's forward: transformers' EP swaps its DTensor parameters
        # for their local shards (``to_local()``) only for the duration of forward.
        self._params = params
        self._param_ptrs = None
        self.stats = CompressionStats()
        self._local = threading.local()
        super().__init__(self._pack, self._unpack)

    def _entries(self) -> list[ActiveCompression]:
        e = getattr(self._local, "entries", None)
        if e is None:
            e = self._local.entries = []
        return e

    def __enter__(self):
        self._param_ptrs = None
        entry = ActiveCompression(self.config, self.stats, self.name)
        self._entries().append(entry)
        _stack().append(entry)
        try:
            super().__enter__()
        except BaseException:
            _stack().pop()
            self._entries().pop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        entries = self._entries()
        if not entries:
            return
        super().__exit__(*exc)
        s = _stack()
        while s and s[-1] is _PAUSED:
            s.pop()
        entry = entries.pop()
        if s and s[-1] is entry:
            s.pop()
        entry._cache.clear()

    def _pack(self, t: torch.Tensor):
        entries = self._entries()
        entry = entries[-1] if entries else ActiveCompression(self.config, self.stats, self.name)
        stats = entry.stats
        stats.seen += 1
        if _is_compiling():
            _warn_once("compile", _COMPILE_MSG)
        s = _stack()
        if self._param_ptrs is None:
            params = self._params() if self._params is not None else ()
            self._param_ptrs = frozenset(ptr for p in params for ptr in _storage_ptrs(p) if ptr)
        tag = kept_tag(t)
        if tag is not None:
            # moe_fp4's experts save their MXFP4 / FP8 activations (and exact router weights) through
            # autograd so that a checkpoint can drop them; here they pass through, counted once per
            # container: as internal where this scope's config had them converted, else as skipped.
            kept, first = tag
            stats.skipped[SkipReason.QUANTIZED.value] = stats.skipped.get(SkipReason.QUANTIZED.value, 0) + 1
            if first and kept.converted_from is not None:
                stats.internal += 1
                stats.bytes_before += kept.converted_from
                stats.bytes_after += kept.nbytes
            elif first:
                stats.bytes_skipped += kept.nbytes
            note_packed(t)
            return _Passthrough(t.detach(), SkipReason.QUANTIZED)
        reason = SkipReason.KEPT if s and s[-1] is _PAUSED else _skip_reason(t, self.config, self._param_ptrs)
        if reason is not None:
            stats.skipped[reason.value] = stats.skipped.get(reason.value, 0) + 1
            if reason not in (SkipReason.PARAMETER, SkipReason.LEAF):
                stats.bytes_skipped += t.numel() * t.element_size()
            return _Passthrough(t.detach(), reason)
        key, storage = _dedupe_key(t)
        hit = entry._cache.get(key)
        packed = hit[1]() if hit is not None else None
        if packed is not None:
            stats.shared += 1
            return packed
        packed = _quantize(t, self.config.storage)
        entry._cache[key] = (StorageWeakRef(storage), weakref.ref(packed))
        stats.compressed += 1
        stats.bytes_before += t.numel() * t.element_size()
        stats.bytes_after += packed.q.nbytes
        return packed

    @staticmethod
    def _unpack(p) -> torch.Tensor:
        return p.unpack()


@dataclass
class HookStats:
    """Per-module counters of a :class:`CompressionHandle`: modules maps each selected module's name to its
    CompressionStats; total sums them."""

    modules: dict[str, CompressionStats]

    @property
    def total(self) -> CompressionStats:
        out = CompressionStats()
        for s in self.modules.values():
            out = out + s
        return out

    def reset(self) -> None:
        for s in self.modules.values():
            s.reset()


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


def select_modules(model: nn.Module, config: CompressionConfig) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs register_activation_compression wraps: config.modules over
    model.named_modules(), containers (ModuleList/ModuleDict) replaced by their elements, and modules
    inside an already selected one dropped."""
    chosen: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if not config.selects(name, mod):
            continue
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            prefix = f"{name}." if name else ""
            chosen.extend((prefix + n, m) for n, m in mod.named_children())
        else:
            chosen.append((name, mod))
    out, names, ids = [], [], set()
    for name, mod in chosen:
        if id(mod) in ids or any(name.startswith(p + ".") or p == "" for p in names):
            continue
        ids.add(id(mod))
        names.append(name)
        out.append((name, mod))
    return out


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
        _warn_once("compile", _COMPILE_MSG)
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


@torch.compiler.disable
def _warn_compiled() -> None:
    _warn_once("compile", _COMPILE_MSG)


def _enter_hook(scope: compress_saved_activations | pause_compression):
    def pre_hook(module, args):
        if _is_compiling():
            _warn_compiled()
            return
        scope.__enter__()

    return pre_hook


def _exit_hook(scope: compress_saved_activations | pause_compression):
    def hook(module, args, output):
        if not _is_compiling():
            scope.__exit__(None, None, None)

    return hook


__all__ = ["ActiveCompression", "CompressionConfig", "CompressionHandle", "CompressionStats", "HookStats", "SkipReason",
           "StorageFormat", "as_current", "compress_saved_activations", "current_compression", "is_expert_module",
           "pause_compression", "register_activation_compression", "select_modules"]
