"""The exchange side: what crosses the link between expert-parallel ranks.

- :mod:`~moe_fp4.exchange.wire`: the wire formats (``WireFormat``) and how a row is packed and unpacked.
- :mod:`~moe_fp4.exchange.a2a`: ``all_to_all``, the MXFP4 all-to-all with its autograd.
- :mod:`~moe_fp4.exchange.swap`: ``swap_all_to_all``, the drop-ins for torch's all-to-all functions
  inside another stack (torchtitan, Hugging Face), and ``exchange_role``.
- :mod:`~moe_fp4.exchange.recipes`: the named wire recipes (``RECIPES``: the format of each exchange) and
  each precision's default per link (``LINK_RECIPE``).
- :mod:`~moe_fp4.exchange.link`: which link a group's exchanges cross (``Link``, ``detect_link``).
- :mod:`~moe_fp4.exchange.ep_config`: ``EPConfig``, the EP group and each exchange's format per precision.
- :mod:`~moe_fp4.exchange.ep`: the expert-parallel dispatch and combine the MoE layer uses (``EPConfig``
  re-exported).
- :mod:`~moe_fp4.exchange.simulate`: an exchange's numerics on one rank (``EPConfig.simulate``).
"""

from moe_fp4.exchange.a2a import *  # noqa: F401,F403
from moe_fp4.exchange.a2a import __all__ as _a2a
from moe_fp4.exchange.ep import *  # noqa: F401,F403
from moe_fp4.exchange.ep import __all__ as _ep
from moe_fp4.exchange.link import *  # noqa: F401,F403
from moe_fp4.exchange.link import __all__ as _link
from moe_fp4.exchange.recipes import *  # noqa: F401,F403
from moe_fp4.exchange.recipes import __all__ as _recipes
from moe_fp4.exchange.simulate import *  # noqa: F401,F403
from moe_fp4.exchange.simulate import __all__ as _simulate
from moe_fp4.exchange.swap import *  # noqa: F401,F403
from moe_fp4.exchange.swap import __all__ as _swap
from moe_fp4.exchange.wire import *  # noqa: F401,F403
from moe_fp4.exchange.wire import __all__ as _wire

__all__ = [*_wire, *_a2a, *_swap, *_recipes, *_link, *_ep, *_simulate]
