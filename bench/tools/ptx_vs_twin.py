"""Kernels whose E4M3 rounding has a PTX form, timed with it and with its integer twin in one run.

    python bench/tools/ptx_vs_twin.py                              # M 4096 16384 32768, CUDA only
    python bench/tools/ptx_vs_twin.py --tokens 8192 --json ptx.json

Each kernel runs with ``asm=True`` (the PTX ``cvt.rn.satfinite.e4m3x2.f32``) and ``asm=False`` (the
integer e4m3_rne it replaced, the previous kernels' arithmetic): ``triton.testing.do_bench`` medians,
each timed twice, alternating; both outputs compared byte for byte. Printed: the two times and the
ratio twin / PTX (> 1: the PTX form is faster). Shapes: the fused SwiGLU + quantize at F = 2048 (FP8
only as in the fp8 layer, FP8 + MXFP4 of a and h as in the fp4 layer), the cast-transpose (FP8 of dY
and of dY^T) and the row-wise quantizers at H = 7168.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.testing

from moe_fp4.kernels import fp8 as K8
from moe_fp4.kernels import swiglu as KS
from moe_fp4.kernels import transpose as KT


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, (tuple, list)):
        return all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _cases(m: int):
    h = torch.randn(m, 2 * 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(m, device="cuda", dtype=torch.float32)
    x = torch.randn(m, 7168, device="cuda", dtype=torch.bfloat16)
    return [
        ("swiglu_quantize fp8", f"{m} x 2048", lambda asm: KS.swiglu_quantize(h, w, False, False, asm=asm)),
        ("swiglu_quantize fp8+mxfp4", f"{m} x 2048", lambda asm: KS.swiglu_quantize(h, w, True, True, asm=asm)),
        ("quantize_fp8_rowwise_colwise", f"{m} x 7168", lambda asm: KT.quantize_fp8_rowwise_colwise(x, asm=asm)),
        ("quantize_fp8_rowwise", f"{m} x 7168", lambda asm: K8.quantize_fp8_rowwise(x, asm=asm)),
        ("quantize_fp8_and_mxfp4", f"{m} x 7168", lambda asm: K8.quantize_fp8_and_mxfp4(x, asm=asm)),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[4096, 16384, 32768])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/tools/ptx_vs_twin.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    rows = []
    for m in a.tokens:
        for name, shape, run in _cases(m):
            same = _same(run(True), run(False))
            t = {True: [], False: []}
            for _ in range(2):
                for asm in (True, False):
                    t[asm].append(triton.testing.do_bench(lambda: run(asm), return_mode="median") * 1e3)
            ptx, twin = min(t[True]), min(t[False])
            rows.append(dict(kernel=name, shape=shape, ptx_us=ptx, twin_us=twin, ratio=twin / ptx, same=same))
            print(f"{name:30s} {shape:>12s}  PTX {ptx:8.1f} us  twin {twin:8.1f} us  twin/PTX {twin / ptx:5.3f}"
                  f"  bytes equal: {same}", flush=True)
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, fh, indent=1)
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
