"""What ``moe-fp4 compare`` prints: the banner (:func:`banner_lines`), each mode's line before it trains
(:func:`mode_line`: batch, split, recomputation, the format its activations are saved in and the
all-to-all's wire formats) and after (:func:`done_line`), the plan table (:func:`plan_table`), the final
table (:func:`table`, with :func:`row_line` per mode) and the ratios behind it (:func:`ratios`).

Text only: every function here takes numbers already measured (a report dict or a row) and returns a
string, so what a user reads can be tested without training anything.
"""

from __future__ import annotations

import math

from moe_fp4.compare.config import GiB
from moe_fp4.compare.origin import provenance

CPU_NOTE = ("CPU run: conversions by {path}, FP8 GEMMs emulated in float32; CPU timings mean nothing, they "
            "only show that every path runs. Measure on a GPU.")
# What each mode keeps for backward (the fp4 mode: --storage; hf+hook: the compression hook's default).
SAVED_FORMAT = {"bf16": "bf16", "fp8": "fp8 (1x128 blocks)", "fp4": "mxfp4", "hf": "bf16", "hf+hook": "mxfp4"}


def ranks_legend(world: int) -> str | None:
    """What each printed number is under expert parallelism (None on one process): the table's
    columns are reduced over ranks, each in its own way."""
    if world == 1:
        return None
    return (f"{world} ranks: tokens/s/GPU and step ms are the slowest rank's, peak and activation memory the "
            f"largest rank's; the all-to-all share and the losses are means over the {world} ranks (the progress "
            f"lines during training show rank 0's loss)")


def ratios(rows: dict[str, dict], base: str = "fp8") -> dict:
    """{mode: {key: mode's value / base's}} for throughput and memory, and loss deltas in % of bf16 and fp8."""
    out = {}
    for m, r in rows.items():
        d = {}
        b = rows.get(base)
        for key in ("tokens_per_s_per_gpu", "step_ms", "peak_bytes", "activation_bytes", "saved_bytes"):
            if b and r.get(key) and b.get(key):
                d[f"{key}_vs_{base}"] = r[key] / b[key]
        for ref in ("bf16", "fp8"):
            if ref in rows and ref != m:
                for key in ("loss_final", "loss_eval"):
                    d[f"{key}_delta_pct_vs_{ref}"] = 100.0 * (r[key] - rows[ref][key]) / rows[ref][key]
        out[m] = d
    return out


def _gib(v) -> str:
    return "-" if v is None else f"{v / GiB:.2f} GiB" if v >= GiB else f"{v / 2**20:.1f} MiB"


def done_line(r: dict, world: int = 1) -> str:
    """One mode's result as it finishes, every number named (the table's header comes at the end)."""
    slowest, largest, mean = ("", "", "") if world == 1 else (" (slowest rank)", " (largest rank)",
                                                              f" (means over {world} ranks)")
    parts = [f"{r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, {r['step_ms']:.1f} ms/step{slowest}"]
    if r.get("recompute", "none") != "none":
        parts.append(f"recompute {r['recompute']}")
    if r.get("storage", "mxfp4") != "mxfp4":
        parts.append(f"activations stored in {r['storage']}")
    peak = "" if r["peak_bytes"] is None else f"peak {_gib(r['peak_bytes'])}, "
    parts.append(f"memory{largest}: {peak}activation {_gib(r['activation_bytes'])}")
    if r["a2a_share"] is not None:
        parts.append(f"all-to-all {100 * r['a2a_share']:.1f}% of the step")
    if r.get("dispatch_rows"):
        parts.append(dispatch_rows_line(r["dispatch_rows"]))
    if r.get("grad_wire_auto"):
        parts.append(grad_wire_line(r["grad_wire_auto"]))
    parts.append(f"loss {r['loss_final']:.4f}, eval loss {r['loss_eval']:.4f}{mean}")
    return f"{r['mode']} done: " + ", ".join(parts)


def dispatch_rows_line(d: dict) -> str:
    """The routing's balance over the steps: the most loaded rank's dispatched rows against the mean."""
    imb = d["imbalance"]
    return (f"dispatched rows, largest rank / mean {imb[0]:.2f} at step 1 -> {imb[-1]:.2f} (max {max(imb):.2f}, "
            f"{max(d['max_rank']):,.0f} rows)")


def grad_wire_line(rules: dict) -> str:
    """The sqrt(3) rule's outcome per layer and gradient, one clause each."""
    out = []
    for layer, per in rules.items():
        for g, d in per.items():
            if not d["steps"]:
                out.append(f"{layer} {g}: not measured")
                continue
            fell = ("never below sqrt(3)" if d["fell_back_at"] is None
                    else f"{d.get('fallback', 'bf16')} from step {d['fell_back_at']}")
            weight = ""
            if d.get("weight_steps"):
                weight = (f", FC2 weight gradient norm/noise {d['weight_ratio_first']:.2f} -> "
                          f"{d['weight_ratio_last']:.2f} (min {d['weight_ratio_min']:.2f})")
            out.append(f"{layer} {g} {d['format']} norm/noise {d['ratio_first']:.2f} -> {d['ratio_last']:.2f} "
                       f"(min {d['ratio_min']:.2f}){weight}, {fell}")
    return "sqrt(3) rule: " + "; ".join(out)


def row_line(r: dict) -> str:
    share = "-" if r["a2a_share"] is None else f"{100 * r['a2a_share']:.1f}%"
    return (f"{r['mode']:<8} {r['tokens_per_s_per_gpu']:>12,.0f} {r['step_ms']:>9.1f} {_gib(r['peak_bytes']):>10} "
            f"{_gib(r['activation_bytes']):>10} {share:>7} {r['loss_final']:>8.4f} {r['loss_eval']:>8.4f}")


def wire_bytes_lines(rows: dict[str, dict], base: str = "fp8") -> list[str]:
    """Per mode, the bytes each exchange sent to other ranks per optimizer step (the mean over ranks), and
    their total against ``base``'s; nothing without expert parallelism."""
    have = {m: r["wire_bytes_per_step"] for m, r in rows.items() if r.get("wire_bytes_per_step")}
    if not have:
        return []
    out = ["all-to-all bytes sent per step and rank (to other ranks):"]
    for m, b in have.items():
        total = sum(b.values())
        vs = f" ({total / sum(have[base].values()):.3f}x {base})" if base in have and m != base and \
            sum(have[base].values()) else ""
        out.append(f"  {m:<8} " + ", ".join(f"{role} {_gib(v)}" for role, v in b.items() if role != "count")
                   + f", total {_gib(total)}{vs}")
    return out


def table(report: dict) -> str:
    """The comparison as text: the header, one row per mode, then the ratios against the baseline, the
    largest batches and the notes."""
    m = report["meta"]
    base = "hf" if report["config"]["hook"] else "fp8"
    lines = [f"{m['device']} x {m['world']} | torch {m['torch']} | triton {m['triton']} | {provenance(m)} | "
             f"{m['date']}",
             f"{'mode':<8} {'tokens/s/GPU':>12} {'step ms':>9} {'peak mem':>10} {'act mem':>10} {'a2a':>7} "
             f"{'loss':>8} {'eval':>8}"]
    lines += [row_line(r) for r in report["modes"].values()]
    # Nothing lost: a mode that failed is named with its reason; the others' rows stand.
    lines += [f"{m:<8} failed: {why}" for m, why in report.get("failed", {}).items()]
    if report.get("interrupted"):
        lines.append(f"interrupted ({report['interrupted']}): the modes not shown did not finish")
    # Ratios only against a baseline that ran (a run of --modes fp4 alone has none to show).
    against = {mode: d for mode, d in report["ratios"].items() if mode != base and base in report["modes"]}
    if against:
        lines.append(f"ratios vs {base}:")
    for mode, d in against.items():
        parts = [f"tokens/s {d.get(f'tokens_per_s_per_gpu_vs_{base}', math.nan):.3f}x"]
        if f"peak_bytes_vs_{base}" in d:
            parts.append(f"peak memory {d[f'peak_bytes_vs_{base}']:.3f}x")
        parts.append(f"activation memory {d.get(f'activation_bytes_vs_{base}', math.nan):.3f}x")
        parts += [f"eval loss {d[k]:+.2f}% vs {k.rsplit('_', 1)[1]}" for k in d if k.startswith("loss_eval_delta")]
        lines.append(f"  {mode:<8} " + ", ".join(parts))
    lines += wire_bytes_lines(report["modes"], base)
    if report["max_batch"]:
        mb = report["max_batch"]
        lines.append(f"largest batch per device in {report['config']['max_batch_gib']:g} GiB: "
                     + ", ".join(f"{k} {v['batch_max']}" for k, v in mb.items())
                     + ("" if base not in mb or not mb[base]["batch_max"] else
                        " (" + ", ".join(f"{k} {v['batch_max'] / mb[base]['batch_max']:.2f}x"
                                         for k, v in mb.items() if k != base) + f" of {base})"))
    if report.get("plans"):
        cfg = report["config"]
        lines.append(f"plan per mode in {cfg['budget_gib']:g} GiB per device at global batch {cfg['global_batch']} "
                     f"(the measured fastest policy and micro-batch that fit):")
        for mode, p in report["plans"].items():
            # (a compare.json from an older moe_fp4 may lack the split and the reason)
            tried = ", ".join(f"{c['policy']} " + (f"{c['micro_batch']} x {c['passes']} " if "passes" in c else "")
                              + f"{c['tokens_per_s']:,.0f}" + (" (over the budget)" if c.get("why") else "")
                              for c in p["candidates"] if c["tokens_per_s"] is not None)
            lines.append(f"  {mode:<8} recompute {p['policy']}, micro-batch {p['micro_batch']} x {p['passes']} "
                         f"passes (tokens/s while planning: {tried})")
    lines += ["note: " + n for n in report["notes"]]
    return "\n".join(lines)



def saved_format(mode: str, storage: str = "mxfp4") -> str:
    """The format ``mode`` keeps its saved activations in (the fp4 mode's is ``storage``)."""
    return storage if mode == "fp4" else SAVED_FORMAT[mode]


def wire_text(wire: dict, mode: str) -> str:
    """meta["wire"] -> the formats of ``mode``'s four exchanges: "recipe fp8: dispatch fp8, combine bf16,
    dispatch_grad bf16, combine_grad fp8", an "auto" gradient as "auto (nvfp4-sr, fp8 after 10 steps
    below sqrt(3))", "(simulated on one process)" under --simulate-wire, and "(fp4's default on a network
    link)" where the mode's default recipe followed the link."""
    from moe_fp4.exchange.recipes import PRECISION_RECIPE, RECIPES, default_recipe_name, follows_link

    auto = wire.get("auto") or {}
    roles = wire["per_mode"][mode]
    parts = []
    for role, fmt in roles.items():
        if fmt == "auto" and auto:
            # compare.json files from before the fallback was named fell back to bf16
            fallback = auto.get("fallback", "bf16")
            fmt = f"auto ({auto['format']}, {fallback} after {auto['patience']} steps below sqrt(3))"
        parts.append(f"{role} {fmt}")
    # The recipe's name when the four formats are a named recipe's.
    named = [n for n, r in RECIPES.items() if r.as_dict() == roles]
    given = wire.get("recipe")
    # compare.json files from before the defaults followed the link have no "link": the peer defaults.
    link = wire.get("link")
    default = default_recipe_name(mode, link) if mode in PRECISION_RECIPE else None
    chosen = given.get(mode) if isinstance(given, dict) else given
    base = chosen or default
    name = base if base in named else (named[0] if named else None)
    head = f"recipe {name}: " if name else ""
    tail = " (simulated on one process)" if wire.get("simulated") else ""
    if link and not chosen and name == default and follows_link(mode):
        tail += f" ({mode}'s default on a {link} link)"
    return head + ", ".join(parts) + tail


def banner_lines(cfg, mc, meta: dict, counts: dict | None, world: int) -> list[str]:
    """The run's first lines: preset, shape, modes, steps and data; parameters, device, versions,
    optimizer and provenance. ``counts``: :func:`moe_fp4.model.decoder.parameter_count` (None: not
    counted, --hook)."""
    params = (f"{counts['total'] / 1e6:.1f} million parameters ({counts['active_per_token'] / 1e6:.1f} million "
              f"active per token); " if counts else "")
    return [f"moe-fp4 compare: preset {cfg.preset} ({mc.layers} layers, hidden {mc.hidden}, {mc.num_experts} experts "
            f"top-{mc.top_k}, ffn {mc.ffn}, seq {mc.seq}), modes {', '.join(cfg.modes)}, {cfg.steps} steps "
            f"({cfg.warmup} untimed), data {cfg.data}",
            f"  {params}{meta['device']} x {world}, torch {meta['torch']}, triton {meta['triton']}, "
            f"grouped GEMMs {meta['grouped_gemm']}, optimizer {cfg.optimizer}, {provenance(meta)}"]


def mode_line(mode: str, steps: int, batch: int, seq: int, micro: int | None, policy: str, storage: str,
              wire: dict | None) -> str:
    """The line before a mode trains: steps, batch and its split, the recomputation (when any), the
    format its activations are saved in, and its all-to-all's wire formats (``wire``: meta["wire"], None
    without expert parallelism)."""
    split = "" if micro in (None, batch) else \
        f" ({-(-batch // micro)} micro-batches of up to {micro}, gradients accumulated)"
    again = "" if policy == "none" else f", recompute {policy}"
    line = f"[{mode}] training {steps} steps at batch {batch} x {seq} per rank{split}{again}; " \
           f"activations saved in {saved_format(mode, storage)}"
    if wire is not None and mode in wire["per_mode"]:
        line += f"; all-to-all {wire_text(wire, mode)}"
    return line


def plan_table(plan: dict) -> str:
    """A :class:`moe_fp4.model.planner.Plan` (as ``dataclasses.asdict``) as text: per policy its largest
    micro-batch in the budget ("not tried" when a cheaper policy already took the batch in one pass, 0
    when not even one sequence fits), the split it runs, its measured peak and tokens/s, the chosen one
    marked."""
    rows = [f"{'policy':<8} {'largest':>9} {'micro x passes':>15} {'peak':>10} {'tokens/s':>12}  note"]
    for c in plan["candidates"]:
        largest = "not tried" if c["why"].startswith("not tried") else str(c["largest"])
        split = f"{c['micro_batch']} x {c['passes']}" if c["passes"] else "-"
        peak = "-" if c["peak_bytes"] is None else _gib(c["peak_bytes"])
        tps = "-" if c["tokens_per_s"] is None else f"{c['tokens_per_s']:,.0f}"
        chosen = (c["policy"], c.get("micro_batch"), c.get("passes")) == (plan["policy"], plan.get("micro_batch"),
                                                                          plan.get("passes"))
        mark = "  <- chosen" if chosen and c["tokens_per_s"] is not None and not c["why"] else ""
        rows.append(f"{c['policy']:<8} {largest:>9} {split:>15} {peak:>10} {tps:>12}  {c['why']}{mark}".rstrip())
    return "\n".join(rows)


__all__ = ["CPU_NOTE", "banner_lines", "dispatch_rows_line", "done_line", "grad_wire_line", "mode_line", "plan_table",
           "ranks_legend",
           "ratios", "row_line", "saved_format", "table", "wire_bytes_lines", "wire_text"]
