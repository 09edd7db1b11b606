"""The formats and the conversions between them.

- :mod:`~moe_fp4.formats.containers`: the quantized containers (``MXFP4Tensor``, ``FP8BlockTensor``,
  ``NVFP4Tensor``) and their structural checks; data only, no conversion code.
- :mod:`~moe_fp4.formats.conversions`: the public conversion functions (validate, then run a Triton
  kernel or its pure-torch reference).
- :mod:`~moe_fp4.formats.reference`: the pure-torch references, same signatures, for tests and CPU runs.
- :mod:`~moe_fp4.formats.metrics`: ``sqnr_db``, the error measure every lossy check uses.
"""

from moe_fp4.formats.containers import *  # noqa: F401,F403
from moe_fp4.formats.containers import __all__ as _containers
from moe_fp4.formats.conversions import *  # noqa: F401,F403
from moe_fp4.formats.conversions import __all__ as _conversions
from moe_fp4.formats.metrics import sqnr_db

__all__ = [*_containers, *_conversions, "sqnr_db"]
