"""Where a result comes from: :func:`version` and :func:`commit` of the moe_fp4 that ran, :func:`describe`
(device, library versions, date and command line, the report's "meta") and :func:`provenance` (the
"moe_fp4 0.1.0, commit abc1234" of banners and plot titles). The bench scripts stamp their results
with these too.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys

import torch

from moe_fp4.compare.config import Env
from moe_fp4.gemm.engines import grouped_gemm_backend


def version() -> str:
    """moe_fp4's version, from the code that runs (not the metadata of whatever copy pip installed)."""
    from moe_fp4 import __version__

    return __version__


def _git(args: list[str], cwd: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10,
                          check=True).stdout.strip()


def _is_moe_fp4_project(root: str) -> bool:
    """Whether ``root`` holds moe_fp4's own pyproject.toml (name = "moe_fp4")."""
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return False
    return re.search(r'(?m)^\s*name\s*=\s*["\']moe[_-]fp4["\']', text) is not None


def commit() -> str | None:
    """MOE_FP4_COMMIT if set (recorded when the tree was copied or built without its git history), else
    git's short HEAD of moe_fp4's own checkout ("+dirty" with uncommitted changes to tracked files):
    the package's parent directory must be the top of a git work tree that holds moe_fp4's
    pyproject.toml (a source checkout or an editable install). None otherwise: a wheel installed into
    some other repository's virtual environment must not report that repository's commit."""
    if os.environ.get("MOE_FP4_COMMIT"):
        return os.environ["MOE_FP4_COMMIT"]
    # this file is <root>/moe_fp4/compare/origin.py
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not _is_moe_fp4_project(root):
        return None
    try:
        if not os.path.samefile(_git(["rev-parse", "--show-toplevel"], root), root):
            return None
        sha = _git(["rev-parse", "--short", "HEAD"], root)
        dirty = _git(["status", "--porcelain", "--untracked-files=no"], root)
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "")


def provenance(meta: dict) -> str:
    """meta: describe()'s dict -> "moe_fp4 0.1.0, commit abc1234" (no commit part when there is none)."""
    return f"moe_fp4 {meta['version']}" + (f", commit {meta['commit']}" if meta.get("commit") else "")


def describe(env: Env) -> dict:
    """The run's "meta": device and GPU count, world size, torch / triton / Python versions, moe_fp4's
    version and commit, the grouped-GEMM backend, the CUDA allocator's setting (``PYTORCH_CUDA_ALLOC_CONF``,
    "default" when unset), the date (UTC) and the command line."""
    import triton

    dev = torch.cuda.get_device_name(env.device) if env.cuda else f"CPU ({platform.processor() or platform.machine()})"
    return {"device": dev, "gpus": env.world if env.cuda else 0, "world": env.world,
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "version": version(), "commit": commit(), "grouped_gemm": grouped_gemm_backend(env.device).value,
            "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([_program()] + sys.argv[1:])}


def _program() -> str:
    name = os.path.basename(sys.argv[0])
    return "moe-fp4" if name in ("__main__.py", "moe-fp4") else name


__all__ = ["commit", "describe", "provenance", "version"]
