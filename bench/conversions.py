"""Kernel bandwidth: every moe_fp4 conversion against a device copy of the same bytes, in one run.

For each op and MoE shape (tokens x hidden, bf16 activations) it reports the median time of one
call, the bytes it moves (inputs read + outputs written, data and scales, from the tensors' own
sizes), GB/s, the GB/s of a device-to-device copy moving the same bytes measured in the same run,
the ratio of the two (%copy), the speedup over the op's pure-torch twin in ``moe_fp4.formats.reference``
under torch.compile (vs_ref), and for the fused BF16 -> {FP8, MXFP4} pass the speedup over running
the two separate quantizers back to back (vs_separate). Every op's output is checked bit for bit
against the eager twin once per shape; a difference is printed as MISMATCH, recorded in the JSON,
and makes the script exit with status 1.

    python bench/conversions.py                             # all ops, tokens {4096..65536} x hidden {2048,4096,7168}
    python bench/conversions.py --json conversions.json
    python bench/conversions.py --ops bf16_to_mxfp4 mxfp4_to_fp8_colwise --tokens 32768 --hidden 7168
    python bench/conversions.py --ref eager                 # time the twins without torch.compile (--ref none: skip)
    python bench/conversions.py --smoke                     # tiny shape (256 x 256) on whatever device, few iterations

Method (CUDA): each timed call sits between two CUDA events; the host first queues all timed calls
behind a GPU sleep so launch overhead does not show; the median over ``--iters`` calls (fewer when
one measurement would pass ``--budget`` seconds, never under 5) is reported. Inputs rotate over
distinct copies covering max(256 MiB, 4x L2) (at least 3), and the last outputs stay alive in a
ring of the same length, so no call finds its input or output in L2. The copy baseline is
``dst.copy_(src)`` on uint8 buffers of bytes_moved/2 bytes (reads N, writes N) with the same
rotation. On CPU (``--smoke`` without a GPU) calls are timed with time.perf_counter.

The references are compiled with ``torch.compile(dynamic=True)`` (one compile per op for all
shapes; ``--ref compile-static`` specialises per shape, slower to run); if compiling fails the
eager twin is timed instead and the row says "eager".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

import moe_fp4
from moe_fp4 import FP8BlockTensor, MXFP4Tensor, NVFP4Tensor
from moe_fp4.formats import reference as twins

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/, also under python -P
from harness import log, run_record, run_times, sync, write_json  # noqa: E402

DEFAULT_TOKENS = [4096, 16384, 32768, 65536]
DEFAULT_HIDDEN = [2048, 4096, 7168]
ROTATION_MIN_BYTES = 256 << 20
MIN_ITERS = 5
PROBE_ITERS = 3          # calls timed together (with a sync) to size the measurement


# ----------------------------------------------------------------------------------------- ops

@dataclass(frozen=True)
class OpSpec:
    """One benchmarked conversion: positional args from a bf16 activation, the moe_fp4 function
    (None if the API does not have it yet), its pure-torch twin (None if there is none), and for a
    fused op the unfused sequence it replaces."""

    name: str
    prepare: Callable[[torch.Tensor], tuple]        # bf16 [tokens, hidden] -> args of run/ref
    run: Callable | None                            # run(*args) -> output
    ref: Callable | None                            # ref(*args) -> the same output, pure torch
    separate: Callable | None = None                # separate(*args): the unfused equivalent


def _op(name: str, fn: str, prepare: Callable, separate: Callable | None = None) -> OpSpec:
    return OpSpec(name, prepare, getattr(moe_fp4, fn, None), getattr(twins, fn, None), separate)


def _bf16(x):
    return (x,)


def _fp8(x):
    return (moe_fp4.quantize_fp8(x),)


def _mxfp4(x):
    return (moe_fp4.quantize_mxfp4(x),)


def _mxfp4_and_dtype(x):
    return (moe_fp4.quantize_mxfp4(x), torch.bfloat16)


def _fp8_then_mxfp4(x):
    return moe_fp4.quantize_fp8(x), moe_fp4.quantize_mxfp4(x)


def _stochastic(fn):
    """fn with stochastic rounding at a fixed (seed, step, rank), or None where fn is None."""
    return None if fn is None else functools.partial(fn, rounding="stochastic", seed=1, step=2, rank=3)


OPS = [
    _op("bf16_to_mxfp4", "quantize_mxfp4", _bf16),
    # Stochastic rounding: Philox bits in the kernel; its speed against bf16_to_mxfp4's.
    OpSpec("bf16_to_mxfp4_sr", _bf16, _stochastic(moe_fp4.quantize_mxfp4), _stochastic(twins.quantize_mxfp4)),
    # NVFP4: two kernels, the tensor scale's amax (one pass over x) and the blocks.
    _op("bf16_to_nvfp4", "quantize_nvfp4", _bf16),
    OpSpec("bf16_to_nvfp4_sr", _bf16, _stochastic(moe_fp4.quantize_nvfp4), _stochastic(twins.quantize_nvfp4)),
    _op("nvfp4_to_bf16", "dequantize_nvfp4", lambda x: (moe_fp4.quantize_nvfp4(x), torch.bfloat16)),
    # FP8 <-> NVFP4: from the FP8 codes (two passes: amax, blocks), and to the GEMM's FP8 (one pass);
    # the column-wise one (the weight gradient's operand) one pass too.
    _op("fp8_to_nvfp4", "quantize_nvfp4", _fp8),
    _op("nvfp4_to_fp8", "nvfp4_to_fp8", lambda x: (moe_fp4.quantize_nvfp4(x),)),
    _op("nvfp4_to_fp8_colwise", "nvfp4_to_fp8_colwise", lambda x: (moe_fp4.quantize_nvfp4(x),)),
    _op("fp8_to_mxfp4", "quantize_mxfp4", _fp8),
    _op("mxfp4_to_bf16", "dequantize_mxfp4", _mxfp4_and_dtype),
    _op("mxfp4_to_fp8", "mxfp4_to_fp8", _mxfp4),
    _op("mxfp4_to_fp8_colwise", "mxfp4_to_fp8_colwise", _mxfp4),
    _op("bf16_to_fp8", "quantize_fp8", _bf16),
    _op("bf16_to_fp8_and_mxfp4", "quantize_fp8_and_mxfp4", _bf16, separate=_fp8_then_mxfp4),
    _op("fp8_to_fp8_colwise", "fp8_to_fp8_colwise", _fp8),
]
OP_NAMES = [op.name for op in OPS]


# ------------------------------------------------------------------- tensors, bytes, checking

def nbytes(obj: Any) -> int:
    """Bytes held by an op's argument or output (containers: data + scales); 0 for non-tensors."""
    if isinstance(obj, (MXFP4Tensor, FP8BlockTensor, NVFP4Tensor)):
        return obj.nbytes
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(nbytes(o) for o in obj)
    return 0


def clone(obj: Any) -> Any:
    """A copy at new addresses (same strides: FP8 scales stay M-major)."""
    if isinstance(obj, (MXFP4Tensor, FP8BlockTensor, NVFP4Tensor)):
        return dataclasses.replace(obj, data=obj.data.clone(), scale=obj.scale.clone())
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, tuple):
        return tuple(clone(o) for o in obj)
    return obj


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() == 1 and t.dtype != torch.uint8:      # float8 codes
        return t.view(torch.uint8)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t                                                  # uint8 codes/E8M0, float32 scales


def mismatches(out: Any, ref: Any, where: str = "out") -> list[str]:
    """Every way `out` differs from `ref` bit for bit (empty list: identical)."""
    if type(out) is not type(ref):
        return [f"{where}: {type(out).__name__} instead of {type(ref).__name__}"]
    if isinstance(out, (MXFP4Tensor, FP8BlockTensor, NVFP4Tensor)):
        shape = [] if out.shape == ref.shape else [f"{where}.shape {tuple(out.shape)} != {tuple(ref.shape)}"]
        extra = (mismatches(out.tensor_scale, ref.tensor_scale, f"{where}.tensor_scale")
                 if isinstance(out, NVFP4Tensor) else [])
        return (shape + mismatches(out.data, ref.data, f"{where}.data")
                + mismatches(out.scale, ref.scale, f"{where}.scale") + extra)
    if isinstance(out, (tuple, list)):
        if len(out) != len(ref):
            return [f"{where}: {len(out)} outputs instead of {len(ref)}"]
        return [m for i, (o, r) in enumerate(zip(out, ref)) for m in mismatches(o, r, f"{where}[{i}]")]
    if isinstance(out, torch.Tensor):
        if out.dtype != ref.dtype or out.shape != ref.shape:
            return [f"{where}: {out.dtype}{tuple(out.shape)} instead of {ref.dtype}{tuple(ref.shape)}"]
        a, b = _bits(out), _bits(ref)
        if torch.equal(a, b):
            return []
        return [f"{where}: {int((a != b).sum())} of {a.numel()} elements differ"]
    return [] if out == ref else [f"{where}: {out!r} != {ref!r}"]


# ---------------------------------------------------------------------------------- timing

@dataclass(frozen=True)
class TimingConfig:
    device: torch.device
    iters: int
    warmup: int
    budget_s: float          # cap on the timed calls of one measurement
    rotation_bytes: int      # inputs of a ring cover at least this much (CUDA)


def ring_size(input_bytes: int, cfg: TimingConfig) -> int:
    if cfg.device.type != "cuda":
        return 3
    return max(3, math.ceil(cfg.rotation_bytes / max(input_bytes, 1)))


def measure(fn: Callable, ring: list[tuple], cfg: TimingConfig) -> tuple[float, int]:
    """Median seconds of one call fn(*ring[i % len(ring)]), i = 0, 1, ...; -> (median, calls timed).

    The last len(ring) outputs are kept alive, so outputs rotate over distinct memory as inputs do."""
    n = len(ring)
    keep: list[Any] = [None] * n
    i = 0

    def call():
        nonlocal i
        keep[i % n] = fn(*ring[i % n])
        i += 1

    for _ in range(cfg.warmup):
        call()
    sync(cfg.device)
    t0 = time.perf_counter()
    for _ in range(PROBE_ITERS):
        call()
    host_s = (time.perf_counter() - t0) / PROBE_ITERS
    sync(cfg.device)
    per_call = max((time.perf_counter() - t0) / PROBE_ITERS, 1e-7)
    iters = max(min(cfg.iters, MIN_ITERS), min(cfg.iters, int(cfg.budget_s / per_call)))

    # CUDA: every call issued back to back behind a GPU sleep long enough for the host to queue them all
    times = [t * 1e-3 for t in run_times(call, iters, back_to_back=True, device=cfg.device,
                                         lead_s=min(1.5 * host_s * iters + 1e-3, 0.5))]
    keep.clear()
    return statistics.median(times), iters


class Reference:
    """An op's pure-torch twin, compiled once and reused for every shape; falls back to eager for
    good if compiling or running the compiled function fails."""

    def __init__(self, fn: Callable, mode: str):
        self.fn, self.mode = fn, mode
        self.call = fn if mode == "eager" else torch.compile(fn, dynamic=(mode == "compile"))

    def measure(self, ring: list[tuple], cfg: TimingConfig) -> tuple[float, int, str]:
        if self.mode != "eager":
            try:
                t0 = time.perf_counter()
                self.call(*ring[0])
                sync(cfg.device)
                if time.perf_counter() - t0 > 2:
                    log(f"    (reference first call incl. torch.compile: {time.perf_counter() - t0:.1f} s)")
                return (*measure(self.call, ring, cfg), "compiled")
            except Exception as e:  # noqa: BLE001 - any compile/runtime failure means "use eager"
                msg = (str(e).strip().splitlines() or [""])[0][:160]
                log(f"    torch.compile of the reference failed ({type(e).__name__}: {msg}); timing it eager")
                self.mode, self.call = "eager", self.fn
                gc.collect()
        return (*measure(self.fn, ring, cfg), "eager")


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ benchmark

def make_input(tokens: int, hidden: int, device: torch.device) -> torch.Tensor:
    """bf16 activations: N(0,1) with 1/16 of the channels scaled x50 (outlier channels), as in bench/run.py."""
    g = torch.Generator(device=device).manual_seed(tokens * 100003 + hidden)
    x = torch.randn(tokens, hidden, generator=g, device=device, dtype=torch.bfloat16)
    x[:, torch.randperm(hidden, generator=g, device=device)[: max(1, hidden // 16)]] *= 50
    return x


def bench_op(spec: OpSpec, x: torch.Tensor, cfg: TimingConfig, ref: Reference | None) -> dict:
    tokens, hidden = x.shape
    row: dict[str, Any] = {"op": spec.name, "tokens": tokens, "hidden": hidden}
    args = spec.prepare(x)
    out = spec.run(*args)
    read, written = nbytes(args), nbytes(out)
    row.update(bytes_read=read, bytes_written=written, bytes_moved=read + written)

    if spec.ref is None:
        row["valid"] = None                          # nothing to check against
    else:
        problems = mismatches(out, spec.ref(*args))
        row["valid"], row["mismatch"] = not problems, problems
        if problems:
            log(f"!!!!!!!! MISMATCH {spec.name} {tokens}x{hidden}: kernel != moe_fp4.formats.reference twin: "
                + "; ".join(problems))
    del out
    free_memory(cfg.device)

    ring = [args] + [clone(args) for _ in range(ring_size(read, cfg) - 1)]
    row["rotation_buffers"] = len(ring)
    t, row["iters"] = measure(spec.run, ring, cfg)
    row["time_us"] = t * 1e6
    row["gbps"] = row["bytes_moved"] / t / 1e9
    if spec.separate is not None:
        t_sep, _ = measure(spec.separate, ring, cfg)
        row["separate_time_us"], row["vs_separate"] = t_sep * 1e6, t_sep / t
    if ref is not None:
        t_ref, _, row["ref_mode"] = ref.measure(ring, cfg)
        row["ref_time_us"], row["vs_ref"] = t_ref * 1e6, t_ref / t
    del ring, args
    free_memory(cfg.device)

    half = row["bytes_moved"] // 2                   # a copy of N bytes reads N and writes N
    dev = cfg.device
    copies = [(torch.empty(half, dtype=torch.uint8, device=dev), torch.empty(half, dtype=torch.uint8, device=dev))
              for _ in range(ring_size(half, cfg))]
    t_copy, _ = measure(lambda src, dst: dst.copy_(src), copies, cfg)
    del copies
    free_memory(cfg.device)
    row["copy_time_us"] = t_copy * 1e6
    row["copy_gbps"] = 2 * half / t_copy / 1e9
    row["pct_copy"] = 100.0 * row["gbps"] / row["copy_gbps"]
    return row


# ------------------------------------------------------------------------------------ output

COLUMNS = [("op", 21), ("tokens", 6), ("hidden", 6), ("time_us", 9), ("GB/s", 7), ("copy_GB/s", 9),
           ("%copy", 6), ("vs_ref", 13), ("vs_separate", 11), ("check", 8)]


def _cells(cells: list) -> str:
    """First column left-aligned, the rest right-aligned, one space apart."""
    return " ".join(f"{str(c):<{w}}" if i == 0 else f"{str(c):>{w}}"
                    for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS)))


def table_header() -> str:
    return _cells([name for name, _ in COLUMNS])


def table_line(row: dict) -> str:
    def num(key, fmt, suffix=""):
        v = row.get(key)
        if v is None:
            return "-"
        return f"{v:{fmt if abs(v) >= 10 else '.3g'}}{suffix}"

    if "skipped" in row or "error" in row:
        cells = [row["op"], row["tokens"], row["hidden"]] + ["-"] * 6
        cells.append("skipped" if "skipped" in row else "ERROR")
    else:
        vs_ref = num("vs_ref", ".2f", "x")
        if row.get("ref_mode") == "eager":
            vs_ref += " (eager)"
        check = {True: "ok", False: "MISMATCH", None: "no twin"}[row.get("valid")]
        cells = [row["op"], row["tokens"], row["hidden"], num("time_us", ".1f"), num("gbps", ".0f"),
                 num("copy_gbps", ".0f"), num("pct_copy", ".1f"), vs_ref, num("vs_separate", ".2f", "x"), check]
    return _cells(cells)


def l2_bytes(device: torch.device) -> int:
    """The GPU's L2 cache in bytes (0 off CUDA or where torch does not say)."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
    return 0


# -------------------------------------------------------------------------------------- main

def cuda_run(script: str, iters: int) -> tuple[TimingConfig, dict]:
    """For a bench script that needs a GPU (exits without one): -> (this module's timing config on
    CUDA, with ``iters`` timed calls, 3 warmups, a 0.25 s budget and rotation over >= 4x L2; the
    run's record, harness.run_record), after logging that record."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU")
    dev = torch.device("cuda")
    cfg = TimingConfig(dev, iters, 3, 0.25, max(ROTATION_MIN_BYTES, 4 * l2_bytes(dev)))
    record = run_record(dev)
    log(f"{record['device']} | torch {record['torch']} | triton {record['triton']} | commit {record['commit']} "
        f"| {record['date']}")
    log(f"command: {' '.join(sys.argv)}")
    return cfg, record


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=None, help=f"rows (default {DEFAULT_TOKENS})")
    p.add_argument("--hidden", type=int, nargs="+", default=None, help=f"columns (default {DEFAULT_HIDDEN})")
    p.add_argument("--ops", nargs="+", choices=OP_NAMES, default=OP_NAMES, help="ops to run (default: all)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 50; smoke 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 3; smoke 1)")
    p.add_argument("--budget", type=float, default=0.25,
                   help="seconds of timed calls per measurement before --iters is cut (default 0.25)")
    p.add_argument("--ref", choices=["compile", "compile-static", "eager", "none"], default="compile",
                   help="how to time the moe_fp4.formats.reference twins for vs_ref "
                        "(default: torch.compile, dynamic shapes)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here (rewritten after every row)")
    p.add_argument("--smoke", action="store_true", help="tokens 256 x hidden 256 on whatever device, few iterations")
    a = p.parse_args(argv)
    a.tokens = a.tokens or ([256] if a.smoke else DEFAULT_TOKENS)
    a.hidden = a.hidden or ([256] if a.smoke else DEFAULT_HIDDEN)
    a.iters = a.iters or (3 if a.smoke else 50)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.smoke else 3)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = run_record(device)
    name, l2 = record["device"], l2_bytes(device)
    torch_version, triton_version, date = record["torch"], record["triton"], record["date"]
    cfg = TimingConfig(device, a.iters, a.warmup, a.budget, max(ROTATION_MIN_BYTES, 4 * l2))
    if a.ref == "compile-static":
        for knob in ("recompile_limit", "cache_size_limit"):       # one graph per shape
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
    timer = "CUDA events" if device.type == "cuda" else "time.perf_counter"
    log(f"moe_fp4 {moe_fp4.__version__} kernel bandwidth | device: {name}"
        + (f" (L2 {l2 / 2**20:.0f} MiB)" if l2 else "")
        + f" | torch {torch_version} | triton {triton_version} | {date}")
    log(f"command: {' '.join([sys.executable.split('/')[-1], *sys.argv])}")
    log(f"method: median of up to {a.iters} calls ({timer}, {a.warmup} warmup, <= {a.budget} s each measurement), "
        f"inputs/outputs rotating over >= {cfg.rotation_bytes / 2**20:.0f} MiB (>= 3 buffers) on CUDA; "
        f"copy = uint8 dst.copy_(src) of bytes_moved/2; vs_ref = reference twin ({a.ref}) time / kernel time")

    specs = [op for op in OPS if op.name in a.ops]
    refs: dict[str, Reference] = {}
    for op in specs:
        if op.run is None:
            log(f"{op.name}: skipped: not available (moe_fp4 has no such function yet)")
        elif op.ref is None:
            log(f"{op.name}: no twin in moe_fp4.formats.reference: no output check, no vs_ref")
        elif a.ref != "none":
            refs[op.name] = Reference(op.ref, a.ref)

    result = {**record, "l2_bytes": l2, "iters": a.iters, "warmup": a.warmup, "budget_s": a.budget, "ref": a.ref,
              "rotation_bytes": cfg.rotation_bytes, "rows": []}

    def save():
        write_json(a.json, result)

    shapes = [(t, h) for t in a.tokens for h in a.hidden]
    total, done, t_start = len(shapes) * len(specs), 0, time.perf_counter()
    log("")
    for tokens, hidden in shapes:
        x = make_input(tokens, hidden, device)
        log(f"--- {tokens} x {hidden} bf16 ({x.numel() * 2 / 2**20:.0f} MiB) ---")
        log(table_header())
        for op in specs:
            done += 1
            if op.run is None:
                row = {"op": op.name, "tokens": tokens, "hidden": hidden, "skipped": "not available"}
            else:
                try:
                    row = bench_op(op, x, cfg, refs.get(op.name))
                except Exception as e:  # noqa: BLE001 - one failing op must not end a long run
                    row = {"op": op.name, "tokens": tokens, "hidden": hidden, "error": f"{type(e).__name__}: {e}"}
                    log(f"ERROR {op.name} {tokens}x{hidden}: {row['error'][:300]}")
                    free_memory(device)
            result["rows"].append(row)
            save()
            log(f"{table_line(row)}   [{done}/{total}, {time.perf_counter() - t_start:.0f} s]")
        del x
        free_memory(device)

    rows = result["rows"]
    log(f"\n=== moe_fp4 kernels on {name} | torch {torch_version} | triton {triton_version} | {date} ===")
    log(table_header())
    for row in rows:
        log(table_line(row))
    bad = [r for r in rows if r.get("valid") is False]
    errors = [r for r in rows if "error" in r]
    log(f"\n{len(rows)} rows in {time.perf_counter() - t_start:.0f} s; {len(bad)} mismatches; {len(errors)} errors"
        + (f"; results in {a.json}" if a.json else ""))
    for r in bad:
        log(f"!!!!!!!! MISMATCH {r['op']} {r['tokens']}x{r['hidden']}: {'; '.join(r['mismatch'])}")
    save()
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
