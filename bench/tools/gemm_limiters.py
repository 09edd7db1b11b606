"""What limits each grouped FP8 GEMM of the expert layer's step: Nsight Compute's counters for one launch
of the Gluon engine and one of cuBLAS's blockwise scaled_mm of the same total size, side by side.

    python bench/tools/gemm_limiters.py                                   # every GEMM, dsv3 and small
    python bench/tools/gemm_limiters.py --shape dsv3 --gemm "fc1 fprop" "fc2 wgrad" --json lim.json --csv raw.csv

Runs this script itself under ``ncu`` (``--child``: builds each GEMM's operands as bench/gemm.py does,
balanced routing unless --routing, launches everything twice unprofiled to compile and warm, then
once each inside the profiled range). Before each labelled launch the child runs ``torch.cuda._sleep``
(ATen's ``spin_kernel``), so the profiled kernels split into one group per label however many kernels a launch
is (cuBLAS may add helpers; the MXFP4-A row converts A first). Per group the table gives the longest
kernel's counters and the group's summed time:

- tensor pipe: ``sm__pipe_tensor_op_*_cycles_active`` as % of the elapsed cycles (the metrics this
  ncu knows, found with ``--query-metrics``; on Hopper the gmma pipe);
- issue slots used, cycles between two issued instructions per warp and its three largest shares by
  stall reason (``smsp__average_warps_issue_stalled_<reason>_per_issue_active``), achieved occupancy;
- L2 hit rate, L2 and DRAM throughput (% of peak), and the SM clock the kernel ran at
  (``--clock-control none``: the clocks of the timed runs, not ncu's base clock).

The rows: ``gluon`` (the engine's path: for "fc1 fprop (MXFP4 A)" the conversion to FP8 and the
FP8-A kernel) and ``cublas``
(one dense scaled_mm of the same total M, N, K: 1x128 x 128x128 blockwise, or 1x128 x 1x128 for wgrad).
Needs a Hopper GPU and ``ncu`` with access to the counters.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
STALLS = ["long_scoreboard", "barrier", "short_scoreboard", "mio_throttle", "lg_throttle", "wait",
          "math_pipe_throttle", "not_selected", "dispatch_stall", "no_instruction", "branch_resolving", "drain",
          "membar", "sleeping", "misc", "tex_throttle", "imc_miss", "selected"]
METRICS = {
    "time_ns": "gpu__time_duration.sum",
    "sm_hz": "smsp__cycles_elapsed.avg.per_second",
    "issue_active": "smsp__issue_active.avg.per_cycle_active",
    "cycles_per_issue": "smsp__average_warps_active_per_issue_active.ratio",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers": "launch__registers_per_thread",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    # L2 throughput: a 256 x 128 tile reads 384 B of operands per 128 x 2 x 256 x 128 flops (170 flop/B)
    # whatever K is, so at the tensor rate the operands stream from L2 at several TB/s
    "l2_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "fma_pct": "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    **{f"stall_{r}": f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio" for r in STALLS},
}
MARKER = "spin_kernel"   # torch.cuda._sleep's kernel: one before each labelled launch


def child(shapes: list[str], names: list[str] | None, wgrad_out: str, labels_path: str,
          routing: str = "balanced") -> None:
    """Build every GEMM's launches, warm them, then launch each once inside the profiled range, a marker
    kernel before each; the labels go to labels_path in launch order."""
    import torch

    sys.path.insert(0, os.path.join(HERE, ".."))
    from gemm import gemms, route_counts  # bench/gemm.py

    import moe_fp4
    from moe_fp4.gemm.engines import FP8WeightTensor, fp8_mm_nt, quantize_fp8_weight
    from moe_fp4.kernels import gluon_grouped_gemm as GL

    launches = []   # (label dict, fn)
    for shape in shapes:
        table, rows, e = gemms(shape)
        for name, kind, k_dim, n_dim in table:
            if names and name not in names:
                continue
            counts = route_counts(rows, e, routing)
            r = sum(counts)
            label = {"shape": shape, "routing": routing, "gemm": name, "R": r, "N": n_dim, "K": k_dim,
                     "flop": 2 * r * n_dim * k_dim}
            if kind == "wgrad":
                dy = torch.randn(r, n_dim, device="cuda", dtype=torch.bfloat16)
                x = torch.randn(r, k_dim, device="cuda", dtype=torch.bfloat16)
                a, b = moe_fp4.quantize_fp8(dy.t().contiguous()), moe_fp4.quantize_fp8(x.t().contiguous())
                out = getattr(torch, wgrad_out)
                launches.append(({**label, "engine": "gluon"}, lambda a=a, b=b, c=counts, o=out: GL.grouped_mm_wgrad(
                    a.data, a.scale, b.data, b.scale, c, o)))
                launches.append(({**label, "engine": "cublas"}, lambda a=a, b=b, o=out: fp8_mm_nt(a, b, o)))
                continue
            x = torch.randn(r, k_dim, device="cuda", dtype=torch.bfloat16)
            wq = quantize_fp8_weight(torch.randn(e, n_dim, k_dim, device="cuda") * k_dim ** -0.5)
            a = moe_fp4.quantize_mxfp4(x) if kind == "nt_mxfp4" else moe_fp4.quantize_fp8(x)
            launches.append(({**label, "engine": "gluon"}, lambda a=a, w=wq, c=counts: GL.grouped_mm_nt(
                a.data, a.scale, w.data, w.scale, c, torch.bfloat16)))
            dense = moe_fp4.quantize_fp8(x) if kind == "nt_mxfp4" else a
            w1 = FP8WeightTensor(wq.data[0], wq.scale[0])
            launches.append(({**label, "engine": "cublas"}, lambda d=dense, w=w1: fp8_mm_nt(d, w, torch.bfloat16)))
    for _, fn in launches:
        fn(), fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _, fn in launches:
        torch.cuda._sleep(1000)
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    with open(labels_path, "w") as fh:
        json.dump([label for label, _ in launches], fh)


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:                                       # "n/a" where a counter is not available
        return float("nan")


def available_metrics(ncu: str) -> dict[str, str]:
    """-> METRICS that this ncu knows on this GPU (an unknown name fails the whole run), plus every stall
    reason it counts that METRICS lacks and the tensor-pipe activity counters (their names differ by
    architecture and ncu release; on Hopper the gmma pipe), found with ``ncu --query-metrics``."""
    proc = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True)
    known = set(re.findall(r"^(\w+)\s", proc.stdout, re.M))
    if not known:                                      # no list to check against: ask for METRICS as they are
        return dict(METRICS)
    out = {k: m for k, m in METRICS.items() if m.split(".")[0] in known}
    for reason in re.findall(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\s", proc.stdout, re.M):
        out.setdefault(f"stall_{reason}", f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio")
    for n in sorted(k for k in known if re.fullmatch(r"sm__pipe_(tensor\w*|shared)_cycles_active", k)):
        out[f"pipe_{n[len('sm__pipe_'):-len('_cycles_active')]}_pct"] = f"{n}.avg.pct_of_peak_sustained_elapsed"
    return out


def parse(text: str, metrics: dict[str, str], labels: list[dict]) -> list[dict]:
    """ncu's --csv text (one row per kernel and metric) + the child's labels -> one record per label:
    the longest kernel of its group, every kernel's name and time, the group's summed time."""
    body = text[text.find('"ID"'):]
    kernels: dict[str, dict] = {}
    by_name = {v: k for k, v in metrics.items()}
    for row in csv.DictReader(io.StringIO(body)):
        rec = kernels.setdefault(row["ID"], {"kernel": row["Kernel Name"]})
        if row["Metric Name"] in by_name:
            rec[by_name[row["Metric Name"]]] = _number(row["Metric Value"])
    groups: list[list[dict]] = []
    for i in sorted(kernels, key=int):
        if MARKER in kernels[i]["kernel"]:
            groups.append([])
        elif groups:
            groups[-1].append(kernels[i])
    if len(groups) != len(labels):
        sys.exit(f"gemm_limiters: {len(labels)} labelled launches but {len(groups)} marker kernels in ncu's report")
    out = []
    for label, group in zip(labels, groups):
        if not group:
            out.append({**label, "error": "no kernel after the marker"})
            continue
        main = max(group, key=lambda k: k.get("time_ns", 0.0))
        total = sum(k.get("time_ns", 0.0) for k in group)
        out.append({**label, **main, "group_ns": total, "tflops": label["flop"] / total / 1e3,
                    "kernels": [(k["kernel"][:80], k.get("time_ns")) for k in group]})
    return out


def table(rows: list[dict]) -> str:
    """A markdown table, one row per (GEMM, engine)."""
    pipes = sorted({k for r in rows for k in r if k.startswith("pipe_")})
    head = ["shape", "GEMM", "engine", "kernels", "ms", "TFLOP/s", "SM GHz", *[p[5:-4] + " pipe %" for p in pipes],
            "issue %", "occupancy %", "cycles / issue", "largest stalls (cycles per issue)", "L2 hit %", "L2 %",
            "DRAM %"]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 4 + ["---:"] * (len(head) - 4)) + " |"]
    nan = float("nan")
    for r in rows:
        if "error" in r:
            out.append(f"| {r['shape']} | {r['gemm']} | {r['engine']} | {r['error']} |")
            continue
        stalls = sorted(((v, k[6:]) for k, v in r.items() if k.startswith("stall_") and k != "stall_selected"
                         and v == v), reverse=True)[:3]
        cells = [r["shape"], r["gemm"], r["engine"], str(len(r["kernels"])), f"{r['group_ns'] / 1e6:.3f}",
                 f"{r['tflops']:.0f}", f"{r.get('sm_hz', nan) / 1e9:.2f}",
                 *[f"{r.get(p, nan):.1f}" for p in pipes], f"{100 * r.get('issue_active', nan):.1f}",
                 f"{r.get('occupancy_pct', nan):.1f}", f"{r.get('cycles_per_issue', nan):.2f}",
                 ", ".join(f"{s.replace('_', ' ')} {v:.2f}" for v, s in stalls),
                 f"{r.get('l2_hit_pct', nan):.1f}", f"{r.get('l2_pct', nan):.1f}", f"{r.get('dram_pct', nan):.1f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["dsv3", "small"], help="shapes of bench/gemm.py")
    ap.add_argument("--gemm", nargs="+", help="only these GEMMs (bench/gemm.py's names; default: every GEMM)")
    ap.add_argument("--routing", default="balanced", choices=["balanced", "skew", "ragged"],
                    help="expert row counts as bench/gemm.py routes them (default balanced)")
    ap.add_argument("--wgrad-out", default="bfloat16", choices=["bfloat16", "float32"],
                    help="dW dtype of the weight-gradient GEMMs (the layer writes bf16 for bf16 weights)")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--csv", help="also write ncu's raw CSV here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--labels", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.shape, a.gemm, a.wgrad_out, a.labels, a.routing)
        return
    metrics = available_metrics(a.ncu)
    with tempfile.TemporaryDirectory() as tmp:
        labels_path = os.path.join(tmp, "labels.json")
        cmd = [a.ncu, "--csv", "--clock-control", "none", "--profile-from-start", "off",
               "--metrics", ",".join(metrics.values()), sys.executable, os.path.abspath(__file__), "--child",
               "--labels", labels_path, "--wgrad-out", a.wgrad_out, "--routing", a.routing, "--shape", *a.shape]
        if a.gemm:
            cmd += ["--gemm", *a.gemm]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if a.csv:
            with open(a.csv, "w") as fh:
                fh.write(proc.stdout)
        if proc.returncode != 0 or not os.path.exists(labels_path):
            sys.exit(f"ncu failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(labels_path) as fh:
            labels = json.load(fh)
    rows = parse(proc.stdout, metrics, labels)
    print(table(rows))
    if a.json:
        import torch
        sys.path.insert(0, os.path.join(HERE, ".."))
        from moe_fp4.compare.origin import commit
        with open(a.json, "w") as fh:
            json.dump({"commit": commit(), "device": torch.cuda.get_device_name(), "metrics": metrics,
                       "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
