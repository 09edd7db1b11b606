"""``moe-fp4 compare``: train the same model in bf16, fp8 and fp4 and report tokens/s, memory and loss.

- :mod:`~moe_fp4.compare.cli`: the command line (``moe-fp4``, ``python -m moe_fp4``).
- :mod:`~moe_fp4.compare.config`: ``CompareConfig`` (every check that needs no device), ``Env``, the choices.
- :mod:`~moe_fp4.compare.preflight`: what a run needs and costs, checked before it starts.
- :mod:`~moe_fp4.compare.runner`: ``run``, every mode from the banner to the report dict.
- :mod:`~moe_fp4.compare.train`: ``Trainer``, the models, one mode's timed training run.
- :mod:`~moe_fp4.compare.memory`: a step's memory, the largest batch in a budget, the planner per mode.
- :mod:`~moe_fp4.compare.report`: the text it prints (banner, mode lines, table, ratios).
- :mod:`~moe_fp4.compare.origin`: where a result comes from (version, commit, device).
- :mod:`~moe_fp4.compare.quiet`: known-harmless third-party log lines and warnings, silenced while it runs.
- :mod:`~moe_fp4.compare.data`: the token streams (the Python standard library's sources, random tokens).
- :mod:`~moe_fp4.compare.plots`: the figures ``compare`` and ``bench/budget_curve.py`` write.
"""

import importlib

# Each name and its module, imported on first use (PEP 562): the command line (cli.py) starts without torch,
# so that --help, an argument error and Ctrl-C while torch loads are answered in one line.
_HOMES = {
    "moe_fp4.compare.config": ("BatchDoesNotFit", "CompareConfig", "Env", "check_ep", "per_rank_batch"),
    "moe_fp4.compare.memory": ("largest_accumulated_batch", "largest_batch", "measure_steps", "plan_mode",
                               "step_bytes"),
    "moe_fp4.compare.preflight": ("ModelDoesNotFit", "estimate"),
    "moe_fp4.compare.origin": ("commit", "describe", "provenance", "version"),
    "moe_fp4.compare.report": ("done_line", "plan_table", "ratios", "table"),
    "moe_fp4.compare.runner": ("run",),
    "moe_fp4.compare.train": ("Trainer", "build", "train_mode"),
    "moe_fp4.model.planner": ("micro_batch", "search_largest_batch"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}


_SUBMODULES = ("cli", "config", "data", "memory", "origin", "plots", "preflight", "quiet", "report", "runner", "train")


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    if name in _SUBMODULES:   # ``moe_fp4.compare.runner`` after ``import moe_fp4.compare``, as when it imported them
        return importlib.import_module(f"moe_fp4.compare.{name}")
    raise AttributeError(f"module 'moe_fp4.compare' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_HOME, *_SUBMODULES})


__all__ = sorted(_HOME)
