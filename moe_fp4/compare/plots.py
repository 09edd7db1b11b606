"""PNG plots of a ``moe-fp4 compare`` report (matplotlib, from the ``plot`` extra)."""

from __future__ import annotations

import os

GiB = 2**30


def _smooth(v: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(v):
        acc += x
        if i >= n:
            acc -= v[i - n]
        out.append(acc / min(i + 1, n))
    return out


def _save(plt, fig, ax, title: str, path: str) -> str:
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _batch_label(row: dict) -> str:
    """"batch 52", or "batch 64 (2 x 32)" when the step ran in micro-batches."""
    passes, micro = row.get("accumulate") or 1, row.get("micro_batch")
    return f"batch {row['batch']}" + (f" ({passes} x {micro})" if passes > 1 and micro else "")


def held_equal(report: dict) -> str:
    """What the modes had in common, for the plots' titles: the same memory budget (each mode at its own
    largest batch, or planned), or the same batch."""
    cfg, rows = report["config"], report["modes"]
    seq = next(iter(rows.values()))["seq"] if rows else cfg.get("seq")
    dev = _device(report)
    if cfg.get("max_batch_gib") is not None:
        return f"same memory budget: each mode at its largest batch in {cfg['max_batch_gib']:g} GiB per {dev}"
    if cfg.get("plan"):
        return (f"same memory budget: {cfg['budget_gib']:g} GiB per {dev}, global batch {cfg['global_batch']}, "
                f"each mode's fastest plan")
    batches = {_batch_label(r) for r in rows.values()}
    if len(batches) == 1:
        return f"same {batches.pop()} x {seq} tokens per {dev}"
    return "batches differ per mode (labelled on the bars)"


def _device(report: dict) -> str:
    return "GPU" if report["meta"].get("gpus", 1) else "device"


def _differ(rows: dict) -> bool:
    return len({_batch_label(r) for r in rows.values()}) > 1


def _label_groups(ax, centers, tops, labels) -> None:
    """Each mode's batch above its highest bar, with room kept under the top of the axes."""
    for x, top, text in zip(centers, tops, labels):
        ax.annotate(text, (x, top), textcoords="offset points", xytext=(0, 3), ha="center", va="bottom",
                    fontsize=7)
    ax.set_ylim(top=max(tops) * 1.12)


def write_plots(report: dict, out_dir: str) -> list[str]:
    """report: what :func:`moe_fp4.compare.runner.run` returns -> paths of throughput.png, memory.png and
    loss.png in ``out_dir``. Each title says what the modes had in common (:func:`held_equal`); when
    they ran at different batches each bar group is labelled with its batch. Raises ImportError
    without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["modes"]
    modes = list(rows)
    m = report["meta"]
    build = " ".join(x for x in (m.get("version"), m.get("commit")) if x)   # absent in older reports
    title = (f"{report['config']['preset']} on {m['device']} x {m['world']}" + (f" (moe_fp4 {build})" if build else "")
             + "\n" + held_equal(report))
    labels = [_batch_label(rows[k]) for k in modes] if _differ(rows) else None
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    tps = [rows[k]["tokens_per_s_per_gpu"] for k in modes]
    ax.bar(modes, tps, color="C0")
    if labels:
        _label_groups(ax, range(len(modes)), tps, labels)
    ax.set_ylabel(f"tokens / s per {_device(report)}")
    paths.append(_save(plt, fig, ax, title, os.path.join(out_dir, "throughput.png")))

    fig, ax = plt.subplots(figsize=(6, 4.4))
    series = [("activation", "activation_bytes")] + ([("peak", "peak_bytes")] if rows[modes[0]]["peak_bytes"] else [])
    width = 0.8 / len(series)
    top = max(rows[k][key] or 0 for k in modes for _, key in series)
    unit, scale = ("GiB", GiB) if top >= GiB else ("MiB", 2**20)
    for i, (name, key) in enumerate(series):
        ax.bar([j + i * width for j in range(len(modes))], [rows[k][key] / scale for k in modes], width, label=name)
    centers = [j + width * (len(series) - 1) / 2 for j in range(len(modes))]
    ax.set_xticks(centers, modes)
    ax.set_ylabel(f"{unit} per {_device(report)}")
    if labels:
        _label_groups(ax, centers, [max(rows[k][key] or 0 for _, key in series) / scale for k in modes], labels)
    # Below the axes, where no bar can be: inside, the legend covered the last mode's peak bar.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(series), frameon=False, fontsize=8)
    paths.append(_save(plt, fig, ax, title, os.path.join(out_dir, "memory.png")))

    fig, ax = plt.subplots(figsize=(7, 4))
    for k in modes:
        curve = rows[k]["loss_curve"]
        ax.plot(range(1, len(curve) + 1), _smooth(curve, max(1, len(curve) // 50)),
                label=k + (f" ({_batch_label(rows[k])})" if labels else ""), linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (moving average)")
    ax.legend()
    paths.append(_save(plt, fig, ax, title, os.path.join(out_dir, "loss.png")))
    return paths


def budget_curve_plot(rows: list[dict], path: str, title: str) -> str:
    """rows: bench/budget_curve.py's (budget_gib, mode, fits, tokens_per_s, policy, ...) -> path of a PNG
    of measured tokens/s against the memory budget, one line per mode, each point labelled with its
    recomputation policy and micro-batch. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, mode in enumerate(dict.fromkeys(r["mode"] for r in rows)):
        pts = sorted((r["budget_gib"], r["tokens_per_s"], f"{r['policy']} {r['micro_batch']}x{r['passes']}")
                     for r in rows if r["mode"] == mode and r["fits"])
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode, color=f"C{i}")
        for x, y, text in pts:
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(3, 4 + 9 * i), fontsize=6, color=f"C{i}")
    ax.margins(x=0.08, y=0.15)   # room for the labels above the highest and right of the last points
    ax.set_xlabel("memory budget per GPU (GiB)")
    ax.set_ylabel("tokens / s per GPU (planned, measured)")
    ax.legend()
    return _save(plt, fig, ax, title, path)


__all__ = ["budget_curve_plot", "held_equal", "write_plots"]
