"""The package's layering, read from the source: no import cycle among moe_fp4's modules, nothing
imports a layer above its own, and no module of the package grows past about 500 lines without
saying why. Beside the layering, two rules of the source's text: comments and docstrings name no commit
ids, dates or issue numbers, and nothing refers to a file outside the repository.

Every import counts, at module level or inside a function (a lazy import is still a dependency).
The layers, bottom up (docs/DESIGN.md, section 1):

    kernels < formats < gemm, saved, exchange < model < integrations < compare

gemm, saved and exchange are peers and do not import one another. ``moe_fp4/__init__.py`` (the public
facade), ``__main__.py`` and ``_moved.py`` (aliases of the old flat paths) sit outside the layers.
"""

import ast
import io
import re
import tokenize
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
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
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
                   if lines[n] > MAX_LINES
                   and REASON not in (ast.get_docstring(ast.parse(MODULES[n].read_text())) or "")]
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


# Comments and docstrings give the reason in the present tense: no commit ids, dates or issue numbers (history
# belongs to git and bench/RESULTS.md). Comments are read with tokenize and docstrings with ast, so the string
# literals of real code are not flagged.
COMMIT = re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?!\w)")   # not 0x..., a version
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
ISSUE = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)
# (file, text) that match and are not history: an example of a printed banner.
NOT_HISTORY = {("moe_fp4/compare/origin.py", "abc1234")}


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """-> [(line, text)] of every comment and every module, class and function docstring of ``path``."""
    source = path.read_text()
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source, str(path))):
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, kinds) and (doc := ast.get_docstring(node, clean=False)) is not None:
            found.append((node.body[0].lineno, doc))
    return found


def test_the_history_check_reads_comments_and_docstrings():
    # a sanity check on the patterns and the reader: what they must find, and what they must not
    assert COMMIT.findall("(d7fb254, 2026-11-28)") == ["d7fb254"] and DATE.findall("2026-11-28") == ["2026-11-28"]
    assert ISSUE.findall("issue 47, issues 27") == ["issue 47", "issues 27"]
    assert not COMMIT.findall("0x7f800000 deadbeef 1234567 e4m3 bf16 v1.2.3abcdef0 float8_e4m3fn")
    texts = [t for _, t in _comments_and_docstrings(PACKAGE / "compare" / "origin.py")]
    assert any("abc1234" in t for t in texts)


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in MODULES.values()))
def test_comments_and_docstrings_name_no_history(path):
    hits = [f"{path}:{line}: {m.group(0)!r}" for line, text in _comments_and_docstrings(ROOT / path)
            for pattern in (COMMIT, DATE, ISSUE) for m in pattern.finditer(text)
            if (path, m.group(0)) not in NOT_HISTORY]
    assert hits == [], "commit ids, dates or issue numbers in comments or docstrings (give the reason instead):\n" \
        + "\n".join(hits)


# Nothing in the repository refers to a file outside it: a shared/ directory beside the checkout is not shipped.
OUTSIDE_PATH = re.compile(r"(?<![\w./-])shared/")


def test_nothing_refers_to_files_outside_the_repository():
    files = [*PACKAGE.rglob("*.py"), *KERNELS.glob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md",
             *(ROOT / "examples").glob("*.py"), *(ROOT / "bench").glob("*.py")]
    assert len(files) > 50 and OUTSIDE_PATH.search("see shared/notes.md") and not OUTSIDE_PATH.search("a/shared/b")
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in files for n, line in enumerate(p.read_text().splitlines(), 1)
            if OUTSIDE_PATH.search(line)]
    assert hits == [], f"references to shared/, outside the repository: {hits}"
