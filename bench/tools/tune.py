"""Tile-size sweep for every Triton kernel on one shape, each timed next to a copy of the same bytes.

    python bench/tools/tune.py --tokens 32768 --hidden 7168 --json tune.json
    ncu --section SpeedOfLight python bench/tools/tune.py --once   # each kernel once, defaults, for a profiler

Prints, per kernel, every configuration's time and %copy (bytes read + written, data and scales,
against a device-to-device copy of the same byte count measured in the same run), best first. Use
it to pick the launchers' defaults; bench/conversions.py measures the defaults across shapes.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.testing

from moe_fp4.kernels import fp8 as K8
from moe_fp4.kernels import mxfp4 as KMX
from moe_fp4.kernels import transpose as KT


def _bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return sum(_bytes(o) for o in obj)


def _copy_ms(moved: int) -> float:
    """Median ms of a device copy moving `moved` bytes (it reads moved/2 and writes moved/2)."""
    src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")


def _grid(**axes):
    keys = list(axes)
    return [dict(zip(keys, vals)) for vals in itertools.product(*axes.values())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ops", nargs="*", default=None, help="only these kernels")
    ap.add_argument("--once", action="store_true", help="run each kernel once with its defaults (for ncu)")
    a = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(a.tokens, a.hidden, device="cuda", dtype=torch.bfloat16)
    mx = KMX.quantize_mxfp4_rowwise_ref(x)
    f8 = K8.quantize_fp8_rowwise_ref(x)
    rowmk = _grid(block_m=[4, 8, 16, 32], block_k=[256, 512, 1024], num_warps=[4, 8])
    tiles = _grid(block_m=[2, 4, 8, 16], tiles=[2, 4, 8], num_warps=[2, 4, 8])
    # The SWAR kernels do little work per element: small programs of 1-4 warps keep more in flight,
    # but one-warp programs stop at 32 resident per SM (half its warps), so larger ones are swept too.
    small_rowmk = _grid(block_m=[1, 2, 4, 8], block_k=[256, 512, 1024, 2048], num_warps=[1, 2, 4])
    small_tiles = _grid(block_m=[1, 2, 4, 8], tiles=[2, 4, 8, 16], num_warps=[1, 2, 4])
    wide_rowmk = _grid(block_m=[2, 4, 8, 16], block_k=[1024, 2048], num_warps=[2, 4, 8])
    ops = [
        ("bf16_to_mxfp4", lambda **c: KMX.quantize_mxfp4_rowwise(x, **c), (x,), rowmk + small_rowmk + wide_rowmk),
        ("mxfp4_to_bf16", lambda **c: KMX.dequantize_mxfp4(*mx, torch.bfloat16, **c), mx, small_rowmk + wide_rowmk),
        ("fp8_to_mxfp4", lambda **c: KMX.quantize_mxfp4_from_fp8(*f8, **c), f8, rowmk + small_rowmk + wide_rowmk),
        ("bf16_to_fp8", lambda **c: K8.quantize_fp8_rowwise(x, **c), (x,), tiles),
        ("bf16_to_fp8_and_mxfp4", lambda **c: K8.quantize_fp8_and_mxfp4(x, **c), (x,), tiles + small_tiles),
        ("mxfp4_to_fp8", lambda **c: K8.mxfp4_to_fp8_rowwise(*mx, **c), mx, small_tiles),
        ("mxfp4_to_fp8_colwise", lambda **c: KT.mxfp4_to_fp8_colwise(*mx, **c), mx,
         _grid(nb=[1, 2, 4, 8], num_warps=[1, 2, 4])),
        ("fp8_to_fp8_colwise", lambda **c: KT.fp8_to_fp8_colwise(*f8, **c), f8,
         _grid(g=[1, 2, 4, 8], num_warps=[1, 2, 4, 8])),
        ("bf16_cast_transpose", lambda **c: KT.quantize_fp8_rowwise_colwise(x, **c), (x,),
         _grid(tiles_k=[1, 2, 4], slice_k=[32, 64, 128], num_warps=[4, 8, 16])),
    ]
    ops = [op for op in ops if a.ops is None or op[0] in a.ops]
    if a.once:
        for name, run, _, _ in ops:
            run()
        torch.cuda.synchronize()
        return
    results = []
    for name, run, inputs, configs in ops:
        moved = _bytes(inputs) + _bytes(run(**configs[0]))
        t_copy = _copy_ms(moved)
        rows = []
        for cfg in configs:
            try:
                t = triton.testing.do_bench(lambda: run(**cfg), return_mode="median")
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
                print(f"{name} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            rows.append({"op": name, **cfg, "time_us": t * 1e3, "pct_copy": 100 * t_copy / t})
        rows.sort(key=lambda r: r["time_us"])
        print(f"\n{name}  ({moved / 1e6:.0f} MB moved, copy {t_copy * 1e3:.1f} us = "
              f"{moved / t_copy / 1e6:.0f} GB/s)", flush=True)
        for r in rows[:6]:
            cfg = {k: v for k, v in r.items() if k not in ("op", "time_us", "pct_copy")}
            print(f"  {r['time_us']:8.1f} us  {r['pct_copy']:5.1f}% copy  {cfg}", flush=True)
        results += rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "tokens": a.tokens, "hidden": a.hidden, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
