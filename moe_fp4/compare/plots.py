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


def write_plots(report: dict, out_dir: str) -> list[str]:
    """report: what :func:`moe_fp4.compare.runner.run` returns -> paths of throughput.png, memory.png and
    loss.png in ``out_dir``. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["modes"]
    modes = list(rows)
    m = report["meta"]
    build = " ".join(x for x in (m.get("version"), m.get("commit")) if x)   # absent in older reports
    title = f"{report['config']['preset']} on {m['device']} x {m['world']}" + (f" (moe_fp4 {build})" if build else "")
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(modes, [rows[k]["tokens_per_s_per_gpu"] for k in modes], color="C0")
    ax.set_ylabel("tokens / s per GPU")
    paths.append(_save(plt, fig, ax, title, os.path.join(out_dir, "throughput.png")))

    fig, ax = plt.subplots(figsize=(6, 4))
    series = [("activation", "activation_bytes")] + ([("peak", "peak_bytes")] if rows[modes[0]]["peak_bytes"] else [])
    width = 0.8 / len(series)
    for i, (name, key) in enumerate(series):
        ax.bar([j + i * width for j in range(len(modes))], [rows[k][key] / GiB for k in modes], width, label=name)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(modes))], modes)
    ax.set_ylabel("GiB per GPU")
    ax.legend()
    paths.append(_save(plt, fig, ax, title, os.path.join(out_dir, "memory.png")))

    fig, ax = plt.subplots(figsize=(7, 4))
    for k in modes:
        curve = rows[k]["loss_curve"]
        ax.plot(range(1, len(curve) + 1), _smooth(curve, max(1, len(curve) // 50)), label=k, linewidth=1)
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
    ax.set_xlabel("memory budget per GPU (GiB)")
    ax.set_ylabel("tokens / s per GPU (planned, measured)")
    ax.legend()
    return _save(plt, fig, ax, title, path)


__all__ = ["budget_curve_plot", "write_plots"]
