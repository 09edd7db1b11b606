"""The Python snippets of README.md and of every docs/*.md page run as written on CPU, each in its own process.
Skipped: the ones that ask for CUDA (each has a CPU twin on its page) and those whose first line says they
are a fragment (they need torchrun or the reader's own model; the complete scripts are in examples/ and run
in test_examples.py)."""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# The least number of runnable snippets each page must keep: a page that loses its examples (or a fence
# that stops matching) fails here instead of passing with nothing run.
AT_LEAST = {"README.md": 3, "docs/api.md": 4, "docs/formats.md": 1, "docs/compare.md": 1, "docs/expert-parallel.md": 2}


def _blocks(page: str) -> list[str]:
    with open(os.path.join(ROOT, page)) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def _snippets(page: str) -> list[str]:
    return [b for b in _blocks(page) if not b.startswith("# fragment") and "cuda" not in b]


CASES = [(page, i) for page in PAGES for i in range(len(_snippets(page)))]


@pytest.mark.parametrize("page", sorted(AT_LEAST))
def test_page_has_cpu_snippets(page):
    assert page in PAGES, f"{page} is gone"
    assert len(_snippets(page)) >= AT_LEAST[page], page


def test_every_python_block_is_run_or_says_why():
    """A block is run, or starts with "# fragment: <why>", or is a GPU snippet saying so on its first line."""
    for page in PAGES:
        for block in _blocks(page):
            first = block.splitlines()[0] if block else ""
            if block in _snippets(page):
                continue
            assert first.startswith("# fragment:") or ("cuda" in block and first.startswith("# needs a CUDA GPU")), \
                (page, first)


def test_snippets_use_the_new_module_paths():
    """Every block, fragments too, imports moe_fp4's modules by their current paths, not the 0.1.0 aliases."""
    from moe_fp4._moved import MOVED

    old = re.compile(r"\b(" + "|".join(re.escape(m) for m in MOVED) + r")\b")
    for page in PAGES:
        for block in _blocks(page):
            assert not old.search(block), (page, old.search(block).group(0))


@pytest.mark.parametrize("page,index", CASES, ids=[f"{p}-{i}" for p, i in CASES])
def test_snippet_runs(page, index):
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", _snippets(page)[index]], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
