"""The EP layer's row sums, timed: the float32 ``index_add_`` the combine and the dispatch gradient used until
the kernel (atomics scattered by row index, then a cast), torch's gather of each received row's expert rows
and a sum over them, and ``moe_fp4.formats.conversions.gather_sum`` (one Triton pass: each expert row read
once, each sum written once in bf16, no atomics). Issue 47's profile (bench/RESULTS.md, 2026-11-28) found the
``index_add_`` at 14% of an EP 2 step of the small preset in both fp8 and fp4.

Rows: R received rows, each with ``k_local`` of its k slots on this rank (the rest point at no row),
Rp = R * k_local expert rows of [H] bf16 (the experts' output), src_row[Rp] -> the received row of each.

Usage: python3 bench/tools/ep_sums.py [--rows 49152] [--hidden 1024] [--k 4] [--k-local 2] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def index_add_sum(y: torch.Tensor, src_row: torch.Tensor, rows: int) -> torch.Tensor:
    """y bf16 [Rp, H], src_row int64 [Rp] -> bf16 [rows, H] (the EP combine's sum before the kernel)."""
    z = torch.zeros(rows + 1, y.shape[1], dtype=torch.float32, device=y.device)
    return z.index_add_(0, src_row, y.float())[:rows].to(y.dtype)


def torch_gather_sum(y: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y bf16 [Rp, H], slots int64 [rows, k] (Rp for an empty slot) -> bf16 [rows, H]: each row's expert
    rows gathered (a zero row for empty slots) and summed in float32 by torch's ops."""
    yz = torch.cat([y, y.new_zeros(1, y.shape[1])])
    return yz.index_select(0, slots.flatten()).view(*slots.shape, -1).float().sum(1).to(y.dtype)


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
    slots = slots.sort(dim=1).values      # each row's expert rows ascending, as the layer's row_slots
    y = torch.randn(rp, h, generator=g).to(torch.bfloat16).to(dev)
    from moe_fp4.formats.conversions import gather_sum
    from moe_fp4.kernels.row_sum import gather_sum_ref

    old, kern = index_add_sum(y, src_row, r), gather_sum(y, slots)
    exact = bool(torch.equal(kern.view(torch.int16), gather_sum_ref(y, slots).view(torch.int16)))
    err = ((old.float() - kern.float()).abs().max() / old.float().abs().max()).item()
    cuda = dev.type == "cuda"
    ms = {"index_add": _timed(lambda: index_add_sum(y, src_row, r), a.iters, cuda),
          "torch_gather_sum": _timed(lambda: torch_gather_sum(y, slots), a.iters, cuda),
          "gather_sum_kernel": _timed(lambda: gather_sum(y, slots), a.iters, cuda)}
    name = torch.cuda.get_device_name() if cuda else "CPU"
    gbs = (rp + r) * h * 2 / ms["gather_sum_kernel"] / 1e6
    out = {"device": name, "rows": r, "hidden": h, "k": k, "k_local": kl, **{f"{n}_ms": v for n, v in ms.items()},
           "kernel_over_index_add": ms["gather_sum_kernel"] / ms["index_add"], "kernel_gb_per_s": gbs,
           "kernel_equals_reference": exact, "max_rel_diff_vs_index_add": err}
    print(f"{name}: R {r}, H {h}, k {k} ({kl} local): index_add_ + cast {ms['index_add']:.3f} ms, torch gather + "
          f"sum {ms['torch_gather_sum']:.3f} ms, gather_sum kernel {ms['gather_sum_kernel']:.3f} ms "
          f"({out['kernel_over_index_add']:.3f}x of index_add_, {gbs:.0f} GB/s); kernel == reference: {exact}; "
          f"largest difference to index_add_ {err:.2e} of the largest sum (its atomics' order)")
    # The same sums over rows as a quantized wire carries them (the combine's and the dispatch gradient's
    # received rows when those exchanges are fp8 / mxfp4): decoded to bf16 and then summed, or decoded inside
    # the sum's pass (exchange.wire.unpack_sum).
    from moe_fp4.exchange.wire import pack, unpack, unpack_sum

    for fmt in ("bf16", "fp8", "mxfp4"):
        wire = pack(y, fmt)
        same = bool(torch.equal(unpack_sum(wire, fmt, h, slots).view(torch.int16),
                                gather_sum(unpack(wire, fmt, h), slots).view(torch.int16)))
        t_two = _timed(lambda: gather_sum(unpack(wire, fmt, h), slots), a.iters, cuda)
        t_one = _timed(lambda: unpack_sum(wire, fmt, h, slots), a.iters, cuda)
        out[f"wire_{fmt}"] = {"decode_then_sum_ms": t_two, "unpack_sum_ms": t_one, "ratio": t_one / t_two,
                              "bit_identical": same}
        print(f"  {fmt} wire rows: decode then sum {t_two:.3f} ms, decoded inside the sum {t_one:.3f} ms "
              f"({t_one / t_two:.3f}x); identical: {same}")
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
