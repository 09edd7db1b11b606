"""The README's Python snippets run as written on CPU. Skipped: the ones that ask for CUDA (each has a CPU
twin in the README) and those whose first line says they are a fragment (they need torchrun or the
reader's own model; the complete scripts are in examples/ and run in test_examples.py)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _snippets() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    return [b for b in blocks if not b.startswith("# fragment") and "cuda" not in b]


def test_readme_has_cpu_snippets():
    assert len(_snippets()) >= 3


@pytest.mark.parametrize("index", range(len(_snippets())))
def test_readme_snippet_runs(index):
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", _snippets()[index]], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
