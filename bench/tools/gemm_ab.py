"""Two versions of the Gluon grouped-GEMM engine, timed in turns in one process: a kernel change's
effect measured against the same clocks.

    git archive <old commit> kernels/gluon_grouped_gemm.py | tar -x -C /tmp/old
    python bench/tools/gemm_ab.py --old /tmp/old/kernels/gluon_grouped_gemm.py --routing balanced ragged

Single bench/gemm.py runs of one GEMM spread between calls on the same GPU by more than most kernel
changes gain (bench/RESULTS.md). Here each
round times the installed engine (``new``) and the module at ``--old`` (``old``; it imports its helpers
from the installed moe_fp4, so only that file may differ) back to back on the same operands (each
engine's calls issued back to back, GPU time, as bench/gemm.py times), and the table reports the median
over rounds of each and of the per-round ratio new / old with its min and max.
Routing as bench/gemm.py: ``balanced`` (every expert the mean rows, a multiple of 256 at both shapes),
``ragged`` (each row's expert drawn at random, counts padded to 128: about half the experts end in a
one-wave tile), ``skew`` (expert 0 holds 4x the mean).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/, for gemm.py

from gemm import SHAPES, gemms, route_counts  # noqa: E402
from harness import sm90_run, timed, write_results  # noqa: E402

import moe_fp4  # noqa: E402
from moe_fp4.gemm.engines import quantize_fp8_weight  # noqa: E402
from moe_fp4.kernels import gluon_grouped_gemm as NEW  # noqa: E402


def load_old(path: str):
    """The engine module at ``path`` under its own name (its jit kernels compile apart from the new ones)."""
    spec = importlib.util.spec_from_file_location("gluon_grouped_gemm_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def operands(kind: str, k_dim: int, n_dim: int, counts: list[int], e: int):
    """-> (args, out dtype) of grouped_mm_nt or grouped_mm_wgrad for one GEMM of the step."""
    r = sum(counts)
    if kind == "wgrad":
        a = moe_fp4.quantize_fp8(torch.randn(n_dim, r, device="cuda", dtype=torch.bfloat16))
        b = moe_fp4.quantize_fp8(torch.randn(k_dim, r, device="cuda", dtype=torch.bfloat16))
        return (a.data, a.scale, b.data, b.scale, counts), torch.bfloat16
    x = torch.randn(r, k_dim, device="cuda", dtype=torch.bfloat16)
    a = moe_fp4.quantize_mxfp4(x) if kind == "nt_mxfp4" else moe_fp4.quantize_fp8(x)
    w = quantize_fp8_weight(torch.randn(e, n_dim, k_dim, device="cuda") * k_dim ** -0.5)
    return (a.data, a.scale, w.data, w.scale, counts), torch.bfloat16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="path of the other version's kernels/gluon_grouped_gemm.py")
    p.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--routing", nargs="+", default=["balanced", "ragged"], choices=["balanced", "ragged", "skew"])
    p.add_argument("--gemm", nargs="+", help="only these GEMMs (bench/gemm.py's names)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=10, help="timed calls per engine and round (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    head = sm90_run("bench/tools/gemm_ab.py")
    old = load_old(args.old)
    print("| shape | routing | GEMM | R x N x K | one-wave tiles | old TFLOP/s | new TFLOP/s "
          "| new / old throughput (min, max) |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | --- |")
    results = []
    for shape in args.shape:
        table, rows, e = gemms(shape)
        for routing in args.routing:
            counts = route_counts(rows, e, routing)
            one_wave = sum(1 for c in counts if c % 256)
            for name, kind, k_dim, n_dim in table:
                if (args.gemm and name not in args.gemm) or kind == "nt_mxfp4":
                    continue
                ops, out = operands(kind, k_dim, n_dim, counts, e)
                fn = "grouped_mm_wgrad" if kind == "wgrad" else "grouped_mm_nt"
                run = {label: (lambda m=m: getattr(m, fn)(*ops, out)) for label, m in (("old", old), ("new", NEW))}
                ms = {"old": [], "new": []}
                for _ in range(args.rounds):
                    for label in ("old", "new"):
                        ms[label].append(timed(run[label], args.warmup, args.iters, back_to_back=True))
                flop = 2 * sum(counts) * n_dim * k_dim
                ratios = [o / n for o, n in zip(ms["old"], ms["new"])]
                med = {label: statistics.median(v) for label, v in ms.items()}
                res = {"shape": shape, "routing": routing, "gemm": name, "R": sum(counts), "N": n_dim, "K": k_dim,
                       "one_wave_tiles": one_wave, "old_ms": ms["old"], "new_ms": ms["new"],
                       "old_tflops": flop / med["old"] / 1e9, "new_tflops": flop / med["new"] / 1e9,
                       "new_over_old": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
                results.append(res)
                print(f"| {shape} | {routing} | {name} | {res['R']} x {n_dim} x {k_dim} | {one_wave} "
                      f"| {res['old_tflops']:.0f} | {res['new_tflops']:.0f} | {res['new_over_old']:.3f} "
                      f"({res['ratio_min']:.3f}, {res['ratio_max']:.3f}) |", flush=True)
                ops = None   # frees the operands before the next GEMM's (rebound, not del: the lambdas read it)
    write_results(args.json, head, results)


if __name__ == "__main__":
    main()
