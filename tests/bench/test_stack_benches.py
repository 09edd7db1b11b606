"""bench/hf_experts.py's and bench/torchtitan_experts.py's CPU paths (``--shape tiny``): every variant trains the
same model on the same batches, the JSON holds a row per variant with its loss curve, and the FP8 variants'
losses follow the stack's own bf16 experts (the numbers of GPU runs are in bench/RESULTS.md)."""

import json
import os
import subprocess
import sys

from optional_stacks import import_or_skip

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Relative loss difference of the FP8 variants from the stack's bf16 experts at each of 4 steps of the tiny
# model (CPU, 2026-11-28): at most 1.9e-4 (transformers), 5.2e-4 (torchtitan); an experts implementation that
# dropped a slot or a weight would be off by far more.
LOSS_RTOL = 2e-3


def _run(script: str, tmp_path, *extra) -> tuple[str, dict]:
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--shape", "tiny", "--batch", "2",
                          "--seq", "64", "--steps", "3", "--warmup", "1", "--no-progress", "--json", str(out), *extra],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout, {r["impl"]: r for r in json.loads(out.read_text())["rows"]}


def _follows(rows: dict, bf16: str) -> None:
    base = rows[bf16]["loss_curve"]
    assert len(base) == 4 and base[-1] < base[0]
    for impl in ("moe_fp4_fp8", "moe_fp4"):
        curve = rows[impl]["loss_curve"]
        assert len(curve) == 4 and all(abs(a - b) <= LOSS_RTOL * b for a, b in zip(curve, base)), (impl, curve, base)


def test_hf_experts_tiny(tmp_path):
    import_or_skip("transformers.integrations.moe")
    stdout, rows = _run("hf_experts.py", tmp_path)
    assert list(rows) == ["grouped_mm", "moe_fp4_fp8", "moe_fp4"], rows.keys()
    _follows(rows, "grouped_mm")
    assert "moe_fp4_fp8" in stdout and "vs bf16" in stdout
    # the peak's split: the same weights in every variant, AdamW's state twice them (exp_avg and exp_avg_sq in the
    # weights' dtype) plus its step counters; on CPU no peak, so no rest
    weights = {r["weights_gib"] for r in rows.values()}
    assert len(weights) == 1 and weights.pop() > 0, rows
    for r in rows.values():
        assert 2 * r["weights_gib"] <= r["optimizer_state_gib"] <= 2 * r["weights_gib"] * 1.01 and r["rest_gib"] is None


def test_torchtitan_experts_tiny(tmp_path):
    import_or_skip("torchtitan.models.deepseek_v3")
    stdout, rows = _run("torchtitan_experts.py", tmp_path, "--variants", "bf16", "moe_fp4_fp8", "moe_fp4")
    assert list(rows) == ["bf16", "moe_fp4_fp8", "moe_fp4"], rows.keys()
    assert all("skipped" not in r for r in rows.values()), rows
    _follows(rows, "bf16")
    assert rows["moe_fp4"]["saved_gib"] < rows["moe_fp4_fp8"]["saved_gib"]   # MXFP4 kept


def test_torchtitan_on_a_torch_without_fsdps_new_names():
    """bench/torchtitan_compat.py: with torch.distributed.fsdp.DataParallelMeshDims removed (as in torch 2.11)
    torchtitan's DeepSeek-V3 imports, the name is reported, and the stand-in raises when called or subclassed;
    on this torch nothing is stood in for."""
    import_or_skip("torchtitan.models.deepseek_v3")
    code = f"""
import sys
sys.path.insert(0, {os.path.join(ROOT, "bench")!r})
from torchtitan_compat import import_torchtitan
assert import_torchtitan("torchtitan.models.common.moe") == []
import torch.distributed.fsdp as fsdp
del fsdp.DataParallelMeshDims
got = import_torchtitan("torchtitan.models.deepseek_v3", "torchtitan.models.qwen3")
assert got == ["torch.distributed.fsdp.DataParallelMeshDims"], got
def subclass():
    class X(fsdp.DataParallelMeshDims):
        pass
for use in (lambda: fsdp.DataParallelMeshDims(), subclass):
    try:
        use()
    except RuntimeError as e:
        assert "does not exist in this torch" in str(e), e
    else:
        raise AssertionError("the stand-in did not raise")
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1"))
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
