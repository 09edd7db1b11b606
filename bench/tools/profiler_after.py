"""Does the MoE layer's step time drift within one process, and does a torch.profiler session slow what
runs after it? bench/moe_layer.py's isolated step, in rounds, with or without a profiled step between.

    python bench/tools/profiler_after.py --config dsv3 --precision fp8 [--rounds 4] [--profile-after 9]
    TEARDOWN_CUPTI=1 python bench/tools/profiler_after.py ...   # Kineto releases CUPTI after a session

Kineto leaves CUPTI attached after a profiling session unless TEARDOWN_CUPTI=1 (pytorch issue
144455), and every later kernel launch may pay for it; the step also drifts with no profiler at all
(bench/RESULTS.md). Either way a benchmark that times one variant after another charges
the drift to the later one (bench/moe_layer.py interleaves its precisions for that reason). Per round:
--iters steps timed with CUDA events (median ms, the host's median ms to issue a step, NVML's SM clock
and temperature after the
round), then (from --profile-after on) one step under torch.profiler (CUDA activity only). Needs
a CUDA GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/tools/, for profile_moe (python -P too)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/, for harness

import torch  # noqa: E402
from harness import run_times  # noqa: E402
from profile_moe import layer_step, make_layer  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def timed(m, x, g, iters: int) -> tuple[float, float]:
    """-> (median ms of a step from an idle GPU, median host ms to issue it)."""
    hosts = []
    times = run_times(lambda: layer_step(m, x, g, new_weights=True), iters, before=torch.cuda.synchronize,
                      host_ms=hosts)
    return statistics.median(times), statistics.median(hosts)


def gpu_state() -> str:
    """The SM clock (MHz) and temperature (C) NVML reports now, where torch can read them (pynvml)."""
    try:
        return f"SM clock {torch.cuda.clock_rate()} MHz, {torch.cuda.temperature()} C"
    except Exception:  # noqa: BLE001 - pynvml missing: the times alone
        return "SM clock n/a"


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
        ms, host = timed(m, x, g, a.iters)
        profiled = r >= a.profile_after
        print(f"  round {r}: {ms:.3f} ms, host {host:.2f} ms to issue, {gpu_state()}"
              + ("  (then one profiled step)" if profiled else ""), flush=True)
        if profiled:
            with profile(activities=[ProfilerActivity.CUDA]):
                layer_step(m, x, g, new_weights=True)
                torch.cuda.synchronize()


if __name__ == "__main__":
    main()
