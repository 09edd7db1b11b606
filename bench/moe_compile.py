"""The MoE layer's training step (forward + backward), eager against torch.compile, bf16 / fp8 / fp4, in one run.

    python bench/moe_compile.py                                  # GPU: dsv3 and small shapes
    python bench/moe_compile.py --shape small --precisions fp8 --modes eager compiled
    python bench/moe_compile.py --json moe_compile.json
    python bench/moe_compile.py --shape dsv3 --modes eager compiled --profile 3   # + each variant's kernels
    python bench/moe_compile.py --shape dsv3 --optimizer   # a training step: the weights change every step

Modes: ``eager`` (the layer as users call it: counts read on the host once a layer), ``eager-device`` (device
counts: no host sync, the experts' buffers at the static bound of rows), ``compiled`` (``torch.compile`` of the
layer, default mode: device counts, the experts as the moe_fp4::experts_forward / _backward op pair),
``graphs`` (``torch.compile(mode="reduce-overhead")``: the compiled step replayed as a CUDA graph), and
``compiled-pinned`` / ``graphs-pinned``, the same with ``MoE.pin_fp8_weights()``: the graph reads the pinned FP8
weights instead of quantizing them every step. No optimizer runs here, so the weights never change: the eager
layer's cache hits every step and a pinned graph's copies stay valid (in training both are made once per
optimizer step, outside the graph); unpinned, the compiled graph quantizes W every step. Every
variant of a shape runs interleaved with the others (bench/harness.py), and ratios are taken against compiled
bf16 of the same run, the baseline users who compile would run. A variant that fails reports its error. Each
compiled variant reports the graph breaks its first step made (torch._dynamo's counters). ``--profile N``:
after the timing, N more steps of each variant under torch.profiler; the GPU time per kernel name (the top
rows, and the total) goes to the log and the JSON, so two variants' steps can be compared kernel by kernel.
On CPU: a tiny smoke run (timings mean nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import interleaved, log, run_record, write_json  # noqa: E402

from moe_fp4.model.moe import MoE, MoEConfig  # noqa: E402

# The shapes of the table: (MoEConfig arguments, tokens per step).
SHAPES = {
    "dsv3": (dict(hidden=7168, ffn=2048, num_experts=32, top_k=8), 8192),
    "small": (dict(hidden=1024, ffn=512, num_experts=16, top_k=4), 16384),
    "tiny": (dict(hidden=256, ffn=128, num_experts=4, top_k=2), 256),
}
MODES = ("eager", "eager-device", "compiled", "compiled-pinned", "graphs", "graphs-pinned")
PRECISIONS = ("bf16", "fp8", "fp4")


def _variant(shape: str, precision: str, mode: str, device, optimizer: bool = False):
    """-> (step function, layer) of one variant: a fresh layer (same seed, same weights in every variant);
    ``optimizer``: each step ends with an AdamW step (AdamWFP8Weights in fp8 / fp4, which makes the FP8 copies
    in its update pass; torch's fused AdamW in bf16), outside the compiled region."""
    kw, tokens = SHAPES[shape]
    torch.manual_seed(0)
    layer = MoE(MoEConfig(**kw), precision, device=device)
    layer.host_counts = {"eager": None, "eager-device": False}.get(mode)
    fn = layer
    if mode.endswith("-pinned") and precision != "bf16":
        layer.pin_fp8_weights()
    if mode.startswith("compiled"):
        fn = torch.compile(layer)
    elif mode.startswith("graphs"):
        fn = torch.compile(layer, mode="reduce-overhead")
    x = torch.randn(tokens, kw["hidden"], dtype=torch.bfloat16, device=device).requires_grad_()
    dy = torch.randn(tokens, kw["hidden"], dtype=torch.bfloat16, device=device)
    opt = None
    if optimizer:
        from moe_fp4.model.optim import AdamWFP8Weights

        opt = (torch.optim.AdamW(layer.parameters(), lr=1e-5, fused=device.type == "cuda") if precision == "bf16"
               else AdamWFP8Weights(layer.parameters(), lr=1e-5))

    def step():
        if mode.startswith("graphs"):
            torch.compiler.cudagraph_mark_step_begin()
        layer.zero_grad(set_to_none=True)
        x.grad = None
        fn(x).backward(dy)
        if opt is not None:
            opt.step()

    return step, layer


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters
    return sum(counters["graph_break"].values())


def profile_kernels(step, n: int, top: int = 25) -> dict:
    """-> {"total_us": GPU microseconds per step, "top": [[kernel name, us per step, calls per step], ...]}
    from n steps of ``step`` under torch.profiler (CUDA activity only), the names summed over the steps."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us, calls = per.get(e.name, (0.0, 0))
            per[e.name] = (us + e.time_range.elapsed_us(), calls + 1)
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])
    return {"total_us": sum(us for us, _ in per.values()) / n,
            "top": [[name[:120], us / n, calls / n] for name, (us, calls) in rows[:top]]}


def run_shape(shape: str, precisions, modes, warmup: int, iters: int, rounds: int, device, profile: int = 0,
              optimizer: bool = False) -> dict:
    # Each shape compiles from scratch, as a program with one model does: recompiling the layer at a second
    # shape in one process makes its sizes dynamic, which this benchmark does not measure (and torch 2.11's
    # value-range analysis fails on at the small shape after dsv3: "'BooleanTrue' object has no attribute
    # 'as_coeff_Mul'").
    torch._dynamo.reset()
    runs, errors, breaks = {}, {}, {}
    for precision in precisions:
        for mode in modes:
            name = f"{precision} {mode}"
            try:
                step, _ = _variant(shape, precision, mode, device, optimizer)
                log(f"[{shape}] {name}: first step (compiles where it compiles)")
                before = _graph_breaks()
                step()
                if mode != "eager" and mode != "eager-device":
                    breaks[name] = _graph_breaks() - before
                    log(f"[{shape}] {name}: {breaks[name]} graph breaks")
                runs[name] = step
            except Exception as e:  # noqa: BLE001 - a failing variant is a result
                errors[name] = "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]
                log(f"[{shape}] {name}: FAILED {errors[name][:300]}")
    times = interleaved(runs, warmup, iters, rounds, device=device) if runs else {}
    ms = {name: statistics.median(t for r in rounds_ for t in r) for name, rounds_ in times.items()}
    base = ms.get("bf16 compiled")
    out = {"shape": shape, "config": SHAPES[shape][0], "tokens": SHAPES[shape][1], "optimizer": optimizer,
           "median_ms": ms, "errors": errors,
           "graph_breaks": breaks, "vs_bf16_compiled": {n: v / base for n, v in ms.items()} if base else {}}
    for name, v in ms.items():
        log(f"[{shape}] {name:>20}: {v:8.3f} ms" + (f"  ({v / base:.3f}x bf16 compiled)" if base else ""))
    if profile and device.type == "cuda":
        out["profile"] = {}
        for name, step in runs.items():
            prof = out["profile"][name] = profile_kernels(step, profile)
            log(f"[{shape}] {name}: GPU time {prof['total_us']:.1f} us per step; top kernels (us per step, calls):")
            for kname, us, calls in prof["top"]:
                log(f"    {us:9.1f} {calls:5.1f}  {kname}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", nargs="+", choices=list(SHAPES), default=None)
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--iters", type=int, default=None, help="timed steps per variant (default 12; CPU 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; CPU 0)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; CPU 1)")
    p.add_argument("--optimizer", action="store_true",
                   help="each step ends with an AdamW step (AdamWFP8Weights in fp8 / fp4): the weights change")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N more steps of each variant (GPU only): GPU time per kernel name")
    p.add_argument("--json", default=None, metavar="PATH")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shapes = a.shape or (["dsv3", "small"] if cuda else ["tiny"])
    modes = a.modes if cuda else [m for m in a.modes if not m.startswith("graphs")]
    warmup = a.warmup if a.warmup is not None else (3 if cuda else 0)
    iters = a.iters if a.iters is not None else (12 if cuda else 1)
    rounds = a.rounds if a.rounds is not None else (3 if cuda else 1)
    doc = {"run": run_record(device), "results": []}
    for shape in shapes:
        doc["results"].append(run_shape(shape, a.precisions, modes, warmup, iters, rounds, device, a.profile,
                                          a.optimizer))
        write_json(a.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
