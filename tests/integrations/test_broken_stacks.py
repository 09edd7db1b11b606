"""An optional stack that is installed but broken counts as missing: with torchtitan, transformers and torchao
each replaced by a package whose ``__init__`` raises ImportError (as torchtitan 0.3.0 does on a torch that lacks
``torch.distributed.fsdp.DataParallelMeshDims``), collecting tests/integrations succeeds, every module that
needs one of them is skipped with the import error as the reason, and the torchao test of tests/saved skips
the same way (optional_stacks.import_or_skip)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BROKEN = ("torchtitan", "transformers", "torchao")
WHY = "cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp' (a broken {} for this test)"


@pytest.fixture
def broken_env(tmp_path) -> dict:
    for name in BROKEN:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError({WHY.format(name)!r})\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _pytest(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_collection_skips_modules_whose_stack_is_broken(broken_env):
    r = _pytest(broken_env, "--collect-only", "-q", "tests/integrations")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ERROR collecting" not in out, out   # a collection error exits 2
    for name, module in (("torchtitan", "torchtitan.models.qwen3"), ("transformers", "transformers")):
        assert f"{module} cannot be imported (ImportError: {WHY.format(name)})" in out, out
    # Nothing that needs the broken stacks was collected; the GPU tests skip only at run time.
    collected = [line for line in out.splitlines() if "::" in line]
    assert collected and all(line.startswith("tests/integrations/test_integrations_gpu.py::") or
                             line.startswith("tests/integrations/test_broken_stacks.py::") for line in collected), out


def test_torchao_test_skips_when_torchao_is_broken(broken_env):
    r = _pytest(broken_env, "-q", "tests/saved/test_hook.py", "-k", "torchao")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "1 skipped" in out and "passed" not in out and "failed" not in out, out
    why = WHY.format("torchao")
    assert f"torchao.prototype.moe_training.config cannot be imported (ImportError: {why})" in out, out
