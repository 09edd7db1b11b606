"""bench/hf_experts.py's CPU path (``--shape tiny``): every variant trains the same model on the same batches,
its JSON holds a row per variant with the loss curve, and the FP8 variants' losses follow transformers' own
bf16 experts (the numbers of a GPU run are in bench/RESULTS.md)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers.integrations.moe")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Relative loss difference of the FP8 variants from grouped_mm at each of 4 steps of the tiny model (CPU,
# 2026-11-28): at most 2e-4; an experts implementation that dropped a slot or a weight would be off by far more.
LOSS_RTOL = 2e-3


def test_tiny_run_writes_every_variant(tmp_path):
    out = tmp_path / "hf.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "hf_experts.py"), "--shape", "tiny", "--batch", "2",
                          "--seq", "64", "--steps", "3", "--warmup", "1", "--no-progress", "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["grouped_mm", "moe_fp4_fp8", "moe_fp4"], rows.keys()
    base = rows["grouped_mm"]["loss_curve"]
    assert len(base) == 4 and base[-1] < base[0]
    for impl in ("moe_fp4_fp8", "moe_fp4"):
        curve = rows[impl]["loss_curve"]
        assert all(abs(a - b) <= LOSS_RTOL * b for a, b in zip(curve, base)), (impl, curve, base)
    assert "moe_fp4_fp8" in run.stdout and "vs bf16" in run.stdout
