"""Markdown tables from bench/ep_scaling.sh's output directory (issue 13: EP = 4 and 8 on one host).

    python bench/ep_report.py OUT_DIR > tables.md

Reads what is there and says what is missing: ``a2a_nvlink.json`` / ``a2a_shm.json``
(bench/all_to_all.py), ``epN/A_nvlink_maxbatch``, ``epN/B_nvlink_batch*``, ``epN/C_slowlink_batch*``
and ``ep2/B_nvlink_batch*`` (each a ``compare.json`` from ``moe-fp4 compare``). Targets are the ones
issue 9 (all-to-all), issue 12 (compare) and issue 13 (weak scaling) set; each row says met or missed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

GiB = 2 ** 30
# issue 9: MXFP4 end to end against our FP8 all_to_all at 32768 x 7168 per rank
A2A_TARGET = {"nvlink": 0.75, "shm": 0.6}
# issue 12: fp4 tokens/s over fp8's (NVLink / slow link), activation memory reduction, largest batch ratio
COMPARE_TARGET = {"B": 1.0, "C": 1.15}
ACT_REDUCTION_TARGET = 0.25
MAX_BATCH_TARGET = 1.3
# issue 13: fp4 tokens/s per GPU at EP N over EP 2, same per-GPU batch
WEAK_SCALING_TARGET = 0.85
MODES = ("bf16", "fp8", "fp4")


def verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def _load(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _one(pattern: str) -> dict | None:
    hits = sorted(glob.glob(pattern))
    return _load(hits[-1]) if hits else None


def a2a_tables(out: str) -> list[str]:
    lines = []
    for link, name in (("nvlink", "NVLink"), ("shm", "slow link (NCCL_P2P_DISABLE=1)")):
        d = _load(os.path.join(out, f"a2a_{link}.json"))
        if d is None:
            lines += [f"(no a2a_{link}.json)", ""]
            continue
        h = d["header"]
        lines += [f"### All-to-all, {h['device']} x {h['world']}, {name} (commit {h['commit']}, {h['date']})", "",
                  "| H | rows/rank | bf16 ms | fp8 ms | mxfp4 ms | mx/fp8 | mx/(q8+wire) | bf16 GB/s | fp8 GB/s "
                  "| mx GB/s | check ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in d["all_to_all"]:
            lines.append(f"| {r['hidden']} | {r['rows']} | {r['bf16_ms']:.3f} | {r['fp8_ms']:.3f} "
                         f"| {r['mxfp4_ms']:.3f} | {r['mxfp4_vs_fp8']:.3f} | {r['mxfp4_vs_fp8_floor']:.3f} "
                         f"| {r['bf16_GBps']:.1f} | {r['fp8_GBps']:.1f} | {r['mxfp4_GBps']:.1f} "
                         f"| {r['check_ms']:.3f} |")
        big = [r for r in d["all_to_all"] if r["hidden"] == 7168 and r["rows"] == 32768]
        if big:
            r = big[0]
            lines.append(f"\nTarget at 32768 x 7168: mxfp4 <= {A2A_TARGET[link]}x fp8: {r['mxfp4_vs_fp8']:.3f}x, "
                         f"{verdict(r['mxfp4_vs_fp8'] <= A2A_TARGET[link])} (against the FP8 floor "
                         f"{r['mxfp4_vs_fp8_floor']:.3f}x)")
        if d.get("layer"):
            lines += ["", "| EP layer | tokens/rank | bf16 ms | fp8 ms | fp4 ms | fp4/fp8 |",
                      "| --- | --- | --- | --- | --- | --- |"]
            lines += [f"| {r['config']} | {r['tokens_per_rank']} | {r['bf16_ms']:.2f} | {r['fp8_ms']:.2f} "
                      f"| {r['fp4_ms']:.2f} | {r['fp4_vs_fp8']:.3f} |" for r in d["layer"]]
        lines.append("")
    return lines


def _row(name: str, rep: dict) -> list[str]:
    m = rep["modes"]
    get = lambda k, f: " | ".join(f(m[x][k]) if x in m and m[x][k] is not None else "-" for x in MODES)  # noqa: E731
    world = rep["meta"]["world"]
    return [f"| {name}: tokens/s per GPU (EP {world}) | {get('tokens_per_s_per_gpu', lambda v: f'{v:,.0f}')} | "
            f"{_ratio(m, 'tokens_per_s_per_gpu')} |",
            f"| {name}: step ms / a2a share | " + " | ".join(
                f"{m[x]['step_ms']:.1f} / " + ("-" if m[x]["a2a_share"] is None else f"{100 * m[x]['a2a_share']:.1f}%")
                if x in m else "-" for x in MODES) + " | |",
            f"| {name}: peak / activation GiB | " + " | ".join(
                f"{m[x]['peak_bytes'] / GiB:.2f} / {m[x]['activation_bytes'] / GiB:.2f}"
                if x in m and m[x]["peak_bytes"] is not None else "-" for x in MODES)
            + f" | {_ratio(m, 'peak_bytes')} / {_ratio(m, 'activation_bytes')} |"]


def _ratio(m: dict, key: str) -> str:
    if "fp4" not in m or "fp8" not in m or not m["fp8"][key]:
        return "-"
    return f"{m['fp4'][key] / m['fp8'][key]:.3f}"


def compare_tables(out: str, ngpu: int | None) -> list[str]:
    dirs = sorted(d for d in glob.glob(os.path.join(out, "ep*")) if os.path.isdir(d))
    widths = sorted({int(os.path.basename(d)[2:]) for d in dirs if os.path.basename(d)[2:].isdigit()})
    wide = ngpu or max((w for w in widths if w != 2), default=None)
    if wide is None:
        return ["(no compare runs under OUT/epN)"]
    base = os.path.join(out, f"ep{wide}")
    a = _one(os.path.join(base, "A_nvlink_maxbatch", "compare.json"))
    b = _one(os.path.join(base, "B_nvlink_batch*", "compare.json"))
    c = _one(os.path.join(base, "C_slowlink_batch*", "compare.json"))
    w = _one(os.path.join(out, "ep2", "B_nvlink_batch*", "compare.json"))
    lines = ["### `moe-fp4 compare`, small preset", ""]
    head = next((r for r in (b, a, c, w) if r), None)
    if head is None:
        return lines + [f"(no compare.json under {base} or {out}/ep2)"]
    meta = head["meta"]
    lines += [f"{meta['device']}, commit {meta['commit']}, {meta['date']}, torch {meta['torch']}, "
              f"triton {meta['triton']}", "",
              "| run | bf16 | fp8 | fp4 | fp4/fp8 |", "| --- | --- | --- | --- | --- |"]
    for name, rep in (("B NVLink", b), ("C slow link", c), ("W EP 2, B's batch", w), ("A largest batch", a)):
        if rep is not None:
            lines += [r.replace(f"{name}:", f"{name} (batch {_batches(rep)}):", 1) for r in _row(name, rep)]
    checks = []
    for name, rep, key in (("B", b, "B"), ("C", c, "C")):
        if rep is not None and "fp4" in rep["modes"] and "fp8" in rep["modes"]:
            r = rep["modes"]["fp4"]["tokens_per_s_per_gpu"] / rep["modes"]["fp8"]["tokens_per_s_per_gpu"]
            checks.append(f"- {name}: fp4 tokens/s >= {COMPARE_TARGET[key]}x fp8: {r:.3f}x, "
                          f"{verdict(r >= COMPARE_TARGET[key])}")
    if b is not None and "fp4" in b["modes"] and "fp8" in b["modes"]:
        red = 1 - b["modes"]["fp4"]["activation_bytes"] / b["modes"]["fp8"]["activation_bytes"]
        checks.append(f"- B: activation memory >= {ACT_REDUCTION_TARGET:.0%} below fp8: {red:.1%}, "
                      f"{verdict(red >= ACT_REDUCTION_TARGET)}")
    if a is not None and a.get("max_batch"):
        mb = {k: v["batch_max"] for k, v in a["max_batch"].items()}
        if mb.get("fp8") and "fp4" in mb:
            r = mb["fp4"] / mb["fp8"]
            checks.append(f"- A: largest batch in {a['config']['max_batch_gib']:g} GiB per GPU "
                          + ", ".join(f"{k} {v}" for k, v in mb.items())
                          + f"; fp4 >= {MAX_BATCH_TARGET}x fp8: {r:.2f}x, {verdict(r >= MAX_BATCH_TARGET)}")
    if b is not None and w is not None and "fp4" in b["modes"] and "fp4" in w["modes"]:
        r = b["modes"]["fp4"]["tokens_per_s_per_gpu"] / w["modes"]["fp4"]["tokens_per_s_per_gpu"]
        same = _batches(b) == _batches(w)
        checks.append(f"- weak scaling: fp4 tokens/s per GPU at EP {b['meta']['world']} over EP {w['meta']['world']}"
                      f"{'' if same else ' (batches differ!)'}: {r:.3f}x, target >= {WEAK_SCALING_TARGET}: "
                      f"{verdict(r >= WEAK_SCALING_TARGET and same)}")
    return lines + [""] + checks


def _batches(rep: dict) -> str:
    got = sorted({r["batch"] for r in rep["modes"].values()})
    return "/".join(map(str, got))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="bench/ep_scaling.sh's OUT_DIR")
    ap.add_argument("--ngpu", type=int, default=None, help="the wide run's EP (default: the widest epN other than ep2)")
    a = ap.parse_args()
    print("\n".join(a2a_tables(a.out) + compare_tables(a.out, a.ngpu)))


if __name__ == "__main__":
    main()
