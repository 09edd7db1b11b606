"""The exchange side: what crosses the link between expert-parallel ranks.

- :mod:`~moe_fp4.exchange.wire`: the wire formats (``WireFormat``) and how a row is packed and unpacked.
- :mod:`~moe_fp4.exchange.all_to_all`: ``all_to_all``, the MXFP4 all-to-all with its autograd.
- :mod:`~moe_fp4.exchange.swap`: ``swap_all_to_all``, the drop-ins for torch's all-to-all functions
  inside another stack (torchtitan, Hugging Face), and ``exchange_role``.
- :mod:`~moe_fp4.exchange.ep`: the expert-parallel dispatch and combine the MoE layer uses (``EPConfig``).
"""

from moe_fp4.exchange.all_to_all import *  # noqa: F401,F403
from moe_fp4.exchange.all_to_all import __all__ as _all_to_all
from moe_fp4.exchange.ep import *  # noqa: F401,F403
from moe_fp4.exchange.ep import __all__ as _ep
from moe_fp4.exchange.wire import *  # noqa: F401,F403
from moe_fp4.exchange.wire import __all__ as _wire

__all__ = [*_wire, *_all_to_all, *_ep]
