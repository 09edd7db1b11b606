"""Where a MoE layer step leaves the GPU idle: the gaps between consecutive kernels of steps issued
back to back, largest first, each named by the kernels around it.

    python bench/tools/step_gaps.py --config dsv3 --precision fp8 bf16 [--new-weights]

The layer of bench/tools/profile_moe.py (weights cached, a later micro-batch; or with --new-weights
made again each step, as bench/moe_layer.py times it), --warmup steps, then
--steps steps under torch.profiler (CPU and CUDA activities; the profiler's own host overhead widens
host-bound gaps somewhat). Prints per precision the summed kernel time and the profiled window per step,
the gaps over --min-gap-us summed per step, and the --top largest. A gap after a device-to-host copy is
the host's time from the routing's sync to its next launch; one before a kernel that follows a cheap
one is host time spent issuing it. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/tools/, for profile_moe (python -P too)

import torch  # noqa: E402
from profile_moe import layer_step, make_layer  # noqa: E402  (bench/tools/profile_moe.py: the benchmark's layer)
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def gaps(config: str, precision: str, warmup: int, steps: int, min_gap_us: float, top: int,
         new_weights: bool = False, by_kernel: bool = False) -> None:
    m, _, x, g = make_layer(config)
    m.precision = precision

    def step():
        layer_step(m, x, g, new_weights)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kern = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and e.time_range.elapsed_us() > 0), key=lambda e: e.time_range.start)
    window = kern[-1].time_range.end - kern[0].time_range.start
    busy = sum(e.time_range.elapsed_us() for e in kern)
    found = [(b.time_range.start - a.time_range.end, a.name[:60], b.name[:60])
             for a, b in zip(kern, kern[1:]) if b.time_range.start - a.time_range.end > min_gap_us]
    print(f"\n{config} {precision}: {len(kern)} kernels in {steps} steps; summed kernel time "
          f"{busy / steps / 1e3:.2f} ms/step, window {window / steps / 1e3:.2f} ms/step; "
          f"gaps > {min_gap_us:g} us: {len(found)}, {sum(f[0] for f in found) / steps / 1e3:.2f} ms/step")
    for gap, before, after in sorted(found, reverse=True)[:top]:
        print(f"{gap:8.0f} us  after {before:60s} before {after}")
    if by_kernel:
        # Small gaps add up: a step of ~100 launches loses time before kernels that the host issues
        # late, each gap too short to list. Summed by the kernel that follows the gap.
        total: dict[str, list[float]] = {}
        for gap, _, after in found:
            total.setdefault(after, []).append(gap)
        print("  gaps summed by the kernel after them (us per step, count per step):")
        for name, v in sorted(total.items(), key=lambda kv: -sum(kv[1]))[:top]:
            print(f"  {sum(v) / steps:8.1f} us {len(v) / steps:5.1f}x  before {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="dsv3", help="a config of bench/moe_layer.py")
    ap.add_argument("--precision", nargs="+", default=["fp8", "bf16"], choices=["bf16", "fp8", "fp4"])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--min-gap-us", type=float, default=15.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--by-kernel", action="store_true",
                    help="also sum the gaps by the kernel that follows them (use with --min-gap-us 0)")
    ap.add_argument("--new-weights", action="store_true",
                    help="bump the weights' versions before each step (bench/moe_layer.py's step: the FP8 "
                         "weights made again), instead of a later micro-batch's cached ones")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_gaps: needs a CUDA GPU")
    for p in a.precision:
        gaps(a.config, p, a.warmup, a.steps, a.min_gap_us, a.top, a.new_weights, a.by_kernel)


if __name__ == "__main__":
    main()
