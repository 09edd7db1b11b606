"""Is the MoE layer step bound by the host? Step time against GPU time, host-to-device syncs, the ops
that spend the most host time, and the host cost of one launch of each kernel family.

    python bench/tools/host_bound.py --config dsv3 --precisions bf16 fp8 fp4 [--new-weights]

Per precision, after warm-up, gradients set to None before every step (as bench/moe_layer.py does;
with --new-weights the weights' versions are bumped too, so each step makes its FP8 weights again):
- ``isolated``: median ms of one step timed with CUDA events from an idle GPU to its end (what
  bench/moe_layer.py reports);
- ``back-to-back``: ms per step of steps issued one after another, synchronized only at the end (the
  host may run ahead of the GPU, as in training);
- ``gpu``: the step's summed kernel time under torch.profiler;
- ``host``: ms from the step's start until forward + backward have returned, without a final sync
  (the time the Python side needs to issue the step, including any wait inside it for the GPU);
- ``syncs``: the step's synchronizing CUDA calls (torch.cuda.set_sync_debug_mode), with where they are;
- the top ops by self CPU time.
A step time well above ``gpu`` means the GPU waits for the host. Then, per launch family, the host
microseconds of one launch (median of back-to-back launches, no sync between). ``--cprofile N``: where
that host time goes, the N functions with the most own time under cProfile, for --iters steps of each
precision and for each launch family's calls.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/, for moe_layer, harness
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/tools/, for profile_moe (also under python -P)

import torch  # noqa: E402
from harness import run_times  # noqa: E402
from profile_moe import layer_args, layer_step, make_layer  # noqa: E402  (bench/tools/profile_moe.py: the same layer)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import moe_fp4  # noqa: E402
from moe_fp4.gemm.engines import quantize_fp8_weight  # noqa: E402
from moe_fp4.kernels import gluon_grouped_gemm as GL  # noqa: E402


def _host_us(fn, n: int = 200) -> float:
    """Median host microseconds of one call of fn over n back-to-back calls (no sync between)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _cprofile(fn, n: int, top: int) -> str:
    """The ``top`` functions by own time over n calls of fn (cProfile; the GPU synchronized before and
    after, so a call that blocks on a full launch queue shows as time in the launch)."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    # Drop pstats' preamble; keep the table (times summed over the n calls).
    lines = out.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return f"  (cProfile over {n} calls; times are totals)\n" + "\n".join(lines[start:start + top + 1])


def _syncs(fn) -> list[str]:
    """The synchronizing CUDA calls of fn, each with the innermost moe_fp4 frame that made it."""
    found = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            found.append(f"{str(w.message)[:80]} at {w.filename}:{w.lineno}")
    return found


def main() -> None:
    p = layer_args(__doc__.splitlines()[0], 20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also print the N functions with the most host time (cProfile) per precision and family")
    p.add_argument("--new-weights", action="store_true",
                   help="bump the weights' versions before each step, so the FP8 weights are made again "
                        "(bench/moe_layer.py's step); default: cached, as in a later micro-batch")
    a = p.parse_args()
    m, cfg, x, g = make_layer(a.config)
    def step(m, x, g):
        layer_step(m, x, g, a.new_weights)

    tokens = x.shape[0]
    print(f"{a.config}: {tokens} tokens, {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for prec in a.precisions:
        m.precision = prec
        for _ in range(3):
            step(m, x, g)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(a.iters):
            step(m, x, g)
        torch.cuda.synchronize()
        back_to_back = (time.perf_counter() - t) * 1e3 / a.iters
        hosts = []
        isolated = run_times(lambda: step(m, x, g), a.iters, before=torch.cuda.synchronize, host_ms=hosts)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(m, x, g)
            torch.cuda.synchronize()
        gpu = sum(e.time_range.elapsed_us() for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
        syncs = _syncs(lambda: step(m, x, g))
        print(f"\n=== {a.config} {prec}: isolated {statistics.median(isolated):.2f} ms/step, back-to-back "
              f"{back_to_back:.2f} ms/step, gpu {gpu:.2f} ms (kernel time), host {statistics.median(hosts):.2f} ms "
              f"to issue the step; {len(syncs)} synchronizing calls", flush=True)
        for s in syncs:
            print(f"  sync: {s}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=60))
        if a.cprofile:
            print(f"host time of {a.config} {prec} steps by function:")
            print(_cprofile(lambda: step(m, x, g), a.iters, a.cprofile), flush=True)

    # Host cost of one launch per kernel family (dsv3-sized operands, results discarded).
    h, f, e = cfg.hidden, cfg.ffn, cfg.num_experts
    rows = 128 * e
    xb = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    xq = moe_fp4.quantize_fp8(xb)
    w = quantize_fp8_weight(torch.randn(e, 2 * f, h, device="cuda") * h ** -0.5)
    counts = [128] * e
    offs = torch.tensor(counts, device="cuda").cumsum(0).int()
    wb = torch.randn(e, h, 2 * f, device="cuda", dtype=torch.bfloat16)
    fams = {
        "torch._grouped_mm (bf16)": lambda: torch._grouped_mm(xb, wb, offs=offs),
        "torch.mm (bf16)": lambda: torch.mm(xb, wb[0]),
        "quantize_fp8 (Triton)": lambda: moe_fp4.quantize_fp8(xb),
        "quantize_mxfp4 (Triton)": lambda: moe_fp4.quantize_mxfp4(xb),
        "empty_like + add (torch)": lambda: xb + 1,
    }
    if GL.supported(xb.device):
        fams["Gluon grouped_mm_nt"] = lambda: GL.grouped_mm_nt(xq.data, xq.scale, w.data, w.scale, counts)
    print("\nhost microseconds per launch (median of 200 back-to-back calls):")
    for name, fn in fams.items():
        try:
            print(f"  {name:32s} {_host_us(fn):8.1f}", flush=True)
        except Exception:  # noqa: BLE001 - one family failing does not hide the others
            print(f"  {name:32s} failed: {traceback.format_exc().splitlines()[-1]}")
    if a.cprofile:
        for name, fn in fams.items():
            if "torch" not in name:
                print(f"\nhost time of {name} by function:")
                print(_cprofile(fn, 200, a.cprofile), flush=True)


if __name__ == "__main__":
    main()
