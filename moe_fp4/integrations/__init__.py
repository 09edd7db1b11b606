"""moe_fp4 inside other training stacks.

- :mod:`~moe_fp4.integrations.hf`: Hugging Face transformers 5.x; importing it registers the
  expert-parallel implementations ``"moe_fp4"`` and ``"moe_fp4_fp8"``. Imported on demand (it needs
  transformers), never by ``import moe_fp4``.
- :mod:`~moe_fp4.integrations.hf_experts`: the experts implementations ``"moe_fp4"`` and ``"moe_fp4_fp8"``
  (``from_pretrained(..., experts_implementation="moe_fp4")``): registered by ``import moe_fp4`` as soon as
  transformers' experts registry is imported (:mod:`moe_fp4._hf_registration`), without importing transformers.
- :mod:`~moe_fp4.integrations.torchtitan`: ``GroupedExpertsConverter``, a torchtitan 0.3 model converter that
  runs its experts on moe_fp4's engine. Imported on demand (it needs torchtitan).

torchtitan's expert parallelism needs no module of its own: ``moe_fp4.swap_all_to_all`` replaces the
all-to-all its dispatcher calls (``examples/torchtitan_ep_mxfp4.py``); torchao's FP8 training composes
with the saved-activation hook (``examples/torchao_fp8_plus_mxfp4.py``).
"""
