"""Error metrics used by tests and benchmarks."""

from __future__ import annotations

import math

import torch


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `test` against `ref` in dB (float64 sums; inf if equal)."""
    ref, test = ref.double(), test.double()
    err = (ref - test).pow(2).sum().item()
    return math.inf if err == 0 else 10 * math.log10(ref.pow(2).sum().item() / err)


__all__ = ["sqnr_db"]
