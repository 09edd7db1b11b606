"""The package's layering, read from the source: no import cycle among moe_fp4's modules, nothing
imports a layer above its own, and no module of the package grows past about 500 lines without
saying why.

Every import counts, at module level or inside a function (a lazy import is still a dependency).
The layers, bottom up (docs/DESIGN.md, section 1):

    kernels < formats < gemm, saved, exchange < model < integrations < compare

gemm, saved and exchange are peers and do not import one another. ``moe_fp4/__init__.py`` (the public
facade), ``__main__.py`` and ``_moved.py`` (aliases of the old flat paths) sit outside the layers.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moe_fp4"
KERNELS = ROOT / "kernels"   # shipped as moe_fp4.kernels
LAYER = {"kernels": 0, "formats": 1, "gemm": 2, "saved": 2, "exchange": 2, "model": 3, "integrations": 4,
         "compare": 5}
OUTSIDE = {"moe_fp4", "moe_fp4.__main__", "moe_fp4._moved"}
MAX_LINES = 520   # "about 500"
REASON = "One idea at"   # what a longer module's docstring says, with its reason


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(("moe_fp4", *parts))
        out[name.removesuffix(".__init__")] = path
    for path in sorted(KERNELS.glob("*.py")):
        name = "moe_fp4.kernels" + ("" if path.stem == "__init__" else "." + path.stem)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The moe_fp4 modules ``name`` imports (``from pkg import submodule`` resolves to the submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYER.get(parts[1]) if len(parts) > 1 else None


def test_the_graph_is_read():
    # a sanity check on the parser: known edges are found
    assert "moe_fp4.formats.containers" in GRAPH["moe_fp4.formats.conversions"]
    assert "moe_fp4.model.moe" in GRAPH["moe_fp4.model.planner"]
    assert "moe_fp4.kernels.numerics" in GRAPH["moe_fp4.formats.containers"]


def test_no_import_cycle():
    # Tarjan's strongly connected components; any component of two or more modules is a cycle.
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert cycles == []


@pytest.mark.parametrize("name", [n for n in MODULES if n not in OUTSIDE])
def test_imports_go_down_only(name):
    mine = _layer(name)
    bad = []
    for dep in sorted(GRAPH[name]):
        if dep in OUTSIDE:
            if dep == "moe_fp4" and mine == LAYER["compare"]:
                continue   # the top layer may read the facade (moe_fp4.__version__)
            bad.append(dep)
            continue
        theirs = _layer(dep)
        same_package = dep.split(".")[1] == name.split(".")[1]
        if theirs > mine or (theirs == mine and not same_package):
            bad.append(dep)
    assert bad == [], f"{name} imports a layer at or above its own: {bad}"


# kernels/ holds one module per kernel family (its kernels, launcher and pure-torch reference side by
# side), so a family is as long as it is; the rule is for the package's own modules.
def test_long_modules_say_why():
    package = sorted(n for n in MODULES if not n.startswith("moe_fp4.kernels"))
    lines = {n: len(MODULES[n].read_text().splitlines()) for n in package}
    assert max(lines.values()) > 100   # the files were read
    unexplained = [f"{MODULES[n].relative_to(ROOT)} ({lines[n]} lines)" for n in package
                   if lines[n] > MAX_LINES and REASON not in (ast.get_docstring(ast.parse(MODULES[n].read_text())) or "")]
    assert unexplained == [], f"over {MAX_LINES} lines with no '{REASON} ...' reason in the docstring: {unexplained}"


def test_the_old_flat_paths_name_their_new_place():
    import sys
    import warnings

    import moe_fp4
    from moe_fp4._moved import MOVED

    for old, new in MOVED.items():
        sys.modules.pop(old, None)   # a cached alias would not warn again
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = __import__(old, fromlist=["_"])
        assert module.__name__ == new
        assert any(new in str(w.message) and w.category is DeprecationWarning for w in caught), old
    assert moe_fp4.__name__ == "moe_fp4"
