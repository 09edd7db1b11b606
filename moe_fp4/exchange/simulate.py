"""An exchange's numerics on one rank: the values and gradients as the EP wire would deliver them,
without a second process (``EPConfig.simulate``; the MoE layer uses it at world size 1)."""

from __future__ import annotations

import torch

from moe_fp4.exchange.a2a import check_value_formats
from moe_fp4.exchange.ep import GradSlot, GradWireRule, _check_hidden, grad_format
from moe_fp4.exchange.wire import UNQUANTIZED, OutputFormat, WireFormat, pack, unpack
from moe_fp4.formats.containers import FP8BlockTensor, MXFP4Tensor
from moe_fp4.kernels.fp8 import m_major
from moe_fp4.kernels.numerics import FP8_EXP_MIN


class _Simulated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt: WireFormat, grad_fmt: WireFormat, rule: GradWireRule | None, slot: GradSlot | None,
                src_row: torch.Tensor | None):
        ctx.grad_fmt, ctx.rule, ctx.slot, ctx.src_row = grad_fmt, rule, slot, src_row
        return unpack(pack(x.contiguous(), fmt), fmt, x.shape[1], OutputFormat.BF16, x.dtype)

    @staticmethod
    def backward(ctx, g):
        fmt = ctx.grad_fmt
        g = g.contiguous()
        arrived = unpack(pack(g, fmt), fmt, g.shape[1], OutputFormat.BF16, g.dtype)
        if ctx.rule is not None:
            err2 = ctx.rule.record(g, arrived)
            if err2 is not None and ctx.slot is not None:
                # Each row's squared rounding error at its expert rows (0 for padding rows), for the experts'
                # FC2 weight-gradient noise: what EP's combine backward sends beside the rows.
                ctx.slot.put(None, torch.cat([err2, err2.new_zeros(1)]).index_select(0, ctx.src_row), ctx.rule)
        return arrived, None, None, None, None, None


def simulate_exchange(x: torch.Tensor, fmt: WireFormat, grad_fmt: WireFormat | str,
                      rule: GradWireRule | None = None, slot: GradSlot | None = None,
                      src_row: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, H] -> x as it arrives through the ``fmt`` wire, its gradient as it arrives through
    ``grad_fmt`` (EPConfig.simulate: an exchange's numerics without a second process); ``grad_fmt``
    "auto" takes its format from ``rule``, which measures the gradient's norm over its noise. With
    ``slot`` (a :class:`GradSlot` the experts read) and ``src_row`` (int64 [Rp], the row of x each
    expert row came from, N for padding rows), a measuring rule also gets the experts' FC2 weight
    gradient noise, as under EP."""
    fmt, grad_fmt = WireFormat(fmt), grad_format(grad_fmt, rule)
    check_value_formats("simulate_exchange", fmt=fmt)
    _check_hidden(x.shape[1], (fmt, grad_fmt), "simulate_exchange")
    rule = rule if rule is not None and grad_fmt is rule.fmt else None
    if (slot is None) != (src_row is None):
        raise ValueError("simulate_exchange: slot and src_row go together")
    return _Simulated.apply(x, fmt, grad_fmt, rule, slot, src_row)


def simulate_dispatch_rows(x: torch.Tensor, fmt: WireFormat, src_row: torch.Tensor):
    """x: [T, H] local rows, src_row: int64 [Rp] the token of each expert row (T for a padding row) ->
    the expert input a receiver's experts get from a ``fmt`` dispatch (EPConfig.simulate): MXFP4 rows as
    received, FP8 rows as received, NVFP4 rows converted to FP8 1x128 on arrival, expanded to the expert
    rows with zero padding rows, as :func:`dispatch` builds them; None for an unquantized format (its
    rows are :func:`simulate_exchange`'s). No gradient: the experts take it as ``x_q``."""
    fmt = WireFormat(fmt)
    if fmt in UNQUANTIZED:
        return None
    t, hidden = x.shape
    got = unpack(pack(x.detach().contiguous(), fmt), fmt, hidden,
                 OutputFormat.MXFP4 if fmt is WireFormat.MXFP4 else OutputFormat.FP8, x.dtype)
    rows = src_row.shape[0]
    data = torch.cat([got.data, got.data.new_zeros(1, got.data.shape[1])]).index_select(0, src_row)
    if isinstance(got, MXFP4Tensor):
        scale = torch.cat([got.scale, got.scale.new_zeros(1, got.scale.shape[1])]).index_select(0, src_row)
        return MXFP4Tensor(data, scale, (rows, hidden), x.dtype)
    # The padding row's scales must be valid powers of two: 2^-126, an all-zero tile's scale.
    pad = got.scale.new_full((1, got.scale.shape[1]), 2.0 ** FP8_EXP_MIN)
    scale = m_major(torch.cat([got.scale, pad]).index_select(0, src_row))
    return FP8BlockTensor(data, scale, (rows, hidden), x.dtype)


__all__ = ["simulate_dispatch_rows", "simulate_exchange"]
