"""Memory into speed: tokens/s of bf16, fp8 and fp4 against the memory budget (issue 30).

For each budget (GiB per GPU) and mode, the planner of ``moe-fp4 compare --plan auto``
(:func:`moe_fp4.compare.memory.plan_mode`) finds each recomputation policy's exact largest micro-batch (every
probe one step of a freshly built model), splits the global batch into the fewest micro-batches of at
most that size, times each distinct split (``--steps`` steps after ``--warmup``, fresh model) and keeps
the fastest. Printed and written per (budget, mode): the chosen policy, micro-batch x passes, measured
tokens/s per GPU and peak memory; fp4 / fp8 per budget; every candidate in the JSON.

    python bench/budget_curve.py --preset small --global-batch 64 --budgets 6 8 12 --json curve.json --plot curve.png
    python bench/budget_curve.py --preset dsv3-layers --global-batch 16 --budgets 62 70 84 --modes fp8 fp4

One process (no expert parallelism). ``--time-limit`` stops before starting a budget that would run past
it (the rows measured so far are written). GPU only: on CPU there is no allocator to measure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

GiB = 2**30


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--budgets", type=float, nargs="+", required=True, metavar="GIB")
    p.add_argument("--global-batch", type=int, required=True, metavar="N", help="sequences per optimizer step")
    p.add_argument("--modes", nargs="+", default=["bf16", "fp8", "fp4"])
    p.add_argument("--steps", type=int, default=None, help="timed steps per candidate (default: compare's)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per candidate first (default: compare's)")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--data", default="random", choices=["random", "stdlib"])
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="do not start another budget after S seconds")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, metavar="PNG", help="tokens/s against budget, one line per mode")
    a = p.parse_args(argv)
    from moe_fp4.compare.memory import prefer_expandable_segments
    prefer_expandable_segments()   # before the first CUDA allocation, as moe-fp4 compare does
    if not torch.cuda.is_available():
        print("budget_curve.py measures memory with CUDA's allocator: it needs a GPU", file=sys.stderr)
        return 2

    from moe_fp4.compare.config import CompareConfig, Env
    from moe_fp4.compare.memory import plan_mode
    from moe_fp4.compare.origin import describe, provenance
    from moe_fp4.model.decoder import PRESETS
    from moe_fp4.model.planner import PLAN_TIMED_STEPS, PLAN_WARMUP_STEPS
    from moe_fp4.compare.data import stdlib_corpus
    from moe_fp4.model.planner import NothingFits

    env = Env(torch.device("cuda"))
    corpus = stdlib_corpus() if a.data == "stdlib" else None
    meta = describe(env)
    print(f"{meta['device']} | torch {meta['torch']} | triton {meta['triton']} | {provenance(meta)} | {meta['date']}")
    print(f"preset {a.preset}, global batch {a.global_batch} x seq {PRESETS[a.preset].seq if a.seq is None else a.seq}, "
          f"modes {' '.join(a.modes)}", flush=True)
    rows, t0, per_budget = [], time.perf_counter(), None
    for budget in a.budgets:
        elapsed = time.perf_counter() - t0
        if a.time_limit is not None and per_budget is not None and elapsed + per_budget > a.time_limit:
            print(f"time limit: {elapsed:.0f} s used, a budget takes about {per_budget:.0f} s; stopping before "
                  f"{budget:g} GiB", flush=True)
            break
        tb = time.perf_counter()
        for mode in a.modes:
            cfg = CompareConfig(preset=a.preset, modes=(mode,), seq=a.seq, data=a.data, budget_gib=budget,
                                  global_batch=a.global_batch, plan=True, progress=False)
            try:
                plan = plan_mode(cfg, mode, env, corpus, a.global_batch, log=print,
                                   warmup_steps=PLAN_WARMUP_STEPS if a.warmup is None else a.warmup,
                                   timed_steps=PLAN_TIMED_STEPS if a.steps is None else a.steps)
            except NothingFits as e:
                rows.append({"budget_gib": budget, "mode": mode, "fits": False, "why": str(e)})
                print(f"{budget:g} GiB {mode}: {e}", flush=True)
                continue
            from dataclasses import asdict

            rows.append({"budget_gib": budget, "mode": mode, "fits": True, **asdict(plan)})
            print(f"{budget:g} GiB {mode}: recompute {plan.policy}, micro-batch {plan.micro_batch} x {plan.passes}, "
                  f"{plan.tokens_per_s:,.0f} tokens/s, peak {plan.peak_bytes / GiB:.2f} GiB", flush=True)
        per_budget = time.perf_counter() - tb
    print()
    print(f"{'budget GiB':>10} {'mode':<5} {'policy':<7} {'micro x passes':>14} {'tokens/s':>10} {'peak GiB':>9} "
          f"{'vs fp8':>7}")
    best = {(r["budget_gib"], r["mode"]): r for r in rows if r["fits"]}
    for r in rows:
        if not r["fits"]:
            print(f"{r['budget_gib']:>10g} {r['mode']:<5} does not fit")
            continue
        base = best.get((r["budget_gib"], "fp8"))
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base else "-"
        print(f"{r['budget_gib']:>10g} {r['mode']:<5} {r['policy']:<7} {r['micro_batch']:>9} x {r['passes']:<2} "
              f"{r['tokens_per_s']:>10,.0f} {r['peak_bytes'] / GiB:>9.2f} {ratio:>7}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "args": vars(a), "rows": rows}, f, indent=1, default=str)
    if a.plot:
        from moe_fp4.compare.plots import budget_curve_plot

        budget_curve_plot(rows, a.plot, f"{a.preset}, global batch {a.global_batch}, {meta['device']} "
                                         f"({provenance(meta)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
