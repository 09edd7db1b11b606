"""``import_or_skip``: the optional stacks a test needs (torchtitan, transformers, torchao), imported or the test
skipped with the reason. Apart from helpers.py because it imports neither torch nor moe_fp4: the modules whose
functions tests/distributed.py runs on spawned ranks call it at their top, where moe_fp4 must not load yet
(each rank chooses the pure-torch references first)."""

from __future__ import annotations

import importlib

import pytest


def import_or_skip(*names: str):
    """Import each module of ``names`` -> the last one; when an import fails in any way, skip the test (or,
    called at module level, the whole module) with the error's text as the reason. An optional stack that is
    installed but broken counts as missing: torchtitan 0.3.0 on a torch without what it imports raises
    ImportError ("cannot import name ..."), not ModuleNotFoundError, which ``pytest.importorskip`` passes
    through as a collection error."""
    module = None
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - whatever a broken package raises, the test cannot run
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            pytest.skip(f"{name} cannot be imported ({type(e).__name__}: {first})", allow_module_level=True)
    return module
