"""The saved-tensor scope: :class:`compress_saved_activations` packs each tensor autograd saves inside it
into MXFP4 / NVFP4 (or passes it through, as :mod:`moe_fp4.saved.policy` decides) and unpacks it for
backward; :func:`current_compression` tells moe_fp4's own autograd Functions which scope they run in, so
they store what they keep in the scope's format themselves."""

from __future__ import annotations

import threading
import warnings
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from moe_fp4.formats.conversions import quantize_mxfp4, quantize_nvfp4
from moe_fp4.saved.accounting import CompressionStats, kept_tag, note_packed
from moe_fp4.saved.policy import _BLOCK, CompressionConfig, SkipReason, StorageFormat, _skip_reason, _storage_ptrs


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
                "tensors do not pass through the hook. In a compiled model keep the expert activations in MXFP4 "
                "with the experts' own storage (moe_fp4.MoE(precision='fp4'), experts_implementation='moe_fp4', "
                "the torchtitan converter's fp4), or run the model uncompiled.")


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


__all__ = ["ActiveCompression", "as_current", "compress_saved_activations", "current_compression", "pause_compression"]
