"""The module paths of moe_fp4 before its subpackages (0.1.0 and earlier) as aliases of their new homes.

``import moe_fp4.comm`` still works: it returns the module that holds those names now
(``moe_fp4.exchange``) and warns once with the new path, so code written against the flat layout runs
unchanged while it is being moved. New code imports the paths listed in the README's "Public API".
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module -> the module that holds its names now (a package where the old module was split)
MOVED = {
    "moe_fp4.api": "moe_fp4.formats.conversions",
    "moe_fp4._ops": "moe_fp4.formats._ops",
    "moe_fp4.reference": "moe_fp4.formats.reference",
    "moe_fp4.metrics": "moe_fp4.formats.metrics",
    "moe_fp4.hook": "moe_fp4.saved",
    "moe_fp4.wire": "moe_fp4.exchange.wire",
    "moe_fp4.comm": "moe_fp4.exchange",
    "moe_fp4.ep": "moe_fp4.exchange.ep",
    "moe_fp4.experts": "moe_fp4.model.experts",
    "moe_fp4.nn": "moe_fp4.model.moe",
    "moe_fp4.optim": "moe_fp4.model.optim",
    "moe_fp4.planner": "moe_fp4.model.planner",
    "moe_fp4.hf": "moe_fp4.integrations.hf",
    "moe_fp4.cli": "moe_fp4.compare.cli",
    "moe_fp4.data": "moe_fp4.compare.data",
    "moe_fp4.plots": "moe_fp4.compare.plots",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:
        # The module is already executed (it is the new one); binding it under the old name is all.
        pass


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Resolves an old flat module path to the module that now holds its names, with a DeprecationWarning."""

    def find_spec(self, fullname: str, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}; the old path is an alias and will be removed", DeprecationWarning,
                      stacklevel=2)
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
