"""What the benchmarks share: CUDA-event timing, variants timed in rotated rounds, the run's record and
its JSON.

bench/ is no package: a script puts bench/ on sys.path (``python -P`` leaves the script's directory off)
and imports this file as ``harness``:

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/, also under python -P
    from harness import log, run_record, timed  # noqa: E402

Timing (:func:`run_times`): CUDA events around each run, either each run from an idle GPU (the host waits
for one before it issues the next, so a run's time includes the host's launch cost) or all runs issued
back to back and read after one synchronize (each interval is then the GPU's time alone, as
triton.testing.do_bench times a kernel). Off CUDA the runs are timed with time.perf_counter.

Rounds (:func:`interleaved`): within one process the step time drifts (bench/RESULTS.md), and variants
timed one after the other would charge the drift to the later ones. So the variants take their timed
runs in rounds whose order is rotated (:func:`rotated`): over n rounds every variant takes every
position once, gets all of its timed runs, and an untimed run after every switch.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import sys
import time
from typing import Callable

import torch

from moe_fp4.compare.origin import commit, version

GPU_CLOCK_HZ = 2.0e9     # for torch.cuda._sleep's cycle count; a slower clock only sleeps longer


def log(*parts) -> None:
    print(*parts, flush=True)


def _on_cuda(device) -> bool:
    """device None: the current CUDA device."""
    return device is None or torch.device(device).type == "cuda"


def sync(device=None) -> None:
    """Wait for the GPU (``device`` None: the current one); nothing off CUDA."""
    if _on_cuda(device):
        torch.cuda.synchronize(device)


def run_times(fn: Callable[[], object], n: int, *, back_to_back: bool = False, before: Callable | None = None,
              device=None, lead_s: float = 0.0, host_ms: list | None = None) -> list[float]:
    """-> milliseconds of each of ``n`` runs of fn(), CUDA events around each (``device`` not CUDA:
    time.perf_counter around each).

    back_to_back=False: each run's end event is waited for before the next run is issued, so every run
    starts from an idle GPU and its time includes the host's launch cost. True: every run is issued at
    once and the events are read after one synchronize, so the host runs ahead and each interval is the
    GPU's time alone; ``lead_s`` > 0 first puts a GPU sleep of that many seconds in the stream, so the
    host has queued the runs before the GPU starts on them. ``before()``: untimed, ahead of each run's
    start event (zeroing gradients, a barrier). ``host_ms``: a list that gets, per run, the host's
    milliseconds from just before its start event to just after its end event is recorded."""
    if not _on_cuda(device):
        times = []
        for _ in range(n):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    if back_to_back and lead_s > 0 and hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int(lead_s * GPU_CLOCK_HZ))
    times = []
    for start, end in events:
        if before is not None:
            before()
        t0 = time.perf_counter() if host_ms is not None else 0.0
        start.record()
        fn()
        end.record()
        if host_ms is not None:
            host_ms.append((time.perf_counter() - t0) * 1e3)
        if not back_to_back:
            end.synchronize()
            times.append(start.elapsed_time(end))
    if back_to_back:
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    return times


def chained_times(fn: Callable[[], object], n: int) -> list[float]:
    """-> milliseconds of each of n runs of fn() issued one after another with one CUDA event between
    two runs, read after one synchronize: a run's interval reaches to the next run's start, so the GPU's
    idle time between runs (a host-bound loop) counts in it."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    for i in range(n):
        events[i].record()
        fn()
    events[n].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in zip(events, events[1:])]


def timed(fn: Callable[[], object], warmup: int, iters: int, back_to_back: bool = False) -> float:
    """-> median milliseconds of fn() over ``iters`` runs of :func:`run_times` (CUDA), after ``warmup``
    untimed runs and a synchronize."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(run_times(fn, iters, back_to_back=back_to_back))


def rotated(names: list, rounds: int):
    """The order of each of ``rounds`` rounds: round r starts at names[r mod n] and wraps around, so over
    n rounds every name takes every position once."""
    for r in range(rounds):
        k = r % len(names)
        yield names[k:] + names[:k]


def interleaved(runs: dict, warmup: int, iters: int, rounds: int, *, back_to_back: bool = False,
                before: Callable | None = None, enter: Callable | None = None,
                device=None) -> dict[str, list[list[float]]]:
    """{name: fn} -> {name: [milliseconds of its timed runs, one list per round]}.

    Each variant first takes ``warmup`` untimed runs (in the given order), then ``rounds`` rounds follow
    in :func:`rotated` order (round 0 in the given order); at its turn a variant takes one untimed run (the
    first after another variant's), a synchronize, and iters // rounds (at least 1) timed runs of
    :func:`run_times` (``back_to_back`` and ``device`` as there). ``enter(name)``: untimed, whenever a
    variant takes its turn and before its warm-up (e.g. switching a layer's precision); ``before()``:
    untimed, ahead of every run."""
    names = list(runs)
    for name in names:
        if enter is not None:
            enter(name)
        for _ in range(warmup):
            if before is not None:
                before()
            runs[name]()
    sync(device)
    per_round = max(1, iters // rounds)
    out: dict[str, list[list[float]]] = {name: [] for name in names}
    for order in rotated(names, rounds):
        for name in order:
            if enter is not None:
                enter(name)
            if before is not None:
                before()
            runs[name]()              # untimed: the first run after another variant's
            sync(device)
            out[name].append(run_times(runs[name], per_round, back_to_back=back_to_back, before=before,
                                       device=device))
    return out


def device_name(device=None) -> str:
    """The GPU's name, or "cpu (<processor>)" off CUDA."""
    if _on_cuda(device) and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def run_record(device=None) -> dict:
    """The run's record: {device (:func:`device_name`), device_type, torch, triton ("not installed"
    without it), moe_fp4 (its version), commit (moe_fp4.compare.origin.commit), argv, date (UTC, ISO 8601,
    seconds)}."""
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - a record without Triton says so
        triton_version = "not installed"
    cuda = _on_cuda(device) and torch.cuda.is_available()
    return {"device": device_name(device), "device_type": "cuda" if cuda else "cpu", "torch": torch.__version__,
            "triton": triton_version, "moe_fp4": version(), "commit": commit(), "argv": sys.argv,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def sm90_run(script: str) -> dict:
    """For a GEMM benchmark (exits without an sm90+ GPU): -> :func:`run_record`, after logging it in one
    line."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        sys.exit(f"{script}: needs an sm90+ GPU (FP8 tensor cores); nothing to measure here")
    head = run_record()
    log(" ".join(f"{k}={v}" for k, v in head.items() if k != "argv"))
    return head


def write_json(path: str | None, doc: dict, **dump_kw) -> None:
    """doc as JSON at ``path`` (nothing when None); ``dump_kw`` go to json.dump (indent 1 unless given)."""
    if path:
        with open(path, "w") as fh:
            json.dump(doc, fh, **{"indent": 1, **dump_kw})


def write_results(path: str | None, head: dict, results: list) -> None:
    """{"header": head, "results": results} as JSON at ``path`` (nothing when None)."""
    if path:
        write_json(path, {"header": head, "results": results})
        log(f"wrote {path}")


__all__ = ["chained_times", "device_name", "interleaved", "log", "rotated", "run_record", "run_times", "sm90_run",
           "sync", "timed", "write_json", "write_results"]
