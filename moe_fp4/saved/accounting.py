"""What a forward pass keeps alive for backward: ``saved_bytes(fn, *args)``.

Two sources are merged:
- tensors saved through autograd (``ctx.save_for_backward`` and every built-in op), seen through
  ``torch.autograd.graph.saved_tensors_hooks``; each storage is counted once (views of one buffer
  share it), parameters are reported but flagged;
- moe_fp4's own kept activations (MXFP4 and FP8 containers, the router weights): the experts' Function
  hands their tensors to ``ctx.save_for_backward`` tagged by :func:`keep`, and they are reported here
  once per container, with its label and format, when a hook packs them. Going through autograd (not
  ctx attributes) is what lets ``torch.utils.checkpoint`` drop them and recompute them; under a
  checkpoint's own (inner) hooks nothing is reported, because nothing is held;
- copies derived from the weights (the FP8 weight cache) that a Function keeps on its ctx, reported by
  :func:`report_saved` and flagged as parameters.

Nested ``saved_tensors_hooks`` replace the outer ones, so tensors packed by an inner hook (for
example :func:`moe_fp4.compress_saved_activations`) are not seen here; that hook has its own
``.stats``.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from dataclasses import dataclass, field, fields

import torch

from moe_fp4.formats.containers import FP8BlockTensor, MXFP4Tensor, NVFP4Tensor

_local = threading.local()


@dataclass(frozen=True)
class SavedRecord:
    label: str        # who saved it: a moe_fp4 label ("fc1_input", ...) or "autograd"
    format: str       # "mxfp4", "fp8_1x128", or a torch dtype name
    shape: tuple
    nbytes: int
    parameter: bool = False


@dataclass(frozen=True)
class SavedReport:
    records: tuple[SavedRecord, ...]

    @property
    def total(self) -> int:
        """Bytes of everything saved, parameters excluded."""
        return sum(r.nbytes for r in self.records if not r.parameter)

    def bytes_by(self, field: str = "label") -> dict[str, int]:
        """{label or format: bytes}, parameters excluded."""
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            if not r.parameter:
                out[getattr(r, field)] += r.nbytes
        return dict(out)

    def labelled(self, *labels: str) -> int:
        """Bytes of the records with one of these labels."""
        return sum(r.nbytes for r in self.records if r.label in labels)

    def table(self) -> str:
        rows = [f"{'label':<16} {'format':<14} {'shape':<22} {'bytes':>14}"]
        for r in self.records:
            tag = " (parameter)" if r.parameter else ""
            rows.append(f"{r.label:<16} {r.format:<14} {str(list(r.shape)):<22} {r.nbytes:>14,}{tag}")
        rows.append(f"{'total':<16} {'':<14} {'':<22} {self.total:>14,}")
        return "\n".join(rows)


@dataclass(frozen=True, eq=False)
class Kept:
    """One activation moe_fp4 keeps for backward in its own format. label: its role ("fc1_input", ...);
    format: "mxfp4", "nvfp4", "fp8_1x128" or a dtype name; shape: logical shape; nbytes: bytes held;
    converted_from: bytes of the tensor it replaces when a compression scope converted it (the fp8
    precision's FP8 activations stored as MXFP4), else None."""

    label: str
    format: str
    shape: tuple
    nbytes: int
    converted_from: int | None = None


_TAG = "_moe_fp4_kept"
_LABEL = "_moe_fp4_label"


def _describe(obj) -> tuple[str, tuple]:
    if isinstance(obj, MXFP4Tensor):
        return "mxfp4", tuple(obj.shape)
    if isinstance(obj, NVFP4Tensor):
        return "nvfp4", tuple(obj.shape)
    if isinstance(obj, FP8BlockTensor):
        return "fp8_1x128", tuple(obj.shape)
    return str(obj.dtype).replace("torch.", ""), tuple(obj.shape)


def _nbytes(obj) -> int:
    """A container's or a tensor's bytes, from its element counts: a tensor's ``nbytes`` cannot be read under
    torch.compile's symbolic shapes (a SymInt here)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return obj.nbytes


def keep(label: str, obj, converted_from: int | None = None) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """obj: an MXFP4Tensor, NVFP4Tensor, FP8BlockTensor or tensor a moe_fp4 Function saves for backward ->
    (its tensors, to pass to ``ctx.save_for_backward``; a spec for :func:`rebuild`).

    The tensors are tagged with one :class:`Kept`: :func:`saved_bytes` reports the container once, and
    :mod:`moe_fp4.saved.hook`'s compression passes them through (they are quantized already, or must stay
    exact like the router weights) and counts them once."""
    fmt, shape = _describe(obj)
    tag = Kept(label, fmt, shape, _nbytes(obj), converted_from)
    if isinstance(obj, torch.Tensor):
        tensors, spec = (obj,), None
    else:
        names = [f.name for f in fields(obj)]
        tensors = tuple(getattr(obj, n) for n in names if isinstance(getattr(obj, n), torch.Tensor))
        spec = (type(obj), {n: getattr(obj, n) for n in names if not isinstance(getattr(obj, n), torch.Tensor)},
                [n for n in names if isinstance(getattr(obj, n), torch.Tensor)])
    for i, t in enumerate(tensors):
        setattr(t, _TAG, (tag, i))
    return tensors, (spec, len(tensors))


def rebuild(spec: tuple, tensors) -> object:
    """The inverse of :func:`keep`: (spec, the tensors autograd gave back) -> the container or tensor."""
    inner, _ = spec
    if inner is None:
        return tensors[0]
    cls, other, names = inner
    return cls(**other, **dict(zip(names, tensors)))


def kept_tag(t: torch.Tensor) -> tuple[Kept, bool] | None:
    """(its Kept, whether t is the container's first tensor) for a tensor tagged by :func:`keep`, else None."""
    tag = getattr(t, _TAG, None)
    return None if tag is None else (tag[0], tag[1] == 0)


def note_packed(t: torch.Tensor) -> None:
    """A pack hook other than saved_bytes' own (the compression hook, which replaces it while nested)
    passes a tagged tensor through: report its container to the active saved_bytes, if any."""
    acc = _active()
    if acc is not None:
        acc.note_kept(t)


class _Accounting:
    def __init__(self):
        self.records: list[SavedRecord] = []
        self.seen: set[int] = set()
        self.kept: set[Kept] = set()

    def note_kept(self, t: torch.Tensor) -> bool:
        tag = kept_tag(t)
        if tag is None:
            return False
        k = tag[0]
        if k not in self.kept:
            self.kept.add(k)
            self.records.append(SavedRecord(k.label, k.format, k.shape, k.nbytes))
        return True

    def pack(self, t: torch.Tensor):
        if self.note_kept(t):
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else id(t)
        if key not in self.seen:
            self.seen.add(key)
            label = getattr(t, _LABEL, "autograd")
            self.records.append(SavedRecord(label, str(t.dtype).replace("torch.", ""), tuple(t.shape),
                                            storage.nbytes(), _is_parameter(t)))
        return t


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (``linear`` saves ``weight.t()``)."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def _active() -> _Accounting | None:
    return getattr(_local, "accounting", None)


def label_saved(t: torch.Tensor, label: str) -> None:
    """Name a tensor that is about to go through ``ctx.save_for_backward`` (no-op outside saved_bytes)."""
    if _active() is not None:
        # On the tensor, not in a table by id(): a tensor that never reaches the pack hook (held by a
        # checkpoint instead) dies, and its id may come back as another tensor's.
        setattr(t, _LABEL, label)


def report_saved(label: str, obj, parameter: bool = False) -> None:
    """Count a container or tensor a moe_fp4 Function keeps on its ctx (no-op outside saved_bytes).
    ``parameter``: a copy derived from the weights (the FP8 weight copies): listed, flagged like a
    parameter, and left out of the totals, which count activations."""
    acc = _active()
    if acc is None:
        return
    if isinstance(obj, MXFP4Tensor):
        fmt, shape = "mxfp4", obj.shape
    elif isinstance(obj, FP8BlockTensor):
        fmt, shape = "fp8_1x128", obj.shape
    elif getattr(obj, "data", None) is not None and getattr(obj, "scale", None) is not None:
        fmt, shape = "fp8_128x128", obj.data.shape   # gemm.FP8WeightTensor (gemm sits beside this module)
    else:
        fmt, shape = str(obj.dtype).replace("torch.", ""), obj.shape
    acc.records.append(SavedRecord(label, fmt, tuple(shape), _nbytes(obj), parameter))


def saved_bytes(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` and report what it saves for backward.

    -> (fn's result, SavedReport). The result keeps the graph alive, so the report describes memory
    that is really held until backward.
    """
    outer = _active()
    acc = _Accounting()
    _local.accounting = acc
    try:
        with torch.autograd.graph.saved_tensors_hooks(acc.pack, lambda t: t):
            out = fn(*args, **kwargs)
    finally:
        _local.accounting = outer
    return out, SavedReport(tuple(acc.records))


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


__all__ = ["CompressionStats", "HookStats", "Kept", "SavedRecord", "SavedReport", "keep", "kept_tag", "label_saved",
           "note_packed", "rebuild", "report_saved", "saved_bytes"]
