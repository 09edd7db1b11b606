"""Does a torch.profiler session slow down what runs after it in the same process? The MoE layer's
step time (bench/moe_layer.py's isolated step) before and after one profiled step.

    python bench/tools/profiler_after.py --config dsv3 --precision fp8 [--rounds 3]
    TEARDOWN_CUPTI=1 python bench/tools/profiler_after.py ...   # Kineto releases CUPTI after a session

Kineto leaves CUPTI attached after a profiling session unless TEARDOWN_CUPTI=1 (pytorch issue
144455), and every later kernel launch pays for it. A benchmark that profiles one variant and then
times the next is then biased against the later one. Per round: --iters steps timed with CUDA events
(median ms), then (from --profile-after on) one step under torch.profiler (CUDA activity only). Needs
a CUDA GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/tools/, for profile_moe (python -P too)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from profile_moe import layer_step, make_layer  # noqa: E402


def timed(m, x, g, iters: int) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        layer_step(m, x, g, new_weights=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="dsv3")
    ap.add_argument("--precision", default="fp8", choices=["bf16", "fp8", "fp4"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--profile-after", type=int, default=2, help="profile one step after this round (1-based)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profiler_after: needs a CUDA GPU")
    m, _, x, g = make_layer(a.config)
    m.precision = a.precision
    for _ in range(3):
        layer_step(m, x, g, new_weights=True)
    print(f"{a.config} {a.precision}, TEARDOWN_CUPTI={os.environ.get('TEARDOWN_CUPTI', 'unset')}: "
          f"median ms of {a.iters} steps per round")
    for r in range(1, a.rounds + 1):
        ms = timed(m, x, g, a.iters)
        profiled = r >= a.profile_after
        print(f"  round {r}: {ms:.3f} ms" + ("  (then one profiled step)" if profiled else ""), flush=True)
        if profiled:
            with profile(activities=[ProfilerActivity.CUDA]):
                layer_step(m, x, g, new_weights=True)
                torch.cuda.synchronize()


if __name__ == "__main__":
    main()
