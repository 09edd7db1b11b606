"""The model side: the grouped FP8 experts, the MoE layer (routing, expert parallelism, recomputation),
the AdamW that writes the FP8 weight copies, the planner that picks recomputation and micro-batch for a
memory budget, and the decoder LM that ``moe-fp4 compare`` trains.

- :mod:`~moe_fp4.model.experts`: ``grouped_swiglu_experts`` and ``Precision``.
- :mod:`~moe_fp4.model.routing`: ``routed_swiglu_experts`` (the experts over tokens and their top-k choice),
  ``make_routing``, ``permute``, ``unpermute``, ``row_weights``.
- :mod:`~moe_fp4.model.replay`: ``checkpoint`` and ``once`` (recomputation without repeating host syncs).
- :mod:`~moe_fp4.model.moe`: ``MoE``, ``MoEConfig``, ``Recompute`` (and ``checkpoint``).
- :mod:`~moe_fp4.model.optim`: ``AdamWFP8Weights``.
- :mod:`~moe_fp4.model.planner`: ``plan`` (also ``moe_fp4.plan``).
- :mod:`~moe_fp4.model.decoder`: ``DecoderLM``, ``ModelConfig``, ``PRESETS``.
"""

from moe_fp4.model.decoder import *  # noqa: F401,F403
from moe_fp4.model.decoder import __all__ as _decoder
from moe_fp4.model.experts import *  # noqa: F401,F403
from moe_fp4.model.experts import __all__ as _experts
from moe_fp4.model.moe import *  # noqa: F401,F403
from moe_fp4.model.moe import __all__ as _moe
from moe_fp4.model.optim import *  # noqa: F401,F403
from moe_fp4.model.optim import __all__ as _optim
from moe_fp4.model.planner import *  # noqa: F401,F403
from moe_fp4.model.planner import __all__ as _planner
from moe_fp4.model.routing import routed_swiglu_experts  # noqa: F401

__all__ = [*_experts, *_moe, *_optim, *_planner, *_decoder, "routed_swiglu_experts"]
