"""What a forward pass keeps alive for backward: ``saved_bytes(fn, *args)``.

Two sources are merged:
- tensors saved through autograd (``ctx.save_for_backward`` and every built-in op), seen through
  ``torch.autograd.graph.saved_tensors_hooks``; each storage is counted once (views of one buffer
  share it), parameters are reported but flagged;
- quantized containers that moe_fp4's own autograd Functions keep as ctx attributes (MXFP4 and FP8
  activations), which those Functions report here themselves with a label.

Nested ``saved_tensors_hooks`` replace the outer ones, so tensors packed by an inner hook (for
example :func:`moe_fp4.compress_saved_activations`) are not seen here; that hook has its own
``.stats``.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

import torch

from moe_fp4.formats import FP8BlockTensor, MXFP4Tensor

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


class _Accounting:
    def __init__(self):
        self.records: list[SavedRecord] = []
        self.labels: dict[int, str] = {}
        self.seen: set[int] = set()

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else id(t)
        if key not in self.seen:
            self.seen.add(key)
            label = self.labels.get(id(t), "autograd")
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
    acc = _active()
    if acc is not None:
        acc.labels[id(t)] = label


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
    acc.records.append(SavedRecord(label, fmt, tuple(shape), obj.nbytes, parameter))


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
