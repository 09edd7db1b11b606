"""The sqrt(3) rule for a gradient exchange (``EPConfig.dispatch_grad`` / ``combine_grad`` = "auto").

"FP4 All the Way" (Chmiel et al., 2025): quantized gradients stop helping once the gradient's norm falls
below sqrt(3) times the quantization noise in it. :class:`GradWireRule` measures that ratio per optimizer
step, for one layer's gradient exchange: on the rows it sends (the payload's ratio, a constant of the format:
its SQNR) and, for the combine's gradient under expert parallelism, on what the gradient is used for, the
experts' FC2 weight gradient (whose signal adds over the tokens and whose noise does not); after ``patience``
steps below it switches the exchange to the next format up (:func:`next_format_up`).
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
# The format a rule falls back to: a 4-bit gradient to FP8 1x128, FP8 to bf16.
_NEXT_UP = {WireFormat.MXFP4: WireFormat.FP8, WireFormat.MXFP4_SR: WireFormat.FP8, WireFormat.NVFP4: WireFormat.FP8,
            WireFormat.NVFP4_SR: WireFormat.FP8, WireFormat.FP8: WireFormat.BF16}


def next_format_up(fmt: WireFormat | str) -> WireFormat:
    """The next format up from a quantized gradient wire: mxfp4 / nvfp4 (and their -sr) -> fp8 -> bf16."""
    fmt = WireFormat(fmt)
    if fmt not in _NEXT_UP:
        raise ValueError(f"next_format_up: {fmt.value} is not a quantized gradient format; one of "
                         f"{', '.join(f.value for f in _NEXT_UP)}")
    return _NEXT_UP[fmt]


class GradWireRule:
    """The sqrt(3) rule for one gradient exchange of one layer.

    While on ``fmt`` each backward exchange adds the squared norm of the rows it sends and of their
    quantization noise (what arrives minus what was sent: the receivers' exact decode of the same bytes)
    to this step's sums: the payload's ratio sqrt(signal / noise), which is the format's SQNR and barely
    moves. For the combine's gradient under expert parallelism the experts also add the noise the payload
    puts into their FC2 weight gradient, sum over expert rows r of ||a_r||^2 ||e_r||^2 (a_r: the row's FC2
    input as the weight-gradient GEMM reads it, e_r: its gradient row's rounding error, sent by the source
    rank), and :meth:`end_step` takes the squared norm of that weight gradient: the weight ratio
    ||dW2|| / sqrt(noise), which grows with the tokens per expert. :meth:`end_step`, once per optimizer
    step, sums everything over the EP group (so every rank decides alike), appends the payload ratio to
    ``ratios`` and the weight ratio (None where not measured) to ``weight_ratios``, and after ``patience``
    consecutive steps with the deciding ratio (the weight ratio where measured, else the payload's) below
    sqrt(3) switches the exchange to ``fallback`` (default :func:`next_format_up` of ``fmt``) for the rest
    of the run (``fell_back_at``: the number of steps measured by then). Measuring costs a decode of the
    sent rows and two reductions per exchange, the weight noise one float32 per sent row on the wire and a
    pass over the FC2 input, and one host sync per optimizer step."""

    def __init__(self, fmt: WireFormat = WireFormat.NVFP4_SR, patience: int = 10,
                 fallback: WireFormat | None = None):
        self.fmt, self.patience = WireFormat(fmt), patience
        self.fallback = next_format_up(self.fmt) if fallback is None else WireFormat(fallback)
        self.sums: torch.Tensor | None = None        # float32 [2] on the device: sum x^2, sum noise^2
        self.weight_noise: torch.Tensor | None = None  # float32 0-d: the FC2 weight gradient's noise^2
        self.ratios: list[float] = []
        self.weight_ratios: list[float | None] = []
        self.below = 0
        self.fell_back_at: int | None = None

    @property
    def format(self) -> WireFormat:
        """The format the next exchange sends: ``fmt``, or ``fallback`` once the rule has fallen back."""
        return self.fmt if self.fell_back_at is None else self.fallback

    def record(self, sent: torch.Tensor, arrived: torch.Tensor) -> torch.Tensor | None:
        """sent, arrived: [N, H] the rows before packing and as they decode on arrival -> float32 [N], each
        row's squared rounding error ||arrived - sent||^2 (None once fallen back)."""
        if self.fell_back_at is not None:
            return None
        x = sent.float()
        err = (arrived.float() - x).square().sum(dim=1)
        s = torch.stack([x.square().sum(), err.sum()])
        self.sums = s if self.sums is None else self.sums + s
        return err

    def record_weight_noise(self, noise: torch.Tensor) -> None:
        """noise: float32 0-d, sum over expert rows of ||a_r||^2 ||e_r||^2 (one backward of one rank)."""
        if self.fell_back_at is not None:
            return
        noise = noise.float()
        self.weight_noise = noise if self.weight_noise is None else self.weight_noise + noise

    def end_step(self, group=None, weight_grad_sq: torch.Tensor | None = None) -> float | None:
        """Close one optimizer step's measurement -> its payload ratio (None if nothing was sent on ``fmt``).
        weight_grad_sq: float32 0-d, this rank's squared norm of the weight gradient the noise went into
        (its local experts' FC2 gradient, before any clipping), or None where it is not at hand; the
        weight ratio is measured when every rank of the group gave both."""
        if self.sums is None:
            self.weight_noise = None
            return None
        s, self.sums = self.sums, None
        have = self.weight_noise is not None and weight_grad_sq is not None
        w = torch.stack([self.weight_noise.to(s.device), weight_grad_sq.float().to(s.device)]) if have \
            else s.new_zeros(2)
        self.weight_noise = None
        v = torch.cat([s, w, s.new_tensor([1.0 if have else 0.0])])
        ranks = 1
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(v, group=group)
            ranks = dist.get_world_size(group)
        signal, noise, w_noise, w_signal, n_have = v.tolist()
        ratio = math.sqrt(signal / noise) if noise > 0 else math.inf
        w_ratio = None
        if n_have == ranks and w_noise > 0:
            w_ratio = math.sqrt(w_signal / w_noise)
        self.ratios.append(ratio)
        self.weight_ratios.append(w_ratio)
        decide = ratio if w_ratio is None else w_ratio
        self.below = self.below + 1 if decide < SQRT3 else 0
        if self.below >= self.patience:
            self.fell_back_at = len(self.ratios)
        return ratio

    def summary(self) -> dict:
        """-> {format, fallback, steps measured, payload ratio first / min / median / last, the weight ratio's
        (None where never measured), fell_back_at} for reports."""
        r = sorted(self.ratios)
        w = [x for x in self.weight_ratios if x is not None]
        ws = sorted(w)
        return {"format": self.fmt.value, "fallback": self.fallback.value, "steps": len(self.ratios),
                "ratio_first": self.ratios[0] if r else None, "ratio_min": r[0] if r else None,
                "ratio_median": r[len(r) // 2] if r else None, "ratio_last": self.ratios[-1] if r else None,
                "weight_steps": len(w), "weight_ratio_first": w[0] if w else None,
                "weight_ratio_min": ws[0] if w else None, "weight_ratio_median": ws[len(ws) // 2] if w else None,
                "weight_ratio_last": w[-1] if w else None, "fell_back_at": self.fell_back_at}


def grad_format(fmt: WireFormat | str, rule: GradWireRule | None) -> WireFormat:
    """The format a gradient exchange sends now: its rule's for "auto", else ``fmt``."""
    if fmt == AUTO:
        if rule is None:
            raise ValueError('a gradient wire "auto" needs its GradWireRule (EPConfig.grad_rules)')
        return rule.format
    return WireFormat(fmt)


__all__ = ["SQRT3", "GradWireRule", "grad_format", "next_format_up"]
