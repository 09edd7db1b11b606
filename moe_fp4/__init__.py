"""moe_fp4: MXFP4 activation storage and all-to-all transport for FP8 MoE training on Hopper."""

from moe_fp4 import _hf_registration, _moved
from moe_fp4.formats.conversions import (
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_nvfp4,
    fp8_to_fp8_colwise,
    mxfp4_to_fp8,
    mxfp4_to_fp8_colwise,
    nvfp4_to_fp8,
    nvfp4_to_fp8_colwise,
    quantize_fp8,
    quantize_fp8_and_mxfp4,
    quantize_mxfp4,
    quantize_nvfp4,
)
from moe_fp4.exchange.a2a import Received, all_to_all
from moe_fp4.exchange.swap import exchange_role, swap_all_to_all
from moe_fp4.formats.containers import FP8BlockTensor, MXFP4Tensor, NVFP4Tensor
from moe_fp4.saved.hook import (
    CompressionConfig,
    CompressionHandle,
    CompressionStats,
    StorageFormat,
    compress_saved_activations,
    current_compression,
    register_activation_compression,
)

__version__ = "0.1.0"

_moved.install()
# Hugging Face: experts_implementation="moe_fp4" / "moe_fp4_fp8" once transformers' experts registry is imported.
_hf_registration.install()


def __getattr__(name: str):
    # moe_fp4.plan (moe_fp4.model.planner.plan) on first use: the planner sits above the layers imported here.
    if name == "plan":
        from moe_fp4.model.planner import plan

        return plan
    raise AttributeError(f"module 'moe_fp4' has no attribute {name!r}")


__all__ = [
    "CompressionConfig",
    "CompressionHandle",
    "CompressionStats",
    "FP8BlockTensor",
    "MXFP4Tensor",
    "NVFP4Tensor",
    "Received",
    "StorageFormat",
    "all_to_all",
    "compress_saved_activations",
    "current_compression",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "exchange_role",
    "fp8_to_fp8_colwise",
    "mxfp4_to_fp8",
    "mxfp4_to_fp8_colwise",
    "nvfp4_to_fp8",
    "nvfp4_to_fp8_colwise",
    "plan",
    "quantize_fp8",
    "quantize_fp8_and_mxfp4",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "register_activation_compression",
    "swap_all_to_all",
]
