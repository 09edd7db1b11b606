"""AdamW fused with the FP8 weight quantization (kernels/adamw.py) against what it replaces, at the expert
layer's weight shapes: torch's fused AdamW step followed by the FP8 pair (quantize_fp8_weight_pair, what
the next forward does through moe_fp4.gemm.engines.FP8_WEIGHTS), each alone and back to back, one run.

    python bench/tools/adamw_fp8.py [--dtype bfloat16 float32] [--iters 20]

Bytes per element: the fused step reads p, grad, exp_avg, exp_avg_sq and writes p, exp_avg, exp_avg_sq
and two FP8 codes; "% of copy" is a device copy of that many bytes (read + write) against the step's time.
The gradient is bf16 for bf16 weights and float32 for float32 weights. Also sweeps the kernel's rows
per slice (chunk) and warps; every configuration's output is checked against the default's, byte for
byte.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/, for harness.py

from harness import timed  # noqa: E402  (bench/harness.py: median of CUDA-event timings)

from moe_fp4.gemm.engines import quantize_fp8_weight_pair  # noqa: E402
from moe_fp4.kernels.adamw import AdamWScalars, adamw_fp8_weight_step  # noqa: E402

SHAPES = {   # (E, N, K) of W13 [E, 2F, H] and W2 [E, H, F], as bench/moe_layer.py's configs
    "dsv3 w13": (32, 4096, 7168), "dsv3 w2": (32, 7168, 2048),
    "small w13": (64, 2816, 2048), "small w2": (64, 2048, 1408),
}
CONFIGS = [(16, 32), (16, 16), (16, 64), (8, 32), (8, 16)]   # (num_warps, chunk); the first is the default


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    hp = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    c = AdamWScalars.at(10, hp["lr"], *hp["betas"], hp["eps"], hp["weight_decay"])
    print("| weight | dtype | torch AdamW ms | FP8 pair ms | both ms | fused ms | fused / both | fused % of copy | "
          + " | ".join(f"w{w} c{ch} ms" for w, ch in CONFIGS[1:]) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in range(6 + len(CONFIGS) - 1)) + " |")
    for dname in a.dtype:
        dtype = getattr(torch, dname)
        for name, (e, n, k) in SHAPES.items():
            w = torch.nn.Parameter(torch.randn(e, n, k, device="cuda", dtype=dtype) * 0.02)
            w.grad = torch.randn_like(w) * 1e-3
            opt = torch.optim.AdamW([w], fused=True, **hp)
            opt.step()                                         # its state exists from here
            m = torch.rand_like(w, dtype=torch.float32 if dtype == torch.float32 else dtype) * 1e-3
            v = torch.rand_like(m) * 1e-6
            with torch.no_grad():
                t_adamw = timed(lambda: opt.step(), 3, a.iters)
                t_pair = timed(lambda: quantize_fp8_weight_pair(w), 3, a.iters)
                t_both = timed(lambda: (opt.step(), quantize_fp8_weight_pair(w)), 3, a.iters)
                pw = w.detach()
                times, outs = [], []
                # outputs compared on the first two experts (a copy of every tensor per configuration would
                # not fit at dsv3 size), all from the inputs as they are before any timed step
                first = [t[:2].clone() for t in (pw, w.grad, m, v)]
                for nw, ch in CONFIGS:
                    args = [t.clone() for t in first]
                    outs.append([t.view(torch.uint8) for t in adamw_fp8_weight_step(*args, c, num_warps=nw,
                                                                                   chunk=ch)] + args)
                for nw, ch in CONFIGS:
                    times.append(timed(lambda: adamw_fp8_weight_step(pw, w.grad, m, v, c, num_warps=nw, chunk=ch),
                                       3, a.iters))
                for o in outs[1:]:
                    assert all(torch.equal(x, y) for x, y in zip(o, outs[0])), "configurations disagree"
                per_elem = 3 * w.element_size() + w.grad.element_size() + 3 * m.element_size() + 2
                buf = torch.empty(w.numel() * per_elem // 2, dtype=torch.uint8, device="cuda")
                t_copy = timed(lambda: buf.clone(), 3, a.iters)
            print(f"| {name} | {dname} | {t_adamw:.3f} | {t_pair:.3f} | {t_both:.3f} | {times[0]:.3f} | "
                  f"{times[0] / t_both:.3f} | {100 * t_copy / times[0]:.1f} | "
                  + " | ".join(f"{t:.3f}" for t in times[1:]) + " |", flush=True)
            w = opt = m = v = buf = outs = pw = None   # before the next shape's tensors
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
