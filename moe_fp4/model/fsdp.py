"""FSDP2 with moe_fp4's experts: their weights all-gathered in FP8 (:mod:`moe_fp4.gemm.fsdp`).

    from torch.distributed.fsdp import fully_shard
    fp8_all_gather(model)          # before fully_shard: the expert weights' all-gathers send FP8
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)

Each fp8 / fp4 ``MoE`` layer's expert weights (w13, w2 and the shared expert's) become
:class:`moe_fp4.gemm.fsdp.FP8GatherWeight` parameters: FSDP2 then all-gathers W's 128x128-block FP8 codes and
scales (about 1 byte a parameter instead of bf16's 2), and the unsharded weight holds only those while FSDP keeps
the layer unsharded; outputs and gradients are those of the unsharded layer, bit for bit. bf16 layers keep their
parameters (their GEMMs read bf16 weights).
"""

from __future__ import annotations

from torch import nn

from moe_fp4.gemm.fsdp import gather_in_fp8
from moe_fp4.model.experts import Precision
from moe_fp4.model.moe import MoE


def fp8_all_gather(module: nn.Module) -> list[str]:
    """module: a model (or one MoE layer) not yet sharded -> the names of the parameters made FP8-gathered.
    Raises if ``fully_shard`` already ran on it (its parameters are DTensors then), or on a layer with pinned FP8
    weights (the gathered codes take their place)."""
    done = []
    for prefix, m in module.named_modules():
        if not isinstance(m, MoE) or m.precision is Precision.BF16:
            continue
        if m._pinned:
            raise RuntimeError(f"fp8_all_gather: {prefix or 'the MoE layer'} has pinned FP8 weights "
                               f"(pin_fp8_weights): under FSDP2 the gathered FP8 codes replace them; do not pin")
        done += gather_in_fp8(m, MoE._PINNED, f"{prefix}." if prefix else "")
    return done


__all__ = ["fp8_all_gather"]
