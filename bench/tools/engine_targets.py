"""The grouped-GEMM engine's targets, judged from one command that runs the three benchmarks behind them.

    python bench/tools/engine_targets.py --out /tmp/targets                 # GPU (sm90): runs, then judges
    python bench/tools/engine_targets.py --out /tmp/targets --judge-only    # judge the JSON files already there
    python bench/tools/engine_targets.py --out /tmp/targets --repeat 3      # each target: the median of 3 sets

It runs, one after the other in fresh processes, each writing its JSON into --out (its log beside it):

- ``bench/gemm.py --shape dsv3 small --wgrad-out bfloat16`` once per --routing (balanced, skew, ragged);
- ``bench/moe_layer.py --config dsv3 small --no-budget``;
- ``bench/experts.py`` (both shapes, forward + backward);

then prints the targets with their verdicts (also written to --out as targets.md and targets.json);
each target below as "target (from): threshold":

- every grouped GEMM of the step / one cuBLAS blockwise GEMM of the same size (gemm.py `gluon_vs_cublas`):
  >= 0.90, each routing and shape;
- ours against torch's row-wise grouped FP8 (`torch._scaled_grouped_mm`) (gemm.py, fprop / dgrad at dsv3):
  >= 1.00;
- layer step fp8 / bf16, fp4 / fp8 (moe_layer.py's own verdicts): dsv3 <= 0.80, small <= 0.95;
  dsv3 fp4/fp8 <= 1.00;
- experts fwd + bwd, fp8 (FP8 weights from AdamWFP8Weights) / torch's bf16 experts
  (experts.py `vs_torch_bf16`): dsv3 <= 0.75, small <= 0.95.

With ``--repeat N`` the whole set runs N times (files ``<name>_r<k>.json``) and each target is judged by
the median of its N values, every value listed: the ratios that sit on their lines (the dsv3 weight
gradients, fp4 / fp8 at dsv3; bench/RESULTS.md, "Engine targets") fall either side of them
from one run to the next.

An expected JSON that is absent or unreadable is named (table row and a "missing" line) and gives no
verdict. With none of them there (a wrong --out, or every benchmark failed) it says "nothing judged" and
exits 2, writing no table; with files but no target holding a value it exits 1; otherwise 0.

Reference lines (no verdict) show what each target's neighbours read: the MXFP4 A converted first, fp4 in
the experts, the weights quantized every pass, torchao's FP8 experts. The header names each JSON's
device and commit: a table is "one run" only where they agree, and the tool says so where they do not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The engine's thresholds. The layer's step-time thresholds are moe_layer.py's STEP_TARGETS, read from the
# verdicts it writes into its JSON (one place for them).
GEMM_VS_CUBLAS_MIN = 0.90            # every grouped GEMM / one cuBLAS blockwise scaled_mm of the same size
GEMM_VS_ROWWISE_MIN = 1.00           # ours / torch's row-wise grouped FP8, fprop and dgrad at dsv3
EXPERTS_FP8_VS_BF16_MAX = {"dsv3": 0.75, "small": 0.95}
EXPERTS_FP8 = "moe_fp4 fp8, FP8 weights from AdamWFP8Weights"
ROUTINGS = {"balanced": [], "skew": ["--skew"], "ragged": ["--ragged"]}
MXFP4_A = " (MXFP4 A)"


def _line(name, value, op=None, threshold=None, source="", detail=""):
    met = None if value is None or op is None else value <= threshold if op == "<=" else value >= threshold
    return {"name": name, "value": value, "target": f"{op} {threshold:g}" if op else None, "met": met,
            "source": source, "detail": detail}


def gemm_targets(results: list[dict], routing: str) -> list[dict]:
    """bench/gemm.py's results (one run, one routing) -> the GEMM lines: per shape the least gluon/cuBLAS
    over the step's FP8-A GEMMs, the least ours/row-wise at dsv3, and (no verdict) MXFP4 A converted first."""
    out, src = [], f"gemm.py {routing}"
    for shape in dict.fromkeys(r.get("shape") for r in results):
        rows = [r for r in results if r.get("shape") == shape]
        broken = [r["gemm"] for r in rows if "error" in r and not r["gemm"].endswith(MXFP4_A)]
        fp8 = [r for r in rows if "error" not in r and not r["gemm"].endswith(MXFP4_A)]
        ratios = {r["gemm"]: r.get("gluon_vs_cublas") for r in fp8}
        known = {k: v for k, v in ratios.items() if v is not None}
        worst = min(known, key=known.get) if known else None
        missing = broken + [k for k, v in ratios.items() if v is None]
        out.append(_line(f"{shape} grouped GEMM / cuBLAS, least of {len(ratios) + len(broken)}",
                         None if missing or not known else known[worst], ">=", GEMM_VS_CUBLAS_MIN, src,
                         f"no gluon number for {', '.join(missing)}" if missing else
                         f"least: {worst}; " + ", ".join(f"{k} {v:.2f}" for k, v in known.items())))
        if shape == "dsv3":
            vs_rw = {r["gemm"]: r["gluon_tflops"] / r["rowwise_tflops"] for r in fp8
                     if r.get("rowwise_tflops") and r.get("gluon_tflops")}
            if vs_rw:
                least = min(vs_rw, key=vs_rw.get)
                out.append(_line(f"{shape} grouped GEMM / torch row-wise grouped FP8, least of {len(vs_rw)}",
                                 vs_rw[least], ">=", GEMM_VS_ROWWISE_MIN, src,
                                 f"least: {least}; " + ", ".join(f"{k} {v:.2f}" for k, v in vs_rw.items())))
        # Each engine over the cuBLAS timed in its own rounds: the MXFP4 row's runs are not the FP8 row's,
        # and the same cuBLAS GEMM read 1218 and 1369 TFLOP/s in two rows of one H100 run.
        fprop = next((r.get("gluon_vs_cublas") for r in fp8 if r["gemm"] == "fc1 fprop"), None)
        for r in rows:
            if not r["gemm"].endswith(MXFP4_A):
                continue
            conv = None if "error" in r else r.get("gluon_vs_cublas")
            out.append(_line(f"{shape} {r['gemm']} converted first / FP8 A", conv / fprop if conv and fprop else None,
                             source=src, detail=f"reference, the layer's path: {conv or 0:.3f} / {fprop or 0:.3f}"))
    return out


def layer_targets(doc: dict) -> list[dict]:
    """bench/moe_layer.py's JSON -> its step-time lines with its own verdicts (fp8/bf16, fp4/fp8)."""
    out = []
    for c in doc.get("configs", []):
        for r in c.get("ratios", []):
            if r["name"] in ("step time fp8/bf16", "step time fp4/fp8"):
                line = _line(f"{c['config']} layer {r['name']}", r["value"], source="moe_layer.py")
                out.append({**line, "target": r["target"], "met": r["met"] if r["target"] else None})
    return out


def experts_targets(results: list[dict]) -> list[dict]:
    """bench/experts.py's results -> per shape fp8 (weights from AdamWFP8Weights) / torch bf16 against its
    threshold, and its neighbours as reference lines."""
    out = []
    for shape in dict.fromkeys(r.get("shape") for r in results):
        by = {r["variant"]: r for r in results if r.get("shape") == shape}
        fp8 = by.get(EXPERTS_FP8, {})
        limit = EXPERTS_FP8_VS_BF16_MAX.get(shape)          # a shape without a target: a reference line
        out.append(_line(f"{shape} experts fwd+bwd fp8 / torch bf16", fp8.get("vs_torch_bf16"),
                         "<=" if limit is not None else None, limit, "experts.py",
                         fp8.get("error", "FP8 weights from AdamWFP8Weights")))
        for ref in ("moe_fp4 fp4, FP8 weights from AdamWFP8Weights", "moe_fp4 fp8", "torchao fp8"):
            if ref in by:
                out.append(_line(f"{shape} experts {ref} / torch bf16", by[ref].get("vs_torch_bf16"),
                                 source="experts.py", detail="reference"))
    return out


def combine(runs: list[list[dict]]) -> list[dict]:
    """The lines of N repeats (each a list as the *_targets functions give) -> one line per name: the
    median of the repeats' values (those with one), judged against the same threshold, every repeat's
    value in the detail. Lines are matched by name and source (gemm.py's routings share their names).
    One repeat: its lines as they are."""
    if len(runs) == 1:
        return runs[0]
    by_key: dict[tuple[str, str], list[dict]] = {}
    for lines in runs:
        for r in lines:
            by_key.setdefault((r["name"], r["source"]), []).append(r)
    out = []
    for (name, _), rs in by_key.items():
        values = sorted(r["value"] for r in rs if r["value"] is not None)
        n = len(values)
        value = None if not n else values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
        target = rs[0]["target"]
        op, threshold = target.split() if target else (None, None)
        each = ", ".join("n/a" if r["value"] is None else f"{r['value']:.3f}" for r in rs)
        out.append({**_line(name, value, op, threshold and float(threshold), rs[0]["source"]), "target": target,
                    "detail": f"median of {n} of {len(runs)} runs ({each})"
                              + (f"; first run: {rs[0]['detail']}" if rs[0]["detail"] else "")})
    return out


def header_of(doc: dict) -> dict:
    return doc.get("header") or {k: doc.get(k) for k in ("device", "commit", "date")}


def render(lines: list[dict], heads: dict[str, dict]) -> str:
    """-> the markdown of the run: where each JSON came from, then one row per line."""
    seen = {(h.get("device"), h.get("commit")) for h in heads.values()}
    text = ["| file | device | commit | date |", "| --- | --- | --- | --- |"]
    text += [f"| {f} | {h.get('device')} | {h.get('commit')} | {h.get('date')} |" for f, h in heads.items()]
    if len(seen) > 1:
        text.append("\nNOT ONE RUN: the files come from different devices or commits.")
    text += ["", "| target | value | threshold | verdict | from | detail |", "| --- | ---: | --- | --- | --- | --- |"]
    for r in lines:
        v = "n/a" if r["value"] is None else f"{r['value']:.3f}"
        verdict = "" if r["target"] is None else "n/a" if r["met"] is None else "met" if r["met"] else "MISSED"
        text.append(f"| {r['name']} | {v} | {r['target'] or '(reference)'} | {verdict} | {r['source']} "
                    f"| {r['detail']} |")
    return "\n".join(text)


def run(out: str, name: str, script: str, args: list[str]) -> int:
    """One benchmark in a fresh process (the same interpreter and -P), its log in out/name.log."""
    cmd = [sys.executable] + (["-P"] if sys.flags.safe_path else []) + [os.path.join(BENCH, script)] + args
    cmd += ["--json", os.path.join(out, f"{name}.json")]
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    print(f"[{time.strftime('%H:%M:%S')}] {name}: exit {rc} after {time.time() - t0:.0f} s", flush=True)
    return rc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the benchmarks' JSON and logs and the table")
    p.add_argument("--iters", type=int, default=20, help="each benchmark's --iters (default 20)")
    p.add_argument("--routing", nargs="+", default=["balanced", "skew"], choices=list(ROUTINGS),
                   help="bench/gemm.py once per routing (default: balanced and skew)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the whole set this many times, each benchmark in a fresh process each time, and "
                        "judge each target by the median over the repeats (default 1: single runs of the "
                        "ratios that sit on their lines fall either side of them)")
    p.add_argument("--judge-only", action="store_true", help="run nothing; judge the JSON files in --out "
                   "(exit 2 if none of them is there)")
    args = p.parse_args()
    if args.iters < 20:
        p.error(f"--iters must be >= 20: the benchmarks time in 5 rounds, and rounds of fewer than 4 runs read "
                f"low (bench/RESULTS.md, 'Engine targets'); got {args.iters}")
    if args.repeat < 1:
        p.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.judge_only and not os.path.isdir(args.out):
        p.error(f"--judge-only: no folder {args.out}: nothing to judge")
    os.makedirs(args.out, exist_ok=True)
    it = ["--iters", str(args.iters)]
    jobs = [(f"gemm_{r}", "gemm.py", ["--shape", "dsv3", "small", "--wgrad-out", "bfloat16"] + ROUTINGS[r] + it)
            for r in args.routing]
    jobs += [("moe_layer", "moe_layer.py", ["--config", "dsv3", "small", "--no-budget"] + it),
             ("experts", "experts.py", it)]
    suffixes = [""] if args.repeat == 1 else [f"_r{k}" for k in range(1, args.repeat + 1)]
    if not args.judge_only:
        for suffix in suffixes:           # a whole set per repeat, so a slow spell of the GPU hits every target
            for name, script, a in jobs:
                run(args.out, name + suffix, script, a)
    runs, heads, missing = [], {}, []
    for suffix in suffixes:
        lines = []
        for name, _, _ in jobs:
            path = os.path.join(args.out, f"{name}{suffix}.json")
            try:
                with open(path) as fh:
                    doc = json.load(fh)
            except (OSError, ValueError) as e:       # absent, or cut short (a benchmark killed mid-write)
                why = "absent" if isinstance(e, FileNotFoundError) else f"unreadable: {e}"
                missing.append(f"{name}{suffix}.json ({why})")
                lines.append(_line(f"{name}: no results", None, source=path, detail=f"{why}; see its .log"))
                continue
            heads[f"{name}{suffix}.json"] = header_of(doc)
            if name.startswith("gemm_"):
                lines += gemm_targets(doc["results"], name[len("gemm_"):])
            elif name == "moe_layer":
                lines += layer_targets(doc)
            else:
                lines += experts_targets(doc["results"])
        runs.append(lines)
    expected = len(jobs) * len(suffixes)
    if not heads:
        # Nothing to judge: say so and fail, rather than a table of n/a and "0 missed".
        print(f"no results found in {args.out}: nothing judged (expected {expected} JSON files: "
              + ", ".join(missing) + ")", file=sys.stderr)
        sys.exit(2)
    lines = combine(runs)
    text = render(lines, heads)
    print(text)
    with open(os.path.join(args.out, "targets.md"), "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(args.out, "targets.json"), "w") as fh:
        json.dump({"headers": heads, "targets": lines}, fh, indent=1)
    if missing:
        print(f"\nmissing {len(missing)} of {expected} inputs in {args.out} (no verdict from them): "
              + ", ".join(missing))
    if not any(r["met"] is not None for r in lines):
        print(f"\nnothing judged: no target in {args.out} has a value", file=sys.stderr)
        sys.exit(1)
    missed = [r["name"] for r in lines if r["met"] is False]
    print(f"\n{len(missed)} missed" + (": " + "; ".join(missed) if missed else ""))


if __name__ == "__main__":
    main()
