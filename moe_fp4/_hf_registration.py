"""``import moe_fp4`` registers its Hugging Face experts implementations (:mod:`moe_fp4.integrations.hf_experts`)
when transformers' experts registry exists, without importing transformers itself: now if
``transformers.integrations.moe`` is already imported, otherwise right after it is (a finder on
``sys.meta_path`` that wraps that one module's loader and removes itself once it has run). So ``import moe_fp4``
does not pay for importing transformers, and ``from_pretrained(..., experts_implementation="moe_fp4")`` finds the
name whichever of the two a script imports first."""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings

TARGET = "transformers.integrations.moe"


def _register() -> None:
    try:
        importlib.import_module("moe_fp4.integrations.hf_experts")
    except Exception as e:  # noqa: BLE001 - transformers must import even if our registration cannot run
        warnings.warn(f"moe_fp4: could not register its experts implementations with transformers "
                      f"({type(e).__name__}: {e}); import moe_fp4.integrations.hf_experts to see why", RuntimeWarning,
                      stacklevel=2)


class _RegisterAfter(importlib.abc.Loader):
    """The target module's own loader, then the registration."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _register()


class RegistrationFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)   # once: and the search below must not find this finder again
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisterAfter(spec.loader)
                return spec
        return None


def install() -> None:
    if TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, RegistrationFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, RegistrationFinder())
