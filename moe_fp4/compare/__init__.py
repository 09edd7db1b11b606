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

from moe_fp4.compare.config import BatchDoesNotFit, CompareConfig, Env, check_ep, per_rank_batch
from moe_fp4.compare.memory import largest_accumulated_batch, largest_batch, measure_steps, plan_mode, step_bytes
from moe_fp4.compare.preflight import ModelDoesNotFit, estimate
from moe_fp4.compare.origin import commit, describe, provenance, version
from moe_fp4.compare.report import done_line, plan_table, ratios, table
from moe_fp4.compare.runner import run
from moe_fp4.compare.train import Trainer, build, train_mode
from moe_fp4.model.planner import micro_batch, search_largest_batch

__all__ = ["BatchDoesNotFit", "CompareConfig", "Env", "ModelDoesNotFit", "Trainer", "build", "check_ep", "commit",
           "describe", "done_line", "estimate", "largest_accumulated_batch", "largest_batch", "measure_steps",
           "micro_batch", "per_rank_batch", "plan_mode", "plan_table", "provenance", "ratios", "run",
           "search_largest_batch", "step_bytes", "table", "train_mode", "version"]
