"""Run ``python -m moe_fp4`` as a subprocess for the tests that train (tests/compare, tests/model).

TRITON_INTERPRET=0 and OMP_NUM_THREADS=1: the pure-torch reference conversions instead of the Triton
kernels under the interpreter; the launcher's rank variables are dropped so that a test run under
torchrun does not leak them into the child."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI_TIMEOUT_S = 240


def cli_env(**extra) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1", **extra)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def run_cli(args, nproc: int = 1, **env) -> subprocess.CompletedProcess:
    """Run ``python -m moe_fp4 <args>`` (under torchrun with ``nproc`` > 1) from the repository root."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)] if nproc > 1 else \
        [sys.executable]
    cmd = launch + ["-m", "moe_fp4", *map(str, args)]
    try:
        return subprocess.run(cmd, env=cli_env(**env), capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                              cwd=ROOT, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} timed out after {CLI_TIMEOUT_S} s:\n{e.stdout}\n{e.stderr}")


def assert_ok(run: subprocess.CompletedProcess) -> None:
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert "Traceback" not in run.stderr, run.stderr
