"""The saved-activation side: what autograd keeps for backward, in which format, and how many bytes.

- :mod:`~moe_fp4.saved.hook`: the saved-tensor hook for any model (``register_activation_compression``,
  ``compress_saved_activations``) and its configuration.
- :mod:`~moe_fp4.saved.accounting`: the bytes a step saves (``saved_bytes``) and the tags moe_fp4's own
  autograd Functions put on what they keep.

Recomputation and the planner that trades it for batch size sit with the MoE layer they act on
(``moe_fp4.model.moe.Recompute``, ``moe_fp4.model.planner``).
"""

from moe_fp4.saved.accounting import *  # noqa: F401,F403
from moe_fp4.saved.accounting import __all__ as _accounting
from moe_fp4.saved.hook import *  # noqa: F401,F403
from moe_fp4.saved.hook import __all__ as _hook

__all__ = [*_accounting, *_hook]
