"""``moe-fp4 compare``: train the same model in bf16, fp8 and fp4 and report tokens/s, memory and loss.

- :mod:`~moe_fp4.compare.cli`: the command line (``moe-fp4``, ``python -m moe_fp4``).
- :mod:`~moe_fp4.compare.runner`: ``CompareConfig``, ``Env``, ``run`` and the training loop.
- :mod:`~moe_fp4.compare.data`: the token streams (the Python standard library's sources, random tokens).
- :mod:`~moe_fp4.compare.plots`: the figures ``compare`` and ``bench/budget_curve.py`` write.
"""

from moe_fp4.compare.runner import *  # noqa: F401,F403
from moe_fp4.compare.runner import __all__ as _runner
from moe_fp4.compare.runner import commit, describe, done_line, provenance, version  # noqa: F401

__all__ = [*_runner, "commit", "describe", "done_line", "provenance", "version"]
