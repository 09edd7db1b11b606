"""The EP layer's row sums, timed: the float32 ``index_add_`` the combine and the dispatch gradient use today
(atomics scattered by row index) against a gather of each received row's expert rows and a sum over them
(no atomics, a fixed order). Issue 47's profile (bench/RESULTS.md, 2026-11-28) found the ``index_add_`` at 14%
of an EP 2 step of the small preset in both fp8 and fp4; this measures what replacing it would save, at the
layer's shapes, before the layer changes.

Rows: R received rows, each with ``k_local`` of its k slots on this rank (the rest point at a zero row),
Rp = R * k_local expert rows of [H] bf16 (the experts' output), src_row[Rp] -> the received row of each.

Usage: python3 bench/tools/ep_sums.py [--rows 49152] [--hidden 1024] [--k 4] [--k-local 2] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def index_add_sum(y: torch.Tensor, src_row: torch.Tensor, rows: int) -> torch.Tensor:
    """y bf16 [Rp, H], src_row int64 [Rp] -> float32 [rows + 1, H] (today's EP combine sum)."""
    z = torch.zeros(rows + 1, y.shape[1], dtype=torch.float32, device=y.device)
    return z.index_add_(0, src_row, y.float())


def gather_sum(y: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y bf16 [Rp, H], slots int64 [rows, k] (Rp for an empty slot) -> float32 [rows, H]: each row's expert
    rows gathered (a zero row for empty slots) and summed in slot order."""
    yz = torch.cat([y, y.new_zeros(1, y.shape[1])])
    return yz.index_select(0, slots.flatten()).view(*slots.shape, -1).float().sum(1)


def _timed(fn, iters: int, cuda: bool) -> float:
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=49152, help="received rows R")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--k", type=int, default=4, help="slots per row (top-k)")
    p.add_argument("--k-local", type=int, default=2, help="slots per row on this rank")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device="cpu").manual_seed(0)
    r, k, kl, h = a.rows, a.k, a.k_local, a.hidden
    rp = r * kl
    # Expert rows grouped by expert, as the layer has them: a random permutation of the (row, slot) pairs.
    order = torch.randperm(rp, generator=g)
    src_row = (order // kl).to(dev)
    slots = torch.full((r, k), rp, dtype=torch.int64)
    slots[order // kl, order % kl] = torch.arange(rp)
    slots = slots.to(dev)
    y = torch.randn(rp, h, generator=g).to(torch.bfloat16).to(dev)
    a_sum, b_sum = index_add_sum(y, src_row, r)[:r], gather_sum(y, slots)
    err = ((a_sum - b_sum).abs().max() / a_sum.abs().max()).item()
    ms_a = _timed(lambda: index_add_sum(y, src_row, r), a.iters, dev.type == "cuda")
    ms_b = _timed(lambda: gather_sum(y, slots), a.iters, dev.type == "cuda")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    out = {"device": name, "rows": r, "hidden": h, "k": k, "k_local": kl, "index_add_ms": ms_a,
           "gather_sum_ms": ms_b, "gather_over_index_add": ms_b / ms_a, "max_rel_diff": err}
    print(f"{name}: R {r}, H {h}, k {k} ({kl} local): index_add_ {ms_a:.3f} ms, gather + sum {ms_b:.3f} ms "
          f"({ms_b / ms_a:.3f}x); largest difference {err:.2e} of the largest sum (float32 order)")
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
