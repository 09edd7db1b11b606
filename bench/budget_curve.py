"""Memory into speed: tokens/s of bf16, fp8 and fp4 against the memory budget (issue 30).

For each budget (GiB per GPU) and mode, the planner of ``moe-fp4 compare --plan auto``
(:func:`moe_fp4.compare.memory.plan_mode`) finds each recomputation policy's exact largest micro-batch (every
probe one step of a freshly built model), splits the global batch into the fewest micro-batches of at
most that size, times each distinct split (``--steps`` steps after ``--warmup``, fresh model) and keeps
the fastest. Printed and written per (budget, mode): the chosen policy, micro-batch x passes, measured
tokens/s per GPU and peak memory; fp4 / fp8 per budget; every candidate in the JSON.

    python bench/budget_curve.py --preset small --global-batch 64 --budgets 6 8 12 --json curve.json --plot curve.png
    python bench/budget_curve.py --preset dsv3-layers --global-batch 16 --budgets 62 70 84 --modes fp8 fp4
    torchrun --nproc-per-node 2 bench/budget_curve.py --preset dsv3-layers --global-batch 32 --budgets 47 52 70

Under torchrun the model is expert-parallel over the ranks (each mode's own wire recipe, or ``--wire``), the
global batch is split over them, every probe's memory is the largest rank's and every tokens/s the slowest
rank's, so all ranks plan alike; rank 0 prints and writes. ``--time-limit`` stops before starting a budget
that would run past it (the rows measured so far are written; the ranks decide on the slowest one's clock).
GPU only (on CPU there is no allocator to measure), unless ``--allow-cpu-budget`` (memory estimated, for tests).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace

import torch

GiB = 2**30


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--budgets", type=float, nargs="+", required=True, metavar="GIB")
    p.add_argument("--global-batch", type=int, required=True, metavar="N",
                   help="sequences per optimizer step, over all ranks")
    p.add_argument("--modes", nargs="+", default=["bf16", "fp8", "fp4"])
    p.add_argument("--steps", type=int, default=None, help="timed steps per candidate (default: compare's)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per candidate first (default: compare's)")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--lr", type=float, default=None, help="default: the preset's (moe-fp4 compare's)")
    p.add_argument("--data", default="random", choices=["random", "stdlib"])
    p.add_argument("--wire", default="", help="under torchrun: moe-fp4 compare's --wire (default: each mode's recipe)")
    p.add_argument("--slow-link", action="store_true", help="under torchrun: NCCL without peer-to-peer (NVLink)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="do not start another budget after S seconds")
    p.add_argument("--allow-cpu-budget", action="store_true", help="run on CPU with estimated memory (for tests)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, metavar="PNG", help="tokens/s against budget, one line per mode")
    a = p.parse_args(argv)
    from moe_fp4.compare.memory import prefer_expandable_segments
    prefer_expandable_segments()   # before the first CUDA allocation, as moe-fp4 compare does
    if not torch.cuda.is_available() and not a.allow_cpu_budget:
        print("budget_curve.py measures memory with CUDA's allocator: it needs a GPU (--allow-cpu-budget estimates "
              "it on CPU, for tests)", file=sys.stderr)
        return 2

    import torch.distributed as dist

    from moe_fp4.compare.cli import launch_env
    from moe_fp4.compare.config import CompareConfig, check_ep, per_rank_batch
    from moe_fp4.compare.data import stdlib_corpus
    from moe_fp4.compare.memory import plan_mode
    from moe_fp4.compare.origin import describe, provenance
    from moe_fp4.model.planner import PLAN_TIMED_STEPS, PLAN_WARMUP_STEPS, NothingFits

    try:
        base = CompareConfig(preset=a.preset, seq=a.seq, data=a.data, lr=a.lr, progress=False)
    except ValueError as e:
        print(f"budget_curve.py: {e}", file=sys.stderr)
        return 2
    env = launch_env(a.wire, a.slow_link)
    try:
        check_ep(base.model, env.world)
        per_rank = per_rank_batch(a.global_batch, env.world)
    except ValueError as e:
        if env.lead:
            print(f"budget_curve.py: {e}", file=sys.stderr)
        if env.world > 1:
            dist.destroy_process_group()
        return 2
    say = print if env.lead else (lambda *x, **k: None)

    def slowest(seconds: float) -> float:
        # every rank must take the same decision on the time limit, or the ranks part in a collective
        if env.world == 1:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64, device=env.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    corpus = stdlib_corpus() if a.data == "stdlib" else None
    meta = describe(env)
    say(f"{meta['device']} x {env.world} | torch {meta['torch']} | triton {meta['triton']} | {provenance(meta)} | "
        f"{meta['date']}")
    say(f"preset {a.preset}, global batch {a.global_batch} x seq {base.model.seq} ({per_rank} per rank), "
        f"lr {base.lr:g}, modes {' '.join(a.modes)}", flush=True)
    rows, t0, per_budget = [], time.perf_counter(), None
    try:
        for budget in a.budgets:
            elapsed = slowest(time.perf_counter() - t0)
            if a.time_limit is not None and per_budget is not None and elapsed + per_budget > a.time_limit:
                say(f"time limit: {elapsed:.0f} s used, a budget takes about {per_budget:.0f} s; stopping before "
                    f"{budget:g} GiB", flush=True)
                break
            tb = time.perf_counter()
            for mode in a.modes:
                cfg = replace(base, modes=(mode,), budget_gib=budget, global_batch=a.global_batch, plan=True)
                try:
                    plan = plan_mode(cfg, mode, env, corpus, per_rank, log=say,
                                     warmup_steps=PLAN_WARMUP_STEPS if a.warmup is None else a.warmup,
                                     timed_steps=PLAN_TIMED_STEPS if a.steps is None else a.steps)
                except NothingFits as e:
                    rows.append({"budget_gib": budget, "mode": mode, "fits": False, "why": str(e)})
                    say(f"{budget:g} GiB {mode}: {e}", flush=True)
                    continue
                rows.append({"budget_gib": budget, "mode": mode, "fits": True, **asdict(plan)})
                peak = "-" if plan.peak_bytes is None else f"{plan.peak_bytes / GiB:.2f} GiB"
                say(f"{budget:g} GiB {mode}: recompute {plan.policy}, micro-batch {plan.micro_batch} x "
                    f"{plan.passes}, {plan.tokens_per_s:,.0f} tokens/s, peak {peak}", flush=True)
            per_budget = slowest(time.perf_counter() - tb)
    finally:
        if env.world > 1:
            dist.destroy_process_group()
    if not env.lead:
        return 0
    print()
    print(f"{'budget GiB':>10} {'mode':<5} {'policy':<7} {'micro x passes':>14} {'tokens/s':>10} {'peak GiB':>9} "
          f"{'vs fp8':>7}")
    best = {(r["budget_gib"], r["mode"]): r for r in rows if r["fits"]}
    for r in rows:
        if not r["fits"]:
            print(f"{r['budget_gib']:>10g} {r['mode']:<5} does not fit")
            continue
        base_row = best.get((r["budget_gib"], "fp8"))
        ratio = f"{r['tokens_per_s'] / base_row['tokens_per_s']:.3f}x" if base_row else "-"
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / GiB:.2f}"
        print(f"{r['budget_gib']:>10g} {r['mode']:<5} {r['policy']:<7} {r['micro_batch']:>9} x {r['passes']:<2} "
              f"{r['tokens_per_s']:>10,.0f} {peak:>9} {ratio:>7}")
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
