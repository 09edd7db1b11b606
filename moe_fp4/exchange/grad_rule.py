"""The sqrt(3) rule for a gradient exchange (``EPConfig.dispatch_grad`` / ``combine_grad`` = "auto").

"FP4 All the Way" (Chmiel et al., 2025): quantized gradients stop helping once the gradient's norm falls
below sqrt(3) times the quantization noise in it. :class:`GradWireRule` measures that ratio on the rows
one layer's gradient exchange sends, per optimizer step, and switches the exchange to bf16 after
``patience`` steps below.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moe_fp4.exchange.recipes import AUTO
from moe_fp4.exchange.wire import WireFormat

# "FP4 All the Way" (Chmiel et al., 2025): quantized gradients stop helping once the gradient's norm
# falls below sqrt(3) times the quantization noise; the backward then goes to higher precision.
SQRT3 = math.sqrt(3.0)


class GradWireRule:
    """The sqrt(3) rule for one gradient exchange of one layer (issue 27).

    While on ``fmt`` each backward exchange adds the squared norm of the rows it sends and of their
    quantization noise (what arrives minus what was sent: the receivers' exact decode of the same bytes)
    to this step's sums; :meth:`end_step`, once per optimizer step, sums them over the EP group (so every
    rank decides alike), appends the ratio sqrt(signal / noise) to ``ratios``, and after ``patience``
    consecutive steps with the ratio below sqrt(3) switches the exchange to bf16 for the rest of the run
    (``fell_back_at``: the number of steps measured by then). Measuring costs a decode of the sent rows
    and two reductions per exchange, and one host sync per optimizer step."""

    def __init__(self, fmt: WireFormat = WireFormat.NVFP4_SR, patience: int = 10):
        self.fmt, self.patience = WireFormat(fmt), patience
        self.sums: torch.Tensor | None = None        # float32 [2] on the device: sum x^2, sum noise^2
        self.ratios: list[float] = []
        self.below = 0
        self.fell_back_at: int | None = None

    @property
    def format(self) -> WireFormat:
        """The format the next exchange sends: ``fmt``, or bf16 once the rule has fallen back."""
        return self.fmt if self.fell_back_at is None else WireFormat.BF16

    def record(self, sent: torch.Tensor, arrived: torch.Tensor) -> None:
        """sent, arrived: [N, H] the rows before packing and as they decode on arrival."""
        if self.fell_back_at is not None:
            return
        x = sent.float()
        s = torch.stack([x.square().sum(), (arrived.float() - x).square().sum()])
        self.sums = s if self.sums is None else self.sums + s

    def end_step(self, group=None) -> float | None:
        """Close one optimizer step's measurement -> its ratio (None if nothing was sent on ``fmt``)."""
        if self.sums is None:
            return None
        s, self.sums = self.sums, None
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(s, group=group)
        signal, noise = s.tolist()
        ratio = math.sqrt(signal / noise) if noise > 0 else math.inf
        self.ratios.append(ratio)
        self.below = self.below + 1 if ratio < SQRT3 else 0
        if self.below >= self.patience:
            self.fell_back_at = len(self.ratios)
        return ratio

    def summary(self) -> dict:
        """-> {format, steps measured, ratio first / min / median / last, fell_back_at} for reports."""
        r = sorted(self.ratios)
        return {"format": self.fmt.value, "steps": len(self.ratios),
                "ratio_first": self.ratios[0] if r else None, "ratio_min": r[0] if r else None,
                "ratio_median": r[len(r) // 2] if r else None, "ratio_last": self.ratios[-1] if r else None,
                "fell_back_at": self.fell_back_at}


def grad_format(fmt: WireFormat | str, rule: GradWireRule | None) -> WireFormat:
    """The format a gradient exchange sends now: its rule's for "auto", else ``fmt``."""
    if fmt == AUTO:
        if rule is None:
            raise ValueError('a gradient wire "auto" needs its GradWireRule (EPConfig.grad_rules)')
        return rule.format
    return WireFormat(fmt)


__all__ = ["SQRT3", "GradWireRule", "grad_format"]
