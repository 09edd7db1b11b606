"""FP8 GEMMs: the FP8 weight containers and their cache, the single and grouped GEMMs, and the one
place that picks the grouped GEMM engine (:func:`~moe_fp4.gemm.engines.grouped_gemm_backend`). The
kernels themselves live in ``moe_fp4.kernels`` (``grouped_gemm``, its Gluon twin ``gluon_grouped_gemm``)."""

from moe_fp4.gemm.engines import *  # noqa: F401,F403
from moe_fp4.gemm.engines import __all__  # noqa: F401
