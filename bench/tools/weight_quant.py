"""FP8 weight quantization (128x128 blocks, W and W^T codes from one pass) against a device copy of the
same bytes, at the expert layer's weight shapes.

    python bench/tools/weight_quant.py [--iters 20]
    python bench/tools/weight_quant.py --transpose        # W^T's codes from W's, as the experts' backward makes them

The pass reads W (bf16, 2 bytes per element) and writes two FP8 codes per element (W and W^T), the
same bytes as a bf16 clone of W, which is the baseline. It runs once per weight version (an optimizer
step) through moe_fp4.gemm.engines.FP8_WEIGHTS, so a step with one micro-batch pays it in full.
``asm``: the PTX E4M3 rounding (the default on sm_90); ``twin``: the pure-Triton rounding.

``--transpose``: the dgrad operand W^T made from W's FP8 codes (moe_fp4.kernels.fp8.transpose_fp8_weight_128x128,
what ``FP8WeightTensor.t()`` runs in every backward, per layer) against a device copy of the same bytes and
torch's own ``transpose(1, 2).contiguous()``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/, for harness.py

from harness import timed  # noqa: E402  (bench/harness.py: median of CUDA-event timings)

from moe_fp4.kernels.fp8 import quantize_fp8_weight_128x128, transpose_fp8_weight_128x128  # noqa: E402

SHAPES = {   # (E, N, K) of W13 [E, 2F, H] and W2 [E, H, F], as bench/moe_layer.py's configs
    "dsv3 w13": (32, 4096, 7168), "dsv3 w2": (32, 7168, 2048),
    "small w13": (64, 2816, 2048), "small w2": (64, 2048, 1408),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--transpose", action="store_true", help="time W^T from W's FP8 codes instead")
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if a.transpose:
        transposes(a.iters)
        return
    print("| weight | E x N x K | copy ms | default ms | % of copy | PTX rounding ms | % of copy | Triton twin ms "
          "| % of copy |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (e, n, k) in SHAPES.items():
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
        cells = [timed(lambda: w.clone(), 3, a.iters)]
        for asm in (None, True, False):
            kw = {} if asm is None else {"asm": asm}
            try:
                cells.append(timed(lambda: quantize_fp8_weight_128x128(w, write_q=True, write_t=True, **kw), 3,
                                   a.iters))
            except TypeError:   # a tree from before the asm argument: only its default
                cells.append(None)
        line = f"| {name} | {e} x {n} x {k} | {cells[0]:.3f} |"
        for ms in cells[1:]:
            line += " - | - |" if ms is None else f" {ms:.3f} | {100 * cells[0] / ms:.1f} |"
        print(line, flush=True)

def transposes(iters: int) -> None:
    print("| weight | E x N x K | copy ms | kernel ms | % of copy | torch transpose ms | % of copy |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (e, n, k) in SHAPES.items():
        q = torch.randint(0, 256, (e, n, k), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        copy = timed(lambda: q.clone(), 3, iters)
        kernel = timed(lambda: transpose_fp8_weight_128x128(q), 3, iters)
        torch_t = timed(lambda: q.transpose(1, 2).contiguous(), 3, iters)
        print(f"| {name} | {e} x {n} x {k} | {copy:.3f} | {kernel:.3f} | {100 * copy / kernel:.1f} | {torch_t:.3f} | "
              f"{100 * copy / torch_t:.1f} |", flush=True)


if __name__ == "__main__":
    main()
