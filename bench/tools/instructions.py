"""SASS instructions per element of every conversion kernel, read from the hardware counters.

    python bench/tools/instructions.py                          # 32768 x 7168, every kernel, a table
    python bench/tools/instructions.py --ops mxfp4_to_fp8 --json inst.json

Runs ``bench/tools/tune.py --once`` (each kernel once with its launcher's defaults, in tune.py's order)
under Nsight Compute and reads, per kernel launch: thread-level instructions executed
(``smsp__thread_inst_executed.sum``), warp-level instructions, the integer (ALU) and FMA pipes'
share of issue, and DRAM bytes. Instructions per element = thread instructions / (tokens x hidden):
the number that has to fall for an issue-bound kernel to reach memory bandwidth (bench/RESULTS.md).
Needs ``ncu`` with access to the counters (the Firecracker machines; gVisor refuses them) and
``--clock-control none`` so the clocks stay as the timed runs see them.

``--limiters`` also reads what a kernel that misses its bandwidth target waits on: registers per
thread, achieved occupancy, eligible warps per scheduler per cycle, the issue slots used, the warp
cycles between two issued instructions and their split by stall reason (Nsight Compute's
``smsp__average_warps_issue_stalled_<reason>_per_issue_active``: long scoreboard = waiting on a global
load, barrier = a ``bar.sync``, short scoreboard = shared memory or a slow ALU result, ...), and DRAM
throughput as % of its peak. An issue-bound kernel shows issue near its ceiling and few stalls; a
latency-bound one long-scoreboard stalls with few eligible warps.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OPS = ["bf16_to_mxfp4", "mxfp4_to_bf16", "fp8_to_mxfp4", "bf16_to_fp8", "bf16_to_fp8_and_mxfp4", "mxfp4_to_fp8",
       "mxfp4_to_fp8_colwise", "fp8_to_fp8_colwise"]
METRICS = {
    "thread_inst": "smsp__thread_inst_executed.sum",
    "warp_inst": "smsp__inst_executed.sum",
    "alu_pct": "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "fma_pct": "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "issue_pct": "sm__inst_issued.avg.pct_of_peak_sustained_active",
    "dram_bytes": "dram__bytes.sum",
    "time_ns": "gpu__time_duration.sum",
}
STALLS = ["long_scoreboard", "barrier", "short_scoreboard", "mio_throttle", "lg_throttle", "wait",
          "math_pipe_throttle", "not_selected", "dispatch_stall", "no_instruction", "branch_resolving", "drain",
          "selected"]
LIMITERS = {
    "registers": "launch__registers_per_thread",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "eligible_warps": "smsp__warps_eligible.avg.per_cycle_active",
    "issue_active": "smsp__issue_active.avg.per_cycle_active",
    "cycles_per_issue": "smsp__average_warps_active_per_issue_active.ratio",
    "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    **{f"stall_{r}": f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio" for r in STALLS},
}


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:                                       # "n/a" where a counter is not available
        return float("nan")


def run_ncu(tokens: int, hidden: int, ops: list[str], ncu: str, metrics: dict[str, str] = METRICS) -> list[dict]:
    cmd = [ncu, "--csv", "--clock-control", "none", "--kernel-name", "regex:^_",
           "--metrics", ",".join(metrics.values()),
           sys.executable, os.path.join(HERE, "tune.py"), "--once", "--tokens", str(tokens), "--hidden", str(hidden),
           "--ops", *ops]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"ncu failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    body = proc.stdout[proc.stdout.find('"ID"'):]
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO(body)):
        rec = launches.setdefault(row["ID"], {"kernel": row["Kernel Name"]})
        for key, name in metrics.items():
            if row["Metric Name"] == name:
                rec[key] = _number(row["Metric Value"])
    rows = [launches[i] for i in sorted(launches, key=int)]
    if len(rows) != len(ops):
        sys.exit(f"expected {len(ops)} kernel launches (one per op), ncu saw {len(rows)}: "
                 f"{[r['kernel'] for r in rows]}")
    n = tokens * hidden
    for op, rec in zip(ops, rows):
        rec["op"] = op
        rec["inst_per_elem"] = rec["thread_inst"] / n
        rec["warp_inst_per_32_elem"] = rec["warp_inst"] / (n / 32)
    return rows


def limiter_table(rows: list[dict], top: int = 3) -> str:
    """A markdown table of the --limiters metrics, one row per kernel; the stall columns are the
    ``top`` largest shares of the cycles between two issued instructions, "selected" (issuing) left out."""
    out = ["| op | registers | occupancy % | eligible warps / scheduler | issue slots used % | cycles per issue | "
           "largest stalls (cycles per issue) | DRAM % of peak |",
           "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        stalls = sorted(((r.get(f"stall_{s}", 0.0), s) for s in STALLS if s != "selected"), reverse=True)[:top]
        out.append(f"| {r['op']} | {r.get('registers', float('nan')):.0f} | "
                   f"{r.get('occupancy_pct', float('nan')):.1f} | "
                   f"{r.get('eligible_warps', float('nan')):.2f} | {100 * r.get('issue_active', float('nan')):.1f} | "
                   f"{r.get('cycles_per_issue', float('nan')):.2f} | "
                   + ", ".join(f"{s.replace('_', ' ')} {v:.2f}" for v, s in stalls)
                   + f" | {r.get('dram_pct', float('nan')):.1f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ops", nargs="+", choices=OPS, default=OPS)
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="path of Nsight Compute's ncu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--limiters", action="store_true", help="also occupancy, issue, stall reasons and DRAM %%")
    a = ap.parse_args(argv)
    ops = [op for op in OPS if op in a.ops]  # tune.py launches in its own order
    rows = run_ncu(a.tokens, a.hidden, ops, a.ncu, {**METRICS, **LIMITERS} if a.limiters else METRICS)
    print(f"{a.tokens} x {a.hidden} elements; instructions are SASS, executed, per element (thread level)")
    print("| op | kernel | inst/elem | warp inst per 32 elem | issue % | ALU pipe % | FMA pipe % | DRAM GB | time us |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['op']} | `{r['kernel']}` | {r['inst_per_elem']:.2f} | {r['warp_inst_per_32_elem']:.2f} | "
              f"{r.get('issue_pct', float('nan')):.1f} | {r.get('alu_pct', float('nan')):.1f} | "
              f"{r.get('fma_pct', float('nan')):.1f} | {r.get('dram_bytes', 0) / 1e9:.3f} | "
              f"{r.get('time_ns', 0) / 1e3:.1f} |")
    if a.limiters:
        print()
        print(limiter_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tokens": a.tokens, "hidden": a.hidden, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
