"""torchtitan 0.3.0 on an older torch, for the benchmarks and GPU tests only.

torchtitan 0.3.0 imports names that torch 2.11 does not have yet (FSDP's ``DataParallelMeshDims`` in
``torch.distributed.fsdp``, imported by its DeepSeek-V3 and Qwen3 packages for their FSDP code). The
one-GPU benchmarks and tests here use none of that code: :func:`import_torchtitan` imports the modules
asked for, and for each name torch lacks puts a stand-in that raises as soon as anything calls, builds
or subclasses it, so a code path that needs the real thing fails loudly rather than silently. On a torch
that has every name nothing is changed. Returns the names stood in for, to be printed with the results.
"""

from __future__ import annotations

import importlib
import re
import sys

_MISSING = re.compile(r"cannot import name '(\w+)' from '([\w.]+)'")


class _StandIn:
    def __init__(self, module: str, name: str):
        self._what = f"{module}.{name}"

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._what} does not exist in this torch (stand-in from bench/torchtitan_compat.py)")

    def __mro_entries__(self, bases):
        raise RuntimeError(f"{self._what} does not exist in this torch (stand-in from bench/torchtitan_compat.py)")

    def __or__(self, other):   # annotations such as `DataParallelMeshDims | None` evaluated at import
        return object

    __ror__ = __or__

    def __repr__(self):
        return f"<stand-in for {self._what}>"


def import_torchtitan(*modules: str, attempts: int = 32) -> list[str]:
    """Import ``modules``; each ``ImportError: cannot import name N from M`` with M a torch module gets a
    stand-in for M.N and the import is retried -> ["M.N", ...] stood in for (empty on a new enough torch)."""
    stood_in: list[str] = []
    for _ in range(attempts):
        try:
            for m in modules:
                importlib.import_module(m)
            return stood_in
        except ImportError as e:
            found = _MISSING.search(str(e))
            if not found or not found.group(2).startswith("torch.") and found.group(2) != "torch":
                raise
            name, module = found.groups()
            setattr(importlib.import_module(module), name, _StandIn(module, name))
            stood_in.append(f"{module}.{name}")
            for loaded in [k for k in sys.modules if k.split(".")[0] in {m.split(".")[0] for m in modules}]:
                if loaded.startswith("torchtitan"):
                    del sys.modules[loaded]   # half-imported modules go; the next attempt imports them again
    raise ImportError(f"torchtitan still missing torch names after {attempts} stand-ins: {stood_in}")
