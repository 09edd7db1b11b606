"""moe_fp4: MXFP4 activation storage and all-to-all transport for FP8 MoE training on Hopper."""

import importlib

from moe_fp4 import _hf_registration, _moved

__version__ = "0.1.0"

_moved.install()
# Hugging Face: experts_implementation="moe_fp4" / "moe_fp4_fp8" once transformers' experts registry is imported.
_hf_registration.install()

# The public names and the module each comes from, imported on first use (PEP 562): ``import moe_fp4`` stays
# as cheap as its two finders above, so ``moe-fp4 --help`` and a one-line argument error do not wait for torch
# and Triton, and Ctrl-C while they load is the command line's to handle.
_HOMES = {
    "moe_fp4.formats.conversions": ("dequantize_fp8", "dequantize_mxfp4", "dequantize_nvfp4", "fp8_to_fp8_colwise",
                                    "mxfp4_to_fp8", "mxfp4_to_fp8_colwise", "nvfp4_to_fp8", "nvfp4_to_fp8_colwise",
                                    "quantize_fp8", "quantize_fp8_and_mxfp4", "quantize_mxfp4", "quantize_nvfp4"),
    "moe_fp4.exchange.a2a": ("Received", "all_to_all"),
    "moe_fp4.exchange.swap": ("exchange_role", "swap_all_to_all"),
    "moe_fp4.formats.containers": ("FP8BlockTensor", "MXFP4Tensor", "NVFP4Tensor"),
    "moe_fp4.saved.hook": ("CompressionConfig", "CompressionHandle", "CompressionStats", "StorageFormat",
                           "compress_saved_activations", "current_compression", "register_activation_compression"),
    # the planner sits above the layers the other names come from
    "moe_fp4.model.planner": ("plan",),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}
_SUBPACKAGES = ("compare", "exchange", "formats", "gemm", "integrations", "kernels", "model", "saved")


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
        globals()[name] = value   # looked up once
        return value
    if name in _SUBPACKAGES:   # ``moe_fp4.formats`` after a bare ``import moe_fp4``, as when it imported them
        return importlib.import_module(f"moe_fp4.{name}")
    raise AttributeError(f"module 'moe_fp4' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_HOME, *_SUBPACKAGES})


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
