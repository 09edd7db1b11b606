"""Hugging Face transformers (5.x): moe_fp4's grouped FP8 experts as ``experts_implementation``\\s.

Importing this module (``import moe_fp4`` does, once transformers' ``integrations.moe`` is imported) registers
two experts implementations in transformers' ``ExpertsInterface``:

| name              | GEMMs | activations kept for backward                          |
| ----------------- | ----- | ------------------------------------------------------ |
| ``"moe_fp4"``     | FP8   | MXFP4 (the fp4 precision of :mod:`moe_fp4.model.experts`) |
| ``"moe_fp4_fp8"`` | FP8   | FP8 1x128 (the fp8 precision: DeepSeek-V3's recipe)     |

so ``AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16, experts_implementation="moe_fp4")`` runs
every experts module of the model through :func:`moe_fp4.model.routing.routed_swiglu_experts`: one host sync
for the per-expert counts in eager mode, none under ``torch.compile`` (the model compiles with
``fullgraph=True``, as on ``"grouped_mm"``), FP8 weights made once per weight version
(:data:`moe_fp4.gemm.engines.FP8_WEIGHTS`, dropped after every torch.optim step, whatever the optimizer; under
compile quantized in the graph), the router weights applied inside the experts.

It serves every family whose experts module has transformers' default layout: ``gate_up_proj`` [E, 2F, H]
(gate rows, then up rows), ``down_proj`` [E, H, F], no biases, SiLU-gated (the default ``_apply_gate``), no
norm after the experts, H and F multiples of 128 (FP8 1x128 tiles, 128x128 weight blocks); Qwen3-MoE, Mixtral,
DeepSeek-V3 and the others declared with ``@use_experts_implementation`` and no options. A module that does not
fit raises ``ValueError`` naming the reason at its first forward, before any work (transformers has no hook at
model build where an implementation could look at the modules); :func:`check_experts` runs the same check on a
whole model right after it is built. Expert ids >= E (transformers' expert-parallel sentinel, and
:mod:`moe_fp4.integrations.hf`'s) are slots with no expert on this rank: they add nothing.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, _default_apply_gate

from moe_fp4.gemm.engines import WEIGHT_BLOCK
from moe_fp4.gemm.fsdp import gather_in_fp8
from moe_fp4.model.experts import Precision
from moe_fp4.model.routing import routed_swiglu_experts

# registered name -> the precision its experts run in
IMPLEMENTATIONS = {"moe_fp4": Precision.FP4, "moe_fp4_fp8": Precision.FP8}

# What our engine needs of an experts module, as transformers' use_experts_implementation records it.
_LAYOUT = {"has_gate": (True, "its experts are not gated (no gate_up_proj)"),
           "has_bias": (False, "its experts have biases"),
           "is_transposed": (False, "its expert weights are stored transposed"),
           "is_concatenated": (True, "its gate and up rows are interleaved, not concatenated"),
           "has_post_expert_norm": (False, "it applies a norm after each expert")}


def _is_silu(act) -> bool:
    # LFM2-MoE's experts hold the function torch.nn.functional.silu itself, not a module
    if act is torch.nn.functional.silu or isinstance(act, nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:
        return False
    return isinstance(act, SiLUActivation)


def unfit_reason(module: nn.Module) -> str | None:
    """-> why moe_fp4's experts cannot run ``module`` (a transformers experts module), or None if they can."""
    for attr, (want, why) in _LAYOUT.items():
        if getattr(module, attr, want) != want:
            return why
    if type(module)._apply_gate is not _default_apply_gate:
        return f"{type(module).__name__} has its own gate function (_apply_gate), not SiLU(gate) * up"
    if not _is_silu(getattr(module, "act_fn", None)):
        return f"its activation is {type(getattr(module, 'act_fn', None)).__name__}, not SiLU"
    w13, w2 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor) or w13.dim() != 3 or w2.dim() != 3:
        return "it has no 3-D gate_up_proj and down_proj weights"
    e, two_f, h = w13.shape
    if tuple(w2.shape) != (e, h, two_f // 2) or two_f % 2:
        return (f"its weights are gate_up_proj {tuple(w13.shape)}, down_proj {tuple(w2.shape)}, "
                "not [E, 2F, H], [E, H, F]")
    if h % WEIGHT_BLOCK or (two_f // 2) % WEIGHT_BLOCK:
        return f"hidden {h} and expert ffn {two_f // 2} must be multiples of {WEIGHT_BLOCK} (FP8 tiles and blocks)"
    if w13.dtype not in (torch.bfloat16, torch.float32) or w2.dtype != w13.dtype:
        return f"its weights are {w13.dtype} / {w2.dtype}, not bfloat16 or float32"
    return None


def _check_module(module: nn.Module, name: str) -> None:
    # Checked once per module: the layout does not change after the model is built.
    if getattr(module, "_moe_fp4_checked", False):
        return
    why = unfit_reason(module)
    if why is not None:
        raise ValueError(f'experts_implementation="{name}" cannot run {type(module).__name__}: {why}. Use '
                         f'experts_implementation="grouped_mm" for this model')
    module._moe_fp4_checked = True


def check_experts(model: nn.Module, name: str = "moe_fp4") -> int:
    """Raise ValueError naming the first experts module of ``model`` that ``name`` cannot run -> the number of
    experts modules checked (those with a ``gate_up_proj`` or ``up_proj`` weight)."""
    n = 0
    for m in model.modules():
        if hasattr(m, "gate_up_proj") or (hasattr(m, "up_proj") and isinstance(getattr(m, "up_proj"), torch.Tensor)):
            _check_module(m, name)
            n += 1
    return n


def _forward(name: str, precision: Precision):
    def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H] bf16, top_k_index int64 [T, k], top_k_weights float [T, k] -> [T, H] bf16."""
        _check_module(self, name)
        if hidden_states.dtype != torch.bfloat16:
            raise ValueError(f'experts_implementation="{name}" runs on bfloat16 activations, got '
                             f"{hidden_states.dtype}: load the model with dtype=torch.bfloat16 (fp32 master weights "
                             f"are fine)")
        return routed_swiglu_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                     precision)

    experts_forward.__name__ = f"{name}_experts_forward"
    return experts_forward


def fp8_all_gather(model: nn.Module) -> list[str]:
    """model: a transformers model on ``experts_implementation="moe_fp4"`` or ``"moe_fp4_fp8"``, not yet sharded ->
    the names of the expert weights (``gate_up_proj``, ``down_proj`` of every experts module moe_fp4 runs) made
    :class:`moe_fp4.gemm.fsdp.FP8GatherWeight`: under FSDP2's ``fully_shard`` their all-gathers then send W's FP8
    codes and block scales, which the experts read directly. Call it before ``fully_shard``."""
    impl = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"fp8_all_gather: the model's experts_implementation is {impl!r}, not one of moe_fp4's "
                         f"({', '.join(IMPLEMENTATIONS)}): only those read FP8-gathered weights")
    done = []
    for prefix, m in model.named_modules():
        if hasattr(m, "gate_up_proj"):
            _check_module(m, impl)
            done += gather_in_fp8(m, ("gate_up_proj", "down_proj"), f"{prefix}.")
    return done


def register(interface: ExpertsInterface = ALL_EXPERTS_FUNCTIONS) -> tuple[str, ...]:
    """Register :data:`IMPLEMENTATIONS` in transformers' experts registry (idempotent) -> their names."""
    for name, precision in IMPLEMENTATIONS.items():
        interface.register(name, _forward(name, precision))
    return tuple(IMPLEMENTATIONS)


register()

__all__ = ["IMPLEMENTATIONS", "check_experts", "fp8_all_gather", "register", "unfit_reason"]
