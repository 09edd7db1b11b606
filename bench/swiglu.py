"""The fused SwiGLU + quantize kernel with its FP8 encode on PTX against the integer twin, in one run.

    python bench/swiglu.py                                   # M 4096 16384 32768, F 2048, CUDA only
    python bench/swiglu.py --tokens 8192 --ffn 4096 --json swiglu.json

For each shape and output set (FP8 only: the fp8 layer; FP8 + MXFP4 of a and h: the fp4 layer) it
times ``swiglu_quantize(..., asm=True)`` and ``asm=False`` (``triton.testing.do_bench`` medians, each
timed twice, alternating), checks that both give the same bytes, and prints the time ratio
twin / PTX (> 1: the PTX rounding is faster).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.testing

from moe_fp4.kernels import swiglu as KS


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[4096, 16384, 32768])
    ap.add_argument("--ffn", type=int, nargs="*", default=[2048])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/swiglu.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    rows = []
    for m in a.tokens:
        for f in a.ffn:
            h = torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16)
            w = torch.rand(m, device="cuda", dtype=torch.float32)
            for label, hm, am in (("fp8", False, False), ("fp8+mxfp4", True, True)):
                def run(asm):
                    return KS.swiglu_quantize(h, w, hm, am, asm=asm)
                same = _same(run(True), run(False))
                t = {True: [], False: []}
                for _ in range(2):
                    for asm in (True, False):
                        t[asm].append(triton.testing.do_bench(lambda: run(asm), return_mode="median") * 1e3)
                ptx, twin = min(t[True]), min(t[False])
                row = dict(tokens=m, ffn=f, outputs=label, ptx_us=ptx, twin_us=twin, ratio=twin / ptx, same=same)
                rows.append(row)
                print(f"{m:6d} x {f:5d} {label:10s} PTX {ptx:8.1f} us  twin {twin:8.1f} us  twin/PTX {twin / ptx:5.3f}"
                      f"  bytes equal: {same}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, fh, indent=1)
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
