"""Does the grouped FP8 GEMM's time depend on its A operand's values? One GPU, the same shapes and weights,
A made four ways, the calls of each way timed in interleaved rounds with CUDA events.

    python bench/tools/gemm_data.py [--rows 98304] [--k 1024] [--n 1024] [--experts 8] [--rounds 6] [--iters 20]

A: ``quantize_fp8(x)`` (fp8's operand), ``mxfp4_to_fp8(quantize_mxfp4(x))`` (fp4's dispatched rows under
EP), ``quantize_fp8`` of the MXFP4-grid values, and zeros; x standard normal bf16. Defaults: the small
preset's FC1 fprop on one rank of EP 2 at batch 48 (98,304 rows over 8 local experts). Prints each way's
median ms and its ratio to the first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from moe_fp4.formats.conversions import mxfp4_to_fp8, quantize_fp8, quantize_mxfp4
from moe_fp4.gemm.engines import grouped_fp8_mm_nt, grouped_gemm_backend, quantize_fp8_weight

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/, for harness
from harness import run_times  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=98304)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gemm_data.py: needs a CUDA GPU")
    if a.rows % (128 * a.experts):
        raise SystemExit(f"gemm_data.py: --rows must be a multiple of 128 x --experts ({128 * a.experts})")
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    counts = [a.rows // a.experts] * a.experts
    x = torch.randn(a.rows, a.k, device=dev, dtype=torch.bfloat16)
    w = quantize_fp8_weight(torch.randn(a.experts, a.n, a.k, device=dev, dtype=torch.bfloat16) * 0.02)
    ops = {"fp8 of x": quantize_fp8(x), "mxfp4 -> fp8 of x": mxfp4_to_fp8(quantize_mxfp4(x)),
           "fp8 of MXFP4-grid x": quantize_fp8(quantize_mxfp4(x).dequantize().to(torch.bfloat16)),
           "zeros": quantize_fp8(torch.zeros_like(x))}
    print(f"{torch.cuda.get_device_name(0)}, backend {grouped_gemm_backend(dev).name}, A [{a.rows}, {a.k}], "
          f"B [{a.experts}, {a.n}, {a.k}]")
    for _ in range(3):
        grouped_fp8_mm_nt(ops["fp8 of x"], w, counts)
    times = {n: [] for n in ops}
    for rnd in range(a.rounds):
        order = list(ops.items()) if rnd % 2 == 0 else list(ops.items())[::-1]   # no way always first
        for name, op in order:
            def block(op=op):
                for _ in range(a.iters):
                    grouped_fp8_mm_nt(op, w, counts)

            (ms,) = run_times(block, 1, before=torch.cuda.synchronize)   # one pair of events around the block
            times[name].append(ms / a.iters)
    base = statistics.median(times["fp8 of x"])
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name:<22} median {med:.4f} ms, {med / base:.3f}x fp8 of x; rounds {' '.join(f'{v:.4f}' for v in t)}")


if __name__ == "__main__":
    main()
