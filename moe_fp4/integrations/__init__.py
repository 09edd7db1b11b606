"""moe_fp4 inside other training stacks.

- :mod:`~moe_fp4.integrations.hf`: Hugging Face transformers 5.x; importing it registers the
  expert-parallel implementations ``"moe_fp4"`` and ``"moe_fp4_fp8"``. Imported on demand (it needs
  transformers), never by ``import moe_fp4``.

torchtitan's expert parallelism needs no module of its own: ``moe_fp4.swap_all_to_all`` replaces the
all-to-all its dispatcher calls (``examples/torchtitan_ep_mxfp4.py``); torchao's FP8 training composes
with the saved-activation hook (``examples/torchao_fp8_plus_mxfp4.py``).
"""
