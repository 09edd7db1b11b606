"""MoE layer forward+backward, bf16 vs fp8 vs fp4: step time, memory, largest batch in a memory budget.

One ``moe_fp4.model.moe.MoE`` per config; its precision is switched between bf16, fp8 (FP8 GEMMs,
DeepSeek-V3 storage: the baseline) and fp4 (FP8 GEMMs, MXFP4 saved activations), so every precision
runs the same weights on the same input. Routing: random router weights, tokens N(0,1) bf16, so
tokens per expert are roughly balanced; each step routes its own input.

    python bench/moe_layer.py                                 # GPU: dsv3 and small; CPU: a tiny smoke run
    python bench/moe_layer.py --config dsv3 --json moe_layer.json
    python bench/moe_layer.py --config small --tokens 16384 --precisions fp8 fp4 --no-budget
    python bench/moe_layer.py --config dsv3 --no-budget --optimizer     # training steps, with AdamW

Method (CUDA). check: one fwd+bwd per precision; SQNR (moe_fp4.formats.metrics.sqnr_db) of the output y and
the input gradient dx vs bf16; fp8 and fp4 outputs must be equal (same FP8 operands). step: y =
m(x); y.backward(g) with a fixed random bf16 g; grads set to None before each step and the weights'
versions bumped (as an optimizer step would: the FP8 weight copies are made again every step); CUDA events
around each step; median and min of --iters after --warmup, the precisions taking turns in --rounds rounds
(order rotated each round: the step time drifts within a process, and one precision after the other
would charge the drift to the later ones); the kernel counts (torch.profiler) after all timing. With
--optimizer the timed unit is a training step instead, with no version bumps: fwd + bwd + AdamW, bf16 on
torch's fused AdamW, fp8 and fp4 on moe_fp4.model.optim.AdamWFP8Weights (which writes the FP8 weight pairs
the next forward reads); the step-time targets (set for fwd + bwd) then judge nothing.

Memory: after a step that allocates the grads (kept, so weights, weight grads, x, x.grad and g are the
baseline), one more step under ``moe_fp4.saved.accounting.saved_bytes``: act = allocated after forward
(the output y, [T, H] bf16, included) - baseline; peak+ = max_memory_allocated over fwd+bwd - baseline.
Budget: peak+ at --tokens and 2x --tokens, fit peak+(T) = a + b*T, T_max = (budget - a)/b rounded down
to a multiple of 128, then one
step at T_max checks peak+ <= budget. On CPU the Triton kernels run in the interpreter and the FP8
GEMMs are emulated in float32: a smoke run of the code paths (tiny shape, wall clock, no memory
numbers, no budget search), not a measurement.

Columns: step_ms / min_ms = median / fastest fwd+bwd step; tok/s = tokens / median step; act_MiB =
memory held after forward; peak+_MiB = peak over the step above the baseline; peak_MiB = absolute
max_memory_allocated; saved_MiB = everything saved for backward (saved_bytes total: expert
activations, FP8 weight copies, router/permutation tensors; parameters excluded); expert_MiB = the
expert activations (fc1_input + swiglu_input + fc2_input); T_max = tokens predicted to fit the
budget; fits = whether the step at T_max stayed within it.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")       # before moe_fp4 imports triton

from moe_fp4.formats.conversions import conversion_path  # noqa: E402
from moe_fp4.formats.metrics import sqnr_db  # noqa: E402
from moe_fp4.model.moe import MoE, MoEConfig  # noqa: E402
from moe_fp4.saved.accounting import saved_bytes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/, also under python -P
from harness import interleaved, log, run_record, sync, write_json  # noqa: E402

CONFIGS = {  # name: (MoEConfig without shared_ffn, default tokens)
    "dsv3": (dict(hidden=7168, ffn=2048, num_experts=32, top_k=8), 4096),
    "small": (dict(hidden=2048, ffn=1408, num_experts=64, top_k=6), 8192),
    "smoke": (dict(hidden=256, ffn=128, num_experts=2, top_k=2), 64),   # E 2: the Triton interpreter is slow
}
PRECISIONS = ["bf16", "fp8", "fp4"]
EXPERT_ACTS = ("fc1_input", "swiglu_input", "fc2_input")
ALIGN = 128
MIB, GIB = 2 ** 20, 2 ** 30


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ measurements

def make_inputs(tokens: int, hidden: int, device: torch.device, seed: int):
    """x bf16 [T, H] N(0,1) (a leaf that wants its gradient) and a fixed output gradient g."""
    gen = torch.Generator(device=device).manual_seed(seed * 1000003 + tokens)
    x = torch.randn(tokens, hidden, generator=gen, device=device, dtype=torch.bfloat16).requires_grad_(True)
    g = torch.randn(tokens, hidden, generator=gen, device=device, dtype=torch.bfloat16)
    return x, g


def zero(m: MoE, x: torch.Tensor) -> None:
    m.zero_grad(set_to_none=True)
    x.grad = None


def step(m: MoE, x: torch.Tensor, g: torch.Tensor, opt: torch.optim.Optimizer | None = None) -> None:
    if opt is None:
        # An optimizer would change the weights between two steps: bump their versions (no data touched)
        # so that the FP8 weight cache (moe_fp4.gemm.engines.FP8_WEIGHTS) quantizes them again, as in training.
        for p in m.parameters():
            torch.autograd.graph.increment_version(p)
        m(x).backward(g)
    else:
        # --optimizer: a training step; the optimizer changes the weights (AdamWFP8Weights also writes
        # the FP8 pairs the next forward reads).
        m(x).backward(g)
        opt.step()


def optimizers(m: MoE, precisions: list[str]) -> dict[str, torch.optim.Optimizer]:
    """--optimizer: torch's fused AdamW for bf16 (its fastest), moe_fp4.model.optim.AdamWFP8Weights (fused for
    the rest) for fp8 and fp4, which share it. A small learning rate: the weights stay near their start."""
    from moe_fp4.model.optim import AdamWFP8Weights

    hp = dict(lr=1e-6, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    ours = AdamWFP8Weights(m.parameters(), **hp) if any(p != "bf16" for p in precisions) else None
    return {p: torch.optim.AdamW(m.parameters(), **hp) if p == "bf16" else ours for p in precisions}


def check(m: MoE, x: torch.Tensor, g: torch.Tensor) -> dict:
    """fp8 and fp4 output and input gradient vs bf16 (SQNR dB); whether fp4's output equals fp8's."""
    out = {}
    for p in PRECISIONS:
        m.precision = p
        zero(m, x)
        y = m(x)
        y.backward(g)
        out[p] = (y.detach(), x.grad)
    zero(m, x)
    res = {"fp4_y_equals_fp8_y": torch.equal(out["fp8"][0], out["fp4"][0]),
           "fp4_vs_fp8_dx_sqnr_db": sqnr_db(out["fp8"][1], out["fp4"][1])}
    for p in ("fp8", "fp4"):
        res[f"{p}_y_sqnr_db"] = sqnr_db(out["bf16"][0], out[p][0])
        res[f"{p}_dx_sqnr_db"] = sqnr_db(out["bf16"][1], out[p][1])
    return res


def time_interleaved(m: MoE, precisions: list[str], x: torch.Tensor, g: torch.Tensor, warmup: int, iters: int,
                     rounds: int, device: torch.device, opts: dict | None = None) -> dict[str, list[list[float]]]:
    """The precisions' timed steps in ``rounds`` rotated rounds (harness.interleaved) -> {precision:
    [seconds of its steps, one list per round]}.

    Why not one precision after the other: in one process the step time drifts (bench/RESULTS.md), so
    whichever precision ran later would pay for it; rotated rounds give every precision every position
    equally often. Each precision takes ``warmup`` untimed steps before its first round and one whenever
    it takes its turn (with ``opts``, {precision: optimizer}: that step also remakes the FP8 pairs another
    optimizer's step left stale). Every step (fwd + bwd, with ``opts``: + its optimizer's step) is timed
    from an idle GPU (CUDA events; wall clock on CPU), the grads set to None before it, untimed."""
    opts = opts or {}

    def enter(p: str) -> None:
        m.precision = p

    runs = {p: (lambda p=p: step(m, x, g, opts.get(p))) for p in precisions}
    got = interleaved(runs, warmup, iters, rounds, before=lambda: zero(m, x), enter=enter, device=device)
    zero(m, x)
    return {p: [[t * 1e-3 for t in r] for r in v] for p, v in got.items()}


def memory(m: MoE, x: torch.Tensor, g: torch.Tensor, device: torch.device) -> dict:
    """One step to allocate grads (kept; CUDA only), then one measured step under saved_bytes."""
    cuda = device.type == "cuda"
    zero(m, x)
    if cuda:
        step(m, x, g)
        sync(device)
    base = torch.cuda.memory_allocated(device) if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    y, rep = saved_bytes(m, x)
    sync(device)
    after_fwd = torch.cuda.memory_allocated(device) if cuda else None
    y.backward(g)
    del y
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    zero(m, x)
    return {"baseline_bytes": base, "act_bytes": after_fwd - base if cuda else None,
            "peak_inc_bytes": peak - base if cuda else None, "peak_bytes": peak,
            "saved_total_bytes": rep.total, "saved_expert_act_bytes": rep.labelled(*EXPERT_ACTS),
            "saved_by_label": rep.bytes_by("label")}


def budget_search(m: MoE, first: tuple[int, int], budget: int, device: torch.device, seed: int) -> dict:
    """Fit peak+(T) = a + b*T from (tokens, peak+) and a step at 2x tokens; verify one step at T_max."""
    t1, p1 = first
    t2 = 2 * t1
    x, g = make_inputs(t2, m.config.hidden, device, seed)
    p2 = memory(m, x, g, device)["peak_inc_bytes"]
    del x, g
    free(device)
    b = (p2 - p1) / (t2 - t1)
    a = p1 - b * t1
    res = {"points": [[t1, p1], [t2, p2]], "a_bytes": a, "b_bytes_per_token": b, "budget_bytes": budget}
    t_max = res["t_max"] = max(0, int((budget - a) / b) // ALIGN * ALIGN) if b > 0 else 0
    if t_max <= 0:
        res.update(fits=False, error="budget below the fitted intercept")
        return res
    log(f"    budget {budget / GIB:.1f} GiB: peak+ = {a / MIB:.0f} MiB + {b / 1024:.1f} KiB/token -> "
        f"T_max {t_max}; verifying")
    x = g = None
    try:
        x, g = make_inputs(t_max, m.config.hidden, device, seed)
        peak_inc = memory(m, x, g, device)["peak_inc_bytes"]
        res.update(verified_peak_inc_bytes=peak_inc, fits=peak_inc <= budget)
    except torch.cuda.OutOfMemoryError:
        res.update(fits=False, error="OOM")
    log(f"    T_max {t_max}: " + (f"peak+ {res['verified_peak_inc_bytes'] / GIB:.2f} GiB, fits: {res['fits']}"
                                 if "error" not in res else res["error"]))
    del x, g
    m.zero_grad(set_to_none=True)
    free(device)
    return res


def gemm_flop(m: MoE, tokens: int) -> int:
    """Useful GEMM work of one routed fwd+bwd step: per (token, expert) pair, FC1 (2 * H * 2F) and FC2
    (2 * F * H) forward, twice that backward (dgrad + wgrad): 18 H F. Padding rows and the shared
    expert are not counted."""
    c = m.config
    return 18 * c.hidden * c.ffn * tokens * c.top_k


def launches(m: MoE, x: torch.Tensor, g: torch.Tensor, device: torch.device,
             opt: torch.optim.Optimizer | None = None) -> dict:
    """Kernels and memcpy/memset operations one fwd+bwd step (with ``opt``: + its step) puts on the GPU
    (torch.profiler)."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    zero(m, x)
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(m, x, g, opt)
        sync(device)
    kernels = copies = 0
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if evt.name.startswith(("Memcpy", "Memset")):
            copies += 1
        else:
            kernels += 1
    zero(m, x)
    return {"kernels_per_step": kernels, "copies_per_step": copies}


def bench_memory(m: MoE, p: str, x, g, a: argparse.Namespace, device: torch.device) -> dict:
    """One precision's memory row (and its T_max search); the step times come later, interleaved."""
    m.precision = p
    row: dict = {"precision": p, "tokens": x.shape[0]}
    row.update(memory(m, x, g, device))
    if not a.no_budget and device.type == "cuda":
        free(device)
        row["budget"] = budget_search(m, (x.shape[0], row["peak_inc_bytes"]), int(a.budget_gib * GIB),
                                      device, a.seed)
    return row


def add_times(m: MoE, row: dict, rounds: list[list[float]]) -> None:
    times = [t for r in rounds for t in r]
    row["step_s_median"], row["step_s_min"] = statistics.median(times), min(times)
    row["step_s_round_medians"] = [statistics.median(r) for r in rounds]
    row["tokens_per_s"] = row["tokens"] / row["step_s_median"]
    row["gemm_tflops"] = gemm_flop(m, row["tokens"]) / row["step_s_median"] / 1e12


# ------------------------------------------------------------------------------------ output

COLUMNS = [("config", 6), ("prec", 4), ("tokens", 6), ("step_ms", 9), ("min_ms", 9), ("tok/s", 10),
           ("TFLOP/s", 7), ("kernels", 7), ("act_MiB", 8), ("peak+_MiB", 9), ("peak_MiB", 9), ("saved_MiB", 9),
           ("expert_MiB", 10),
           ("T_max", 7), ("fits", 5)]


def _cells(cells) -> str:
    """The config and precision columns left-aligned, the rest right-aligned."""
    return " ".join(f"{str(c):<{w}}" if i < 2 else f"{str(c):>{w}}"
                    for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS)))


def _mib(v) -> str:
    return "n/a" if v is None else f"{v / MIB:.1f}"


def table_line(config: str, r: dict) -> str:
    if "error" in r:
        return _cells([config, r["precision"], r.get("tokens", "-")] + ["-"] * 11 + [r["error"][:40]])
    bud = r.get("budget") or {}
    fits = {True: "yes", False: bud.get("error", "no")}.get(bud.get("fits"), "-")
    return _cells([config, r["precision"], r["tokens"], f"{r['step_s_median'] * 1e3:.3f}",
                   f"{r['step_s_min'] * 1e3:.3f}", f"{r['tokens_per_s']:.0f}", f"{r['gemm_tflops']:.0f}",
                   r.get("kernels_per_step", "-"), _mib(r["act_bytes"]),
                   _mib(r["peak_inc_bytes"]), _mib(r["peak_bytes"]), _mib(r["saved_total_bytes"]),
                   _mib(r["saved_expert_act_bytes"]), bud.get("t_max", "-"), fits])


def _target(name: str, value, op: str | None = None, threshold: float = 0.0) -> dict:
    met = None if value is None or op is None else value <= threshold if op == "<=" else value >= threshold
    return {"name": name, "value": value, "target": f"{op} {threshold:g}" if op else None, "met": met}


# Targets per config: fp8 step / bf16 step, fp4 step / fp8 step (the grouped-GEMM engine's), GEMM
# TFLOP/s (the expert layer's).
STEP_TARGETS = {"dsv3": (0.80, 1.00, 600.0), "small": (0.95, None, None)}
ACT_SAVING_TARGET = 0.45       # fp4 activation memory at least this far below fp8's
T_MAX_TARGET = 1.4


def ratios(rows: dict, judge: bool = True, config: str = "dsv3", train: bool = False) -> list[dict]:
    """Step-time ratios (fp8/bf16, fp4/fp8, fp4/bf16), GEMM throughput and memory savings against the
    targets of ``config`` (none for configs without targets); judge=False (CPU smoke): no verdicts.
    train (--optimizer): the step times are training steps, which the step-time targets (set for
    forward + backward) do not judge."""
    def get(p, key):
        v = rows.get(p, {})
        for k in key.split("."):
            v = v.get(k) if isinstance(v, dict) else None
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    def ratio(p, key, base="fp8", saving=False):
        num, den = get(p, key), get(base, key)
        return None if num is None or not den else 1 - num / den if saving else num / den

    fp8_bf16, fp4_fp8, tflops = STEP_TARGETS.get(config, (None, None, None)) if not train else (None, None, None)
    what = "training step time" if train else "step time"
    out = [_target(f"{what} fp8/bf16", ratio("fp8", "step_s_median", "bf16"), fp8_bf16 and "<=", fp8_bf16 or 0),
           _target(f"{what} fp4/fp8", ratio("fp4", "step_s_median"), fp4_fp8 and "<=", fp4_fp8 or 0),
           _target(f"{what} fp4/bf16", ratio("fp4", "step_s_median", "bf16"),
                   "<=" if config == "small" and not train else None, 1.0)]
    for p in ("fp8", "fp4"):
        out.append(_target(f"GEMM TFLOP/s {p}", get(p, "gemm_tflops"), tflops and ">=", tflops or 0))
    t_max = ratio("fp4", "budget.t_max")
    verified = t_max is None or all((rows.get(q, {}).get("budget") or {}).get("fits") for q in ("fp4", "fp8"))
    out += [_target("activation memory 1 - fp4/fp8", ratio("fp4", "act_bytes", saving=True), ">=", ACT_SAVING_TARGET),
            _target("saved_bytes total 1 - fp4/fp8", ratio("fp4", "saved_total_bytes", saving=True)),
            _target("saved expert activations 1 - fp4/fp8", ratio("fp4", "saved_expert_act_bytes", saving=True)),
            _target("T_max fp4/fp8" + ("" if verified else " (not both fit)"), t_max, ">=", T_MAX_TARGET),
            _target("kernels per step fp4", get("fp4", "kernels_per_step"), "<=" if config == "dsv3" else None, 60)]
    return out if judge else [{**r, "met": None} for r in out]


def ratio_line(r: dict) -> str:
    v = "n/a" if r["value"] is None else f"{r['value']:.3f}"
    verdict = "" if r["target"] is None else ("n/a" if r["met"] is None else "met" if r["met"] else "missed")
    target = f"target {r['target']}" if r["target"] else "(reference)"
    return f"  {r['name']:<44} {v:>8}  {target:<16} {verdict}".rstrip()


# -------------------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--config", nargs="+", choices=list(CONFIGS), default=None,
                   help="shapes (default: dsv3 small on GPU, smoke on CPU)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per step (default: the config's)")
    p.add_argument("--iters", type=int, default=None, help="timed steps (default 20; CPU 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; CPU 0)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds the timed steps are split into, the precisions' order rotated each round "
                        "(default 5; CPU 1)")
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=PRECISIONS)
    p.add_argument("--budget-gib", type=float, default=40.0, help="memory budget for T_max (default 40)")
    p.add_argument("--no-budget", action="store_true", help="skip the T_max search (always skipped on CPU)")
    p.add_argument("--shared-ffn", type=int, default=0, help="shared expert width (default 0: none)")
    p.add_argument("--optimizer", action="store_true",
                   help="time training steps: fwd + bwd + AdamW (bf16: torch's fused AdamW; fp8 / fp4: "
                        "moe_fp4.model.optim.AdamWFP8Weights, whose step writes the FP8 weights); "
                        "memory stays fwd + bwd")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here (rewritten as it goes)")
    a = p.parse_args(argv)
    cpu = not torch.cuda.is_available()
    a.config = a.config or (["smoke"] if cpu else ["dsv3", "small"])
    a.iters = a.iters if a.iters is not None else 1 if cpu else 20
    a.warmup = a.warmup if a.warmup is not None else 0 if cpu else 3
    a.rounds = a.rounds if a.rounds is not None else 1 if cpu else 5
    if a.rounds < 1 or a.iters < 1:
        p.error(f"--rounds and --iters must be >= 1, got {a.rounds} and {a.iters}")
    return a


def run_config(name: str, a: argparse.Namespace, device: torch.device, result: dict, save) -> None:
    shape, default_tokens = CONFIGS[name]
    cfg = MoEConfig(**shape, shared_ffn=a.shared_ffn)
    tokens = a.tokens or default_tokens
    entry = {"config": name, **shape, "shared_ffn": a.shared_ffn, "tokens": tokens, "rows": [], "ratios": []}
    result["configs"].append(entry)
    log(f"\n--- {name}: H {cfg.hidden}, F {cfg.ffn}, E {cfg.num_experts}, top-{cfg.top_k}, shared_ffn "
        f"{cfg.shared_ffn}, {tokens} tokens ---")
    torch.manual_seed(a.seed)
    try:
        m = MoE(cfg, precision="fp8", dtype=torch.bfloat16, device=device)
        x, g = make_inputs(tokens, cfg.hidden, device, a.seed)
    except torch.cuda.OutOfMemoryError:
        entry["error"] = "OOM building the layer or its input"
        log(f"  ERROR {name}: {entry['error']}")
        free(device)
        return
    try:
        c = entry["check"] = check(m, x, g)
        log(f"  check vs bf16: fp8 y {c['fp8_y_sqnr_db']:.2f} dB, dx {c['fp8_dx_sqnr_db']:.2f} dB | fp4 y "
            f"{c['fp4_y_sqnr_db']:.2f} dB, dx {c['fp4_dx_sqnr_db']:.2f} dB | fp4 dx vs fp8 "
            f"{c['fp4_vs_fp8_dx_sqnr_db']:.2f} dB | fp4 y == fp8 y: {'yes' if c['fp4_y_equals_fp8_y'] else 'NO'}")
    except Exception as e:  # noqa: BLE001 - report and go on to the measurements
        entry["check"] = {"error": f"{type(e).__name__}: {e}"}
        log(f"  check FAILED: {entry['check']['error'][:300]}")
        zero(m, x)
    free(device)
    rows: dict[str, dict] = {}
    for p in a.precisions:
        log(f"  {name} {p}: memory"
            + ("" if a.no_budget or device.type != "cuda" else f", T_max in {a.budget_gib:g} GiB"))
        try:
            row = bench_memory(m, p, x, g, a, device)
            labels = ", ".join(f"{k} {v / MIB:.2f}" for k, v in row["saved_by_label"].items())
            log(f"    saved_bytes by label (MiB): {labels}")
        except torch.cuda.OutOfMemoryError:
            row = {"precision": p, "tokens": tokens, "error": "OOM"}
        except Exception as e:  # noqa: BLE001 - one failing precision must not end the run
            row = {"precision": p, "tokens": tokens, "error": f"{type(e).__name__}: {e}"}
        if "error" in row:
            log(f"    ERROR {name} {p}: {row['error'][:300]}")
        zero(m, x)
        free(device)
        rows[p] = row
    timed_ps = [p for p in a.precisions if "error" not in rows[p]]
    opts = optimizers(m, timed_ps) if a.optimizer else {}
    log(f"  {name}: {a.warmup} warmup + {a.iters} timed {'training ' if a.optimizer else ''}steps each, in "
        f"{a.rounds} rounds of {' / '.join(timed_ps)} (order rotated each round)"
        + (": fwd + bwd + AdamW (bf16: torch's fused AdamW; fp8 / fp4: AdamWFP8Weights)" if a.optimizer else ""))
    try:
        for p, rounds in time_interleaved(m, timed_ps, x, g, a.warmup, a.iters, a.rounds, device, opts).items():
            add_times(m, rows[p], rounds)
    except Exception as e:  # noqa: BLE001 - report the failure in every row that was to be timed
        for p in timed_ps:
            rows[p]["error"] = f"timing: {type(e).__name__}: {e}"
        log(f"    ERROR {name} timing: {type(e).__name__}: {str(e)[:300]}")
    zero(m, x)
    free(device)
    # Last: torch.profiler leaves CUPTI attached after its session (pytorch issue 144455), which would
    # slow every step timed after it.
    for p in timed_ps:
        if "error" not in rows[p]:
            m.precision = p
            if opts:   # an untimed step first: the FP8 pairs another optimizer's step left stale
                zero(m, x)
                step(m, x, g, opts[p])
            rows[p].update(launches(m, x, g, device, opts.get(p)))
    opts = None
    log(_cells([n for n, _ in COLUMNS]))
    for p in a.precisions:
        entry["rows"].append(rows[p])
        log(table_line(name, rows[p]))
    save()
    entry["ratios"] = ratios({r["precision"]: r for r in entry["rows"] if "error" not in r}, device.type == "cuda",
                             name, train=a.optimizer)
    del m, x, g
    free(device)
    save()


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {**run_record(device), "iters": a.iters, "warmup": a.warmup, "rounds": a.rounds, "optimizer": a.optimizer,
              "budget_gib": a.budget_gib, "seed": a.seed, "configs": []}
    what = "training step (fwd+bwd+AdamW)" if a.optimizer else "fwd+bwd"
    log(f"moe_fp4 {result['moe_fp4']} MoE layer {what} | device: {result['device']} | torch {result['torch']} "
        f"| triton {result['triton']} | commit {result['commit']} | {result['date']}")
    log(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    if device.type == "cpu":
        log(f"CPU SMOKE RUN: conversions by {conversion_path(device)}, FP8 GEMMs emulated in float32, wall-clock "
            "timing, no memory numbers. Exercises the code paths; it is not a measurement.")

    def save():
        write_json(a.json, result)

    t0 = time.perf_counter()
    for name in a.config:
        run_config(name, a, device, result, save)
    log(f"\n=== MoE layer {what} on {result['device']} | torch {result['torch']} | triton {result['triton']} "
        f"| commit {result['commit']} ===")
    log(_cells([n for n, _ in COLUMNS]))
    for entry in result["configs"]:
        for row in entry["rows"]:
            log(table_line(entry["config"], row))
    for entry in result["configs"]:
        log(f"\n{entry['config']} ratios:")
        for r in entry["ratios"]:
            log(ratio_line(r))
    log(f"\ndone in {time.perf_counter() - t0:.1f} s" + (f"; results in {a.json}" if a.json else "")
        + ("  [CPU smoke run: not a measurement]" if device.type == "cpu" else ""))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
