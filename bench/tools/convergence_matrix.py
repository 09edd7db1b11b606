"""Issue 47's convergence matrix from the runs of bench/tools/convergence_matrix.sh: per (mode, wire recipe), the
held-out and training losses over the seeds (mean, min, max), each candidate against the fp8 baseline, and a
verdict. A recipe is lossless when its mean held-out loss is within the fp8 seeds' spread (max - min) or 0.5%
of fp8's mean, whichever is larger, and its training loss (mean of the last 50 steps) likewise (issue 47's
rule). A seed changes the data order and the held-out batches alike, so the seeds' spread holds the held-out
sets' differences too; the paired columns compare each run with fp8's of the same seed (same batches, same
held-out set), and "paired within 0.5%" asks the mean of those differences to be within 0.5% for both
losses; each paired mean carries its standard error (the paired differences' standard deviation over the
square root of their number). Several RUNS directories pool their runs: each run is paired with the
baseline run of the same seed in its own directory, or where that directory has none (a job run with
BASELINE=0) with the first directory's that has one; a seed whose baseline ran in more than one directory
shows the baseline's run-to-run noise (GPU runs are not bitwise repeatable), printed as its own line.
With --plot PNG: the mean training-loss curve of each (smoothed over 25 steps) with its band over
the seeds, and each recipe's training loss minus fp8's of the same seed.

Usage: python3 bench/tools/convergence_matrix.py RUNS_DIR [RUNS_DIR ...] [--plot docs/convergence_recipes.png]
       [--json OUT]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys


def load(dirs: list[str]) -> dict[str, list[dict]]:
    """-> {"mode recipe": [row per run, with "seed" and "pair" (its directory's index, seed) added]} from every
    RUNS/*/compare.json of each directory."""
    out: dict[str, list[dict]] = {}
    paths = [(i, path) for i, runs in enumerate(dirs) for path in sorted(glob.glob(os.path.join(runs, "*",
                                                                                                  "compare.json")))]
    for i, path in paths:
        r = json.load(open(path))
        wire = r["meta"].get("wire") or {}
        for mode, row in r["modes"].items():
            roles = wire.get("per_mode", {}).get(mode, {})
            key = f"{mode} " + "/".join(roles.get(k, "?") for k in ("dispatch", "combine", "dispatch_grad",
                                                                     "combine_grad"))
            seed = r["config"]["seed"]
            out.setdefault(key, []).append({**row, "seed": seed, "pair": (i, seed), "path": path})
    return out


def mean_se(v: list[float]) -> tuple[float, float]:
    """-> (mean, standard error of the mean; nan for fewer than two values)."""
    if not v:
        return float("nan"), float("nan")
    return statistics.fmean(v), (statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else float("nan"))


def summary(rows: list[dict], key: str) -> dict:
    v = [r[key] for r in rows]
    return {"mean": statistics.fmean(v), "min": min(v), "max": max(v), "n": len(v)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--plot", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--baseline", default="fp8 fp8/bf16/bf16/fp8", help="the key of the baseline rows")
    a = p.parse_args(argv)
    groups = load(a.runs)
    if a.baseline not in groups:
        print(f"no baseline runs ({a.baseline!r}) under {' '.join(a.runs)}; found: {', '.join(groups) or 'nothing'}",
              file=sys.stderr)
        return 2
    base = {k: summary(groups[a.baseline], k) for k in ("loss_eval", "loss_final")}
    by_seed = {r["pair"]: r for r in groups[a.baseline]}
    for r in groups[a.baseline]:                  # runs of a directory without its own baseline pair with these
        by_seed.setdefault(("any", r["seed"]), r)
    for rows in groups.values():
        for r in rows:
            if r["pair"] not in by_seed and ("any", r["seed"]) in by_seed:
                r["pair"] = ("any", r["seed"])
    result = {}
    print(f"{'mode dispatch/combine/dispatch_grad/combine_grad':<46} {'seeds':>5} {'held-out mean':>13} "
          f"{'(min-max)':>17} {'vs fp8':>7} {'train mean':>10} {'vs fp8':>7} {'tokens/s':>9}  verdict; paired")
    for key, rows in groups.items():
        s = {k: summary(rows, k) for k in ("loss_eval", "loss_final")}
        verdict, deltas = [], {}
        for k in ("loss_eval", "loss_final"):
            b = base[k]
            allowed = max(b["max"] - b["min"], 0.005 * b["mean"])
            deltas[k] = 100 * (s[k]["mean"] - b["mean"]) / b["mean"]
            verdict.append(abs(s[k]["mean"] - b["mean"]) <= allowed)
        tps = statistics.fmean(r["tokens_per_s_per_gpu"] for r in rows)
        word = "baseline" if key == a.baseline else ("lossless" if all(verdict) else
                                                     "NOT lossless (" + ", ".join(
                                                         n for n, ok in zip(("held-out", "training"), verdict)
                                                         if not ok) + ")")
        paired = {k: [100 * (r[k] - by_seed[r["pair"]][k]) / by_seed[r["pair"]][k] for r in rows
                      if r["pair"] in by_seed] for k in ("loss_eval", "loss_final")}
        pm_se = {k: mean_se(v) for k, v in paired.items()}
        pm = {k: v[0] for k, v in pm_se.items()}
        strict = all(abs(v) <= 0.5 for v in pm.values())
        pair_txt = "" if key == a.baseline else (
            f"; paired held-out {', '.join(f'{v:+.2f}' for v in paired['loss_eval'])} (mean {pm['loss_eval']:+.2f}% "
            f"+- {pm_se['loss_eval'][1]:.2f}), training {', '.join(f'{v:+.2f}' for v in paired['loss_final'])} "
            f"(mean {pm['loss_final']:+.2f}% +- {pm_se['loss_final'][1]:.2f}): "
            + ("paired within 0.5%" if strict else "paired NOT within 0.5%"))
        print(f"{key:<46} {len(rows):>5} {s['loss_eval']['mean']:>13.4f} "
              f"({s['loss_eval']['min']:.4f}-{s['loss_eval']['max']:.4f}) {deltas['loss_eval']:>+6.2f}% "
              f"{s['loss_final']['mean']:>10.4f} {deltas['loss_final']:>+6.2f}% {tps:>9,.0f}  {word}{pair_txt}")
        result[key] = {**s, "delta_pct": deltas, "verdict": word, "seeds": sorted(r["seed"] for r in rows),
                       "tokens_per_s_mean": tps, "paired_pct": paired, "paired_mean_pct": pm,
                       "paired_se_pct": {k: v[1] for k, v in pm_se.items()},
                       "paired_within_half_pct": strict}
    b = base["loss_eval"]
    print(f"baseline spread: held-out {b['max'] - b['min']:.4f} ({100 * (b['max'] - b['min']) / b['mean']:.2f}%), "
          f"training {base['loss_final']['max'] - base['loss_final']['min']:.4f}; the bound is that or 0.5%")
    reruns: dict[int, list[dict]] = {}
    for r in groups[a.baseline]:
        reruns.setdefault(r["seed"], []).append(r)
    noise = {s: rs for s, rs in reruns.items() if len(rs) > 1}
    if noise:
        # The same seed (same weights, batches and held-out set) run again: what the GPU's non-determinism
        # alone moves the losses by; a paired difference of that size is not a recipe's effect.
        txt = "; ".join(f"seed {s}: " + ", ".join(f"{100 * (r[k] - rs[0][k]) / rs[0][k]:+.2f}%" for r in rs[1:]
                                                  for k in ("loss_eval", "loss_final")) for s, rs in noise.items())
        print(f"baseline run again with the same seed (held-out, training vs its first run): {txt}")
        result["baseline_reruns_pct"] = {str(s): [[100 * (r[k] - rs[0][k]) / rs[0][k] for k in ("loss_eval",
                                                                                                    "loss_final")]
                                                  for r in rs[1:]] for s, rs in noise.items()}
    if a.json:
        json.dump(result, open(a.json, "w"), indent=1)
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, dax) = plt.subplots(2, 1, figsize=(9, 9), height_ratios=(3, 2))
        w = 25
        colors = {key: f"C{i}" for i, key in enumerate(groups)}   # the same recipe, the same color in both

        def smooth(v, w=w):
            return [statistics.fmean(v[max(0, i - w + 1):i + 1]) for i in range(len(v))]

        for key, rows in groups.items():
            if key == a.baseline:
                continue
            diffs = [[100 * (x - y) / y for x, y in zip(r["loss_curve"], by_seed[r["pair"]]["loss_curve"])]
                     for r in rows if r["pair"] in by_seed]
            n = min(len(d) for d in diffs)
            dax.plot(range(1, n + 1), smooth([statistics.fmean(d[i] for d in diffs) for i in range(n)], 100),
                     lw=1.2, label=key, color=colors[key])
        dax.axhline(0, color="k", lw=0.6)
        dax.set_xlabel("step")
        dax.set_ylabel("training loss vs fp8, same seed (%; mean\nover seeds, 100-step mean)")
        dax.legend(fontsize=8)
        for key, rows in groups.items():
            curves = [r["loss_curve"] for r in rows]
            n = min(len(c) for c in curves)
            mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
            lo = [min(c[i] for c in curves) for i in range(n)]
            hi = [max(c[i] for c in curves) for i in range(n)]
            xs = range(1, n + 1)
            ax.plot(xs, smooth(mean), lw=1.2, label=f"{key} ({len(rows)} runs)", color=colors[key])
            ax.fill_between(xs, smooth(lo), smooth(hi), color=colors[key], alpha=0.15)
        ax.set_ylabel(f"training loss ({w}-step mean; band: min-max over seeds)")
        ax.set_yscale("log")
        ax.set_title("Wire recipes, small preset, exchanges simulated on one GPU (same data and seeds per recipe)")
        ax.legend(loc="upper right", ncol=1, fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
