"""What the saved-tensor hook compresses: the storage format, the reasons a saved tensor passes
through (:class:`SkipReason`), the configuration (:class:`CompressionConfig`) and which modules of a
model it wraps (:func:`is_expert_module`, :func:`select_modules`). The decisions are listed in
:mod:`moe_fp4.saved.hook`'s docstring."""

from __future__ import annotations

import enum
import fnmatch
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from moe_fp4.formats.choices import Choice
from moe_fp4.formats.containers import HIGH_PRECISION_DTYPES
from moe_fp4.kernels.numerics import MXFP4_BLOCK
from moe_fp4.kernels.nvfp4 import NVFP4_BLOCK

ModulePredicate = Callable[[str, nn.Module], bool]

_FLOAT8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
)
_DEVICES = ("cpu", "cuda")


class StorageFormat(Choice):
    """What the hook stores a saved tensor as."""

    __parameter__ = "storage"

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
        about 1.5 dB more SQNR). moe_fp4's own FP8 activations (``compress_fp8``) are converted
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


__all__ = ["CompressionConfig", "SkipReason", "StorageFormat", "is_expert_module", "select_modules"]
