"""What limits a grouped FP8 GEMM: Nsight Compute's throughput, pipe and stall sections for one launch of
each engine at one GEMM of the expert layer.

    python bench/tools/gemm_limiters.py                              # dsv3 fc1 fprop, both engines
    python bench/tools/gemm_limiters.py --gemm "fc2 fprop" --out ncu.txt

Runs this script itself under ``ncu`` (``--child``: one launch of the Gluon engine, then one of the
Triton kernel, after an unprofiled warm-up that compiles them) and prints, per launch, the Speed of
Light, compute-workload (tensor pipe busy), memory-workload (L2 hit rate, shared-memory traffic),
occupancy and warp-state (stall reasons) sections as Nsight Compute words them. Needs ``ncu`` with
access to the counters; ``--clock-control none`` keeps the clocks of the timed runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "Occupancy", "WarpStateStats",
            "LaunchStats"]


def child(gemm: str, shape: str) -> None:
    """Build the operands of one GEMM (bench/gemm.py's shapes, balanced routing) and launch each engine:
    twice unprofiled (compile, warm), then once each inside the profiled range."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import moe_fp4
    from gemm import gemms  # bench/gemm.py
    from moe_fp4.gemm import quantize_fp8_weight
    from moe_fp4.kernels import gluon_grouped_gemm as GL
    from moe_fp4.kernels import grouped_gemm as G

    table, rows, e = gemms(shape)
    (_, kind, k_dim, n_dim), = [g for g in table if g[0] == gemm]
    if kind != "nt":
        sys.exit(f"gemm_limiters: {gemm!r} is not an M-grouped GEMM (the Gluon engine has fprop and dgrad)")
    counts = [rows // e // 128 * 128] * e
    counts[-1] += rows - sum(counts)
    x = torch.randn(sum(counts), k_dim, device="cuda", dtype=torch.bfloat16)
    a = moe_fp4.quantize_fp8(x)
    wq = quantize_fp8_weight(torch.randn(e, n_dim, k_dim, device="cuda") * k_dim ** -0.5)
    runs = [lambda: GL.grouped_mm_nt(a.data, a.scale, wq.data, wq.scale, counts),
            lambda: G.grouped_mm_nt(a.data, a.scale, wq.data, wq.scale, counts)]
    for fn in runs:
        fn(), fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in runs:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemm", default="fc1 fprop", help="a GEMM name of bench/gemm.py (fprop or dgrad)")
    ap.add_argument("--shape", default="dsv3", help="a shape of bench/gemm.py")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu")
    ap.add_argument("--out", help="also write ncu's report text here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.gemm, a.shape)
        return
    cmd = [a.ncu, "--clock-control", "none", "--profile-from-start", "off", "--kernel-name", "regex:grouped_mm_nt",
           *[f"--section={s}" for s in SECTIONS],
           sys.executable, os.path.abspath(__file__), "--child", "--gemm", a.gemm, "--shape", a.shape]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"ncu failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(proc.stdout)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(proc.stdout)


if __name__ == "__main__":
    main()
