"""Grouped FP8 GEMMs (moe_fp4's Gluon and Triton engines) against cuBLAS blockwise scaled_mm, in one run.

For each GEMM of the expert layer's step at the dsv3 and small shapes of bench/moe_layer.py, with
tokens spread evenly over the experts (each group a multiple of 128), with ``--skew`` one expert
holding 4x the mean rows, or with ``--ragged`` each row's expert drawn at random (about half the
experts then end in a 128-row tile, as with a router's counts):

- ``gluon``:   the persistent warp-specialized Gluon engine (kernels/gluon_grouped_gemm.py; fprop,
               dgrad and wgrad, Hopper only; the MXFP4-A row includes its conversion to FP8, and a
               second line times the same engine decoding A inside the kernel instead);
- ``triton``:  moe_fp4.gemm.engines.grouped_fp8_mm_nt / grouped_fp8_mm_wgrad, one launch for all experts;
- ``rowwise``: torch._scaled_grouped_mm with row-wise scales (CUTLASS), torch's own grouped FP8 -
               a coarser recipe than our 1x128 x 128x128 blocks, so a speed anchor, not a twin;
- ``cublas``:  ONE torch.nn.functional.scaled_mm of the same total M, N, K (1x128 x 128x128 blockwise
               for fprop/dgrad, 1x128 x 1x128 for wgrad): the speed of light we compare with;
- ``loop``:    one cuBLAS scaled_mm per expert (the layer's previous path, still the reference);
- ``bf16``:    torch._grouped_mm in bf16 on the same shapes (the bf16 layer's path).

Columns: median ms over --iters after --warmup (CUDA events, bench/harness.py; the runs issued back to
back, so the times are the GPU's, as triton.testing.do_bench measures; ``--sync-each``: each run waits
for the last, its time then includes the host's launch cost); the engines' configs are picked first,
each alone, then the picked ones and the baselines are timed again in --rounds rounds with the order
rotated (cuBLAS first in the first), and those times go in the table; TFLOP/s = 2 R N K /
time, each engine / cublas as a ratio of throughputs, and the host's microseconds per launch of the
Gluon engine and of cuBLAS (issued behind a busy GPU). ``--sweep`` times every tile config in CONFIGS
per GEMM and reports the best.

    python bench/gemm.py                      # GPU (sm90): both shapes
    python bench/gemm.py --shape dsv3 --sweep --json gemm.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import moe_fp4
from moe_fp4.gemm.engines import (
    FP8WeightTensor,
    fp8_mm_nt,
    grouped_fp8_mm_nt,
    grouped_fp8_mm_wgrad,
    quantize_fp8_weight,
    use_grouped_backend,
)
from moe_fp4.kernels import gluon_grouped_gemm as GL
from moe_fp4.kernels import grouped_gemm as G

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/, also under python -P
from harness import interleaved, log, sm90_run, timed, write_results  # noqa: E402

SHAPES = {  # name: (tokens, top_k, experts, hidden, ffn), as in bench/moe_layer.py
    "dsv3": (4096, 8, 32, 7168, 2048),
    "small": (8192, 6, 64, 2048, 1408),
}
CONFIGS = [G.GemmConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s, use_tma=tma)
           for bm, bn, w, s, tma in [(64, 128, 4, 4, False), (64, 128, 4, 4, True), (128, 128, 8, 4, True),
                                     (128, 128, 8, 3, True), (128, 256, 8, 3, True), (64, 128, 4, 3, True),
                                     (128, 64, 4, 4, True)]]

GLUON_CONFIGS = [GL.GluonConfig(num_stages=st, d_bufs=d, group_m=g)
                 for st, d, g in [(3, None, 8), (3, None, 16), (4, 1, 8), (4, 1, 16)]]
GLUON_WGRAD_CONFIGS = [GL.GluonConfig(num_stages=st, group_m=g, split=sp)
                       for st, g, sp in [(3, 8, False), (3, 16, False), (4, 8, True), (3, 8, True), (4, 16, True)]]


def host_us(fn, n: int = 20) -> float:
    """-> microseconds of host time per fn() call, issued back to back behind a busy GPU (what a launch
    costs the CPU: argument handling, descriptors, the driver call)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)   # keep the GPU busy, so no call waits on it
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def gemms(shape: str):
    """-> [(name, kind, R, N, K, experts)]: the step's GEMMs (kind nt / nt_mxfp4 / wgrad)."""
    t, k, e, h, f = SHAPES[shape]
    return [("fc1 fprop", "nt", h, 2 * f), ("fc1 fprop (MXFP4 A)", "nt_mxfp4", h, 2 * f),
            ("fc2 fprop", "nt", f, h), ("fc2 dgrad", "nt", h, f), ("fc1 dgrad", "nt", 2 * f, h),
            ("fc2 wgrad", "wgrad", h, f), ("fc1 wgrad", "wgrad", 2 * f, h)], t * k, e


def route_counts(rows: int, e: int, routing: str) -> list[int]:
    """-> E row counts, each a multiple of 128 (as the layer pads them), for ``rows`` (token, expert) pairs:
    "balanced" (the mean each), "skew" (expert 0 holds 4x the mean, the others share the rest) or
    "ragged" (each row's expert drawn uniformly, seed 0, as a router's counts scatter)."""
    if routing == "skew":
        big = rows * 4 // e
        counts = [big] + [(rows - big) // (e - 1)] * (e - 1)
    elif routing == "ragged":
        pick = torch.randint(0, e, (rows,), generator=torch.Generator().manual_seed(0))
        counts = torch.bincount(pick, minlength=e).tolist()
    else:
        counts = [rows // e // 128 * 128] * e
    counts[-1] += rows - sum(counts)
    return [c + (-c) % 128 for c in counts]


def interleaved_ms(fns: dict, warmup: int, iters: int, rounds: int, back_to_back: bool = False) -> dict:
    """{name: fn} -> {name: median ms}: the contenders timed in ``rounds`` rotated rounds
    (harness.interleaved: round 0 in the given order, one untimed call at each switch, iters // rounds
    timed runs per round, at least 1); a name's time is the median of its round medians."""
    got = interleaved(fns, warmup, iters, rounds, back_to_back=back_to_back)
    return {name: statistics.median(statistics.median(r) for r in v) for name, v in got.items()}


def bench_one(name, kind, k_dim, n_dim, rows, e, args, log):
    """One GEMM: [rows, k_dim] x per-expert [n_dim, k_dim]^T (nt), or dW [n_dim, k_dim] over rows (wgrad)."""
    counts = route_counts(rows, e, "skew" if args.skew else "ragged" if args.ragged else "balanced")
    r = sum(counts)
    dev = "cuda"
    flop = 2 * r * n_dim * k_dim
    res = {"gemm": name, "R": r, "N": n_dim, "K": k_dim, "experts": e, "back_to_back": not args.sync_each}
    b2b = not args.sync_each
    gluon = rowwise = None
    # nt_mxfp4: the engines convert A to FP8 first.
    gluon_default = GL.WGRAD_CONFIG if kind == "wgrad" else GL.NT_CONFIG
    if kind == "wgrad":
        dy = torch.randn(r, n_dim, device=dev, dtype=torch.bfloat16)
        x = torch.randn(r, k_dim, device=dev, dtype=torch.bfloat16)
        a, b = moe_fp4.quantize_fp8(dy.t().contiguous()), moe_fp4.quantize_fp8(x.t().contiguous())
        out = getattr(torch, args.wgrad_out)
        res["out_dtype"] = args.wgrad_out
        run_triton = lambda cfg: lambda: G.grouped_mm_wgrad(a.data, a.scale, b.data, b.scale, counts,  # noqa: E731
                                                            out, config=cfg)
        configs = CONFIGS if args.sweep else [G.WGRAD_CONFIG]
        cublas = lambda: fp8_mm_nt(a, b, out)  # noqa: E731
        with use_grouped_backend("scaled_mm"):
            loop_ms = timed(lambda: grouped_fp8_mm_wgrad(a, b, counts), args.warmup, max(3, args.iters // 4), b2b)
        offs = torch.tensor(counts, device=dev).cumsum(0).int()
        bf16 = lambda: torch._grouped_mm(dy.t(), x, offs=offs)  # noqa: E731
        if GL.supported(dev):
            gluon = lambda cfg: lambda: GL.grouped_mm_wgrad(a.data, a.scale, b.data, b.scale, counts,  # noqa: E731
                                                            out, config=cfg)
    else:
        x = torch.randn(r, k_dim, device=dev, dtype=torch.bfloat16)
        w = torch.randn(e, n_dim, k_dim, device=dev) * k_dim ** -0.5
        wq = quantize_fp8_weight(w)
        a = moe_fp4.quantize_mxfp4(x) if kind == "nt_mxfp4" else moe_fp4.quantize_fp8(x)
        run_triton = lambda cfg: lambda: G.grouped_mm_nt(a.data, a.scale, wq.data, wq.scale, counts,  # noqa: E731
                                                         torch.bfloat16, config=cfg)
        configs = CONFIGS if args.sweep else [G.NT_CONFIG]
        # cuBLAS: one [R, K] x [N, K]^T GEMM with a 128x128-block weight of the same N, K.
        dense = moe_fp4.quantize_fp8(x) if kind == "nt_mxfp4" else a
        w1 = FP8WeightTensor(wq.data[0], wq.scale[0])
        cublas = lambda: fp8_mm_nt(dense, w1, torch.bfloat16)  # noqa: E731
        with use_grouped_backend("scaled_mm"):
            loop_ms = timed(lambda: grouped_fp8_mm_nt(a, wq, counts), args.warmup, max(3, args.iters // 4), b2b)
        offs = torch.tensor(counts, device=dev).cumsum(0).int()
        wb = w.to(torch.bfloat16)
        bf16 = lambda: torch._grouped_mm(x, wb.transpose(1, 2), offs=offs)  # noqa: E731
        if GL.supported(dev):
            gluon = lambda cfg: lambda: GL.grouped_mm_nt(a.data, a.scale, wq.data, wq.scale, counts,  # noqa: E731
                                                         torch.bfloat16, config=cfg)
        # torch's row-wise grouped FP8: one scale per row of x and per (expert, output column) of W.
        xr, sxr = _rowwise_fp8(x)
        wr, swr = _rowwise_fp8(w.reshape(-1, k_dim))
        wr, swr = wr.view(e, n_dim, k_dim), swr.view(e, n_dim)
        rowwise = lambda: torch._scaled_grouped_mm(xr, wr.transpose(1, 2), sxr, swr, offs=offs,  # noqa: E731
                                                   out_dtype=torch.bfloat16)
    runs = [("rowwise", None, rowwise)] if rowwise else []
    if gluon:
        sweep = GLUON_WGRAD_CONFIGS if kind == "wgrad" else GLUON_CONFIGS
        runs += [("gluon", cfg, gluon(cfg)) for cfg in (sweep if args.sweep_gluon else [gluon_default])]
    picked_fns = {}   # label -> the fastest of its runs (its config), for the head-to-head below
    for label, cfg, fn in runs:
        try:
            ms = timed(fn, args.warmup, args.iters, b2b)
        except Exception as exc:  # noqa: BLE001 - reported in the table, the other columns still run
            res[f"{label}_error"] = str(exc).splitlines()[0][:160]
            log(f"  {name}: {label} {cfg or ''} failed: {res[label + '_error']}")
            continue
        if cfg is not None:
            res.setdefault("gluon_sweep", []).append({"config": cfg.__dict__, "ms": ms})
            if args.sweep_gluon:
                log(f"  {name}: gluon stages {cfg.num_stages} d_bufs {cfg.d_bufs} group_m {cfg.group_m} "
                    f"split {cfg.split}: "
                    f"{flop / ms / 1e9:.0f} TFLOP/s")
        if label not in picked_fns or ms < res[f"{label}_ms"]:
            res[f"{label}_ms"], res[f"{label}_tflops"] = ms, flop / ms / 1e9
            picked_fns[label] = fn
            if cfg is not None:
                res["gluon_config"] = cfg.__dict__
    best = None
    for cfg in configs:
        try:
            ms = timed(run_triton(cfg), args.warmup, args.iters, b2b)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
            log(f"  {name}: config {cfg} failed: {str(exc).splitlines()[0][:120]}")
            continue
        res.setdefault("sweep", []).append({"config": cfg.__dict__, "ms": ms})
        if best is None or ms < best[0]:
            best = (ms, cfg)
    if best is None:
        res["error"] = "no config compiled"
        return res
    # The head-to-head: the configs picked above and the baselines, in rotated rounds (cuBLAS first in
    # round 0); these times replace the picking runs' in the table.
    picked = {"cublas": cublas, "bf16": bf16, "triton": run_triton(best[1]), **picked_fns}
    final = interleaved_ms(picked, args.warmup, args.iters, args.rounds, b2b)
    res["rounds"] = args.rounds
    for label in ("gluon", "rowwise"):
        if label in final:
            res[f"{label}_ms"], res[f"{label}_tflops"] = final[label], flop / final[label] / 1e9
    best = (final["triton"], best[1])
    cublas_ms, bf16_ms = final["cublas"], final["bf16"]
    res["host_us"] = {"cublas": host_us(cublas), "bf16": host_us(bf16)}
    if gluon:
        res["host_us"]["gluon"] = host_us(gluon(gluon_default))
    res.update(triton_ms=best[0], config=best[1].__dict__, cublas_ms=cublas_ms, loop_ms=loop_ms, bf16_ms=bf16_ms,
               triton_tflops=flop / best[0] / 1e9, cublas_tflops=flop / cublas_ms / 1e9,
               bf16_tflops=flop / bf16_ms / 1e9, triton_vs_cublas=cublas_ms / best[0],
               triton_vs_loop=loop_ms / best[0])
    for label in ("gluon", "rowwise"):
        if f"{label}_ms" in res:
            res[f"{label}_vs_cublas"] = cublas_ms / res[f"{label}_ms"]
    return res


def _rowwise_fp8(t: torch.Tensor):
    """t: [M, K] float -> (float8_e4m3fn [M, K], float32 [M] scales) with one scale per row (amax / 448)."""
    s = t.float().abs().amax(dim=1).clamp(min=1e-12) / 448.0
    return (t.float() / s[:, None]).to(torch.float8_e4m3fn), s


def compiled_kernels() -> list[str]:
    """One line per compiled specialization of the grouped GEMM kernels: registers, spills, shared
    memory, and whether the PTX uses Hopper's wgmma or the older mma.sync (a 2-4x slower path)."""
    out = []
    for fn in (G._grouped_mm_nt_kernel, G._grouped_mm_wgrad_kernel):
        caches = getattr(fn, "device_caches", {})
        for entry in caches.values():
            for kernel in entry[0].values():
                ptx = kernel.asm.get("ptx", "")
                out.append(f"{fn.__name__}: regs {getattr(kernel, 'n_regs', '?')} spills "
                           f"{getattr(kernel, 'n_spills', '?')} smem {kernel.metadata.shared} "
                           f"warps {kernel.metadata.num_warps} stages {kernel.metadata.num_stages} "
                           f"wgmma {ptx.count('wgmma.mma_async')} mma.sync {ptx.count('mma.sync')} "
                           f"constants {getattr(kernel, 'constants', '')}"[:400])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5,
                   help="the final head-to-head (the picked engines and the baselines) in this many rounds, the "
                        "order rotated each round, cuBLAS first in the first (default 5; keep --iters / --rounds "
                        ">= 4: shorter bursts read low, bench/RESULTS.md)")
    p.add_argument("--sweep", action="store_true", help="time every Triton config in CONFIGS, report the best")
    p.add_argument("--sweep-gluon", action="store_true",
                   help="time every Gluon config in GLUON_CONFIGS, report the best")
    p.add_argument("--skew", action="store_true", help="expert 0 gets 4x the mean rows (default: balanced)")
    p.add_argument("--ragged", action="store_true",
                   help="each row's expert drawn uniformly at random (seed 0), every count then padded to a "
                        "multiple of 128 as the layer pads it: about half the experts end in a 128-row tile")
    p.add_argument("--gemm", nargs="+", help="only these GEMMs (names as in the table, e.g. 'fc1 wgrad')")
    p.add_argument("--sync-each", action="store_true",
                   help="wait for each timed run before issuing the next, so each time includes the host's "
                        "launch cost (default: runs issued back to back, GPU time alone)")
    p.add_argument("--wgrad-out", default="float32", choices=["float32", "bfloat16"],
                   help="output dtype of the wgrad rows (Gluon, Triton and cuBLAS; bf16 grouped is bf16): "
                        "float32 for fp32 master weights, bfloat16 as the layer writes dW for bf16 weights")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--asm", action="store_true",
                   help="after the run, print each compiled grouped-GEMM kernel's registers, spills and MMA kind")
    args = p.parse_args()
    if args.rounds < 1 or args.iters < 1:
        p.error(f"--rounds and --iters must be >= 1, got {args.rounds} and {args.iters}")
    head = sm90_run("bench/gemm.py")
    results = []
    for shape in args.shape:
        table, rows, e = gemms(shape)
        routing = " (skewed: expert 0 has 4x the mean)" if args.skew else " (ragged)" if args.ragged else ""
        timing = "each run from an idle GPU (host launch cost included)" if args.sync_each else \
            "runs back to back (GPU time)"
        log(f"\n{shape}: {rows} rows over {e} experts{routing}; {timing}")
        log("| GEMM | R x N x K | gluon TFLOP/s | gluon/cuBLAS | triton TFLOP/s | triton/cuBLAS | cuBLAS TFLOP/s "
            "| torch row-wise grouped TFLOP/s | bf16 grouped TFLOP/s | per-expert loop ms | triton config "
            "| host us per launch: gluon, cuBLAS |")
        log("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, kind, k_dim, n_dim in table:
            if args.gemm and name not in args.gemm:
                continue
            r = bench_one(name, kind, k_dim, n_dim, rows, e, args, log)
            r["shape"] = shape
            results.append(r)
            if "error" in r:
                log(f"| {name} | {r['error']} |")
                continue
            c = r["config"]
            opt = lambda key, fmt: format(r[key], fmt) if key in r else "-"  # noqa: E731
            log(f"| {name} | {r['R']} x {r['N']} x {r['K']} | {opt('gluon_tflops', '.0f')} "
                f"| {opt('gluon_vs_cublas', '.2f')} | {r['triton_tflops']:.0f} | {r['triton_vs_cublas']:.2f} "
                f"| {r['cublas_tflops']:.0f} | {opt('rowwise_tflops', '.0f')} | {r['bf16_tflops']:.0f} "
                f"| {r['loop_ms']:.3f} "
                f"| {c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['num_stages']}"
                f"{' tma' if c['use_tma'] else ''} "
                f"| {r['host_us'].get('gluon', float('nan')):.0f}, {r['host_us']['cublas']:.0f} |")
    if args.asm:
        for info in compiled_kernels():
            log(info)
    write_results(args.json, head, results)


if __name__ == "__main__":
    main()
