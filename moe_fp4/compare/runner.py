""":func:`run`: the end-to-end comparison behind ``moe-fp4 compare``, one model trained in bf16, fp8 and fp4.

Each mode builds the same :class:`~moe_fp4.model.decoder.DecoderLM` (same seed: same initial weights,
same batches) and trains it for ``steps`` steps with AdamW (float32 master weights, bf16 compute,
global-norm clipping at 1, linear warmup then cosine decay). Measured per mode:

- step time: CUDA events around every step after ``warmup``, median (wall clock on CPU); tokens/s
  per GPU = batch * seq / step time, the slowest rank's under EP;
- peak memory: ``torch.cuda.max_memory_allocated`` over the whole run (largest rank);
- activation memory: what one forward keeps alive for backward. On CUDA the allocator's growth
  over the forward (logits and loss included); on CPU the bytes saved for backward
  (:func:`moe_fp4.saved.accounting.saved_bytes`, plus what the compression hook stored in the ``--hook`` run);
- all-to-all share: the NCCL send/recv kernels' time in a few profiled steps over the step time
  (EP only);
- loss: every step's training loss (averaged over ranks), and a held-out loss at the end.

Expert parallelism: under ``torchrun`` with more than one process every MoE layer is split over all
ranks (:class:`moe_fp4.exchange.ep.EPConfig`); the other parameters are replicated and their gradients
averaged (data parallel over the same ranks), each rank draws its own batches.

``max_batch_gib``: for each mode, the exact largest batch (sequences per rank) whose step peaks
within that budget (per device): :func:`~moe_fp4.compare.memory.largest_batch`, every candidate
measured by one probe step from a freshly built model; the timed run then uses each mode's own
largest batch. ``recompute``: every mode's recomputation policy. ``plan`` (with ``budget_gib`` and
``global_batch``): per mode, :func:`~moe_fp4.compare.memory.plan_mode` chooses the policy and micro-batch
with the highest measured tokens/s in the budget; the report keeps every candidate under "plans".

Before any of it: the packages the run needs, its cost and whether its weights and optimizer state fit
(:mod:`moe_fp4.compare.preflight`). The training is in :mod:`~moe_fp4.compare.train`, the budgets in
:mod:`~moe_fp4.compare.memory`, the printed text in :mod:`~moe_fp4.compare.report`.

The names this module held before it was split are imported here too, so that code written
against ``moe_fp4.compare.runner`` keeps working; their homes are the modules above.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, replace

import torch

from moe_fp4.compare.config import (
    MODES,
    BatchDoesNotFit,
    CompareConfig,
    Env,
    GiB,
    check_ep,
    per_rank_batch,
)
from moe_fp4.compare.data import stdlib_corpus
from moe_fp4.compare.memory import (
    gib_digits,
    largest_accumulated_batch,
    largest_batch,
    measure_steps,
    plan_mode,
    probe_verdict,
    step_bytes,
)
from moe_fp4.compare.origin import describe
from moe_fp4.compare.preflight import check_fits, cost_lines, estimate, require_packages
from moe_fp4.compare.quiet import quiet_third_party
from moe_fp4.compare.report import (
    CPU_NOTE,
    banner_lines,
    done_line,
    mode_line,
    plan_table,
    ranks_legend,
    ratios,
    table,
)
from moe_fp4.compare.train import (
    Trainer,
    _free,
    _quiet,
    train_mode,
)
from moe_fp4.exchange.grad_rule import next_format_up
from moe_fp4.formats.conversions import conversion_path
from moe_fp4.model.decoder import DecoderLM, parameter_count
from moe_fp4.model.planner import (
    NothingFits,
    micro_batch,
    search_largest_batch,
)


def wire_meta(env: Env, modes) -> dict | None:
    """What each exchange sends under expert parallelism (None without): per mode, the format of each
    role (EPConfig.wire: the recipe, or the mode's default one on the group's link, with the roles set in
    its place); the link the defaults followed ("peer" | "network": EPConfig.wire_link, detected over the
    ranks, so every rank calls this); "auto" with the sqrt(3) rule's settings."""
    if env.ep is None:
        return None
    given = env.ep.recipe
    wire = {"recipe": dict(given) if isinstance(given, tuple) else given,
            "per_mode": {m: env.ep.wire(m).as_dict() for m in modes if m in MODES}, "simulated": env.ep.simulate,
            "link": env.ep.wire_link().value}
    if env.ep.grad_rules():
        fallback = env.ep.auto_fallback or next_format_up(env.ep.auto_format)
        wire["auto"] = {"format": env.ep.auto_format.value, "patience": env.ep.auto_patience,
                        "fallback": fallback.value}
    return wire


def run(cfg: CompareConfig, env: Env, log=print) -> dict:
    """Run every mode (and the largest-batch search with ``max_batch_gib``) -> the report dict that
    ``moe-fp4 compare`` prints and writes as JSON. Raises ValueError (one line) before any work for a
    missing package, an EP world that does not divide the experts, or a model whose weights and
    optimizer state do not fit the device."""
    mc = cfg.model
    if env.world > 1:
        if cfg.hook:
            raise ValueError("--hook compares a Hugging Face model on one device; run it without torchrun")
        check_ep(mc, env.world)
    if cfg.global_batch is not None:
        per_rank_batch(cfg.global_batch, env.world)   # fails now, not after the searches
    require_packages(cfg)
    counts = parameter_count(DecoderLM(mc.with_(), precision="bf16", device="meta"))
    cost = estimate(cfg, env, counts)
    check_fits(cost, cfg, env)
    with quiet_third_party():
        return _run(cfg, env, log, counts, cost)


def _run(cfg: CompareConfig, env: Env, log, counts: dict, cost) -> dict:
    mc = cfg.model
    quiet = log if env.lead else _quiet
    t0 = time.perf_counter()
    corpus = stdlib_corpus() if cfg.data == "stdlib" else None
    meta = describe(env)
    meta["optimizer"] = cfg.optimizer
    wire = wire_meta(env, cfg.modes)
    if wire is not None:
        meta["wire"] = wire
    report = {"meta": meta, "config": {**asdict(cfg), "model": asdict(mc)}, "notes": [], "modes": {},
              "max_batch": {}}
    if not env.cuda:
        report["notes"].append(CPU_NOTE.format(path=conversion_path(env.device)))
    if ranks_legend(env.world):
        report["notes"].append(ranks_legend(env.world))
    if corpus is not None:
        meta["data"] = (f"stdlib: {corpus.files} Python source files, {corpus.train.numel() / 2**20:.1f} MiB train, "
                        f"{corpus.held_out.numel() / 2**20:.1f} MiB held out, byte tokens")
    for line in banner_lines(cfg, mc, meta, None if cfg.hook else counts, env.world) + cost_lines(cost, cfg, env):
        quiet(line, flush=True)
    for n in report["notes"]:
        quiet("  note: " + n, flush=True)
    report["failed"] = {}
    with _signals_as_interrupts():
        try:
            batch, micro, policy = _batches_per_mode(cfg, env, corpus, report, quiet)
            for m in cfg.modes:
                if m in report["failed"]:
                    continue
                _train_one(cfg, m, env, corpus, report, batch[m], micro[m], policy[m], wire, quiet)
        except Interrupted as e:
            # Nothing lost: the modes done so far are reported and written.
            report["interrupted"] = str(e)
            quiet(f"interrupted ({e}): the modes done so far are reported", flush=True)
    if not report["modes"] and report["failed"] and "interrupted" not in report:
        raise BatchDoesNotFit(next(iter(report["failed"].values())))
    report["ratios"] = ratios(report["modes"], "hf" if cfg.hook else "fp8")
    report["wall_s"] = time.perf_counter() - t0
    return report


class Interrupted(Exception):
    """SIGTERM or SIGINT while compare runs (a kill that can be caught): the run stops and reports what it has."""


class _signals_as_interrupts:
    """Inside: SIGTERM and SIGINT raise :class:`Interrupted` (main thread only; elsewhere nothing changes)."""

    def __enter__(self):
        import signal
        import threading

        from moe_fp4.compare.interrupts import raise_if_pending

        raise_if_pending()   # a Ctrl-C during the imports whose KeyboardInterrupt a library swallowed
        self.old = {}
        if threading.current_thread() is threading.main_thread():
            def handler(signum, _frame):
                raise Interrupted(signal.Signals(signum).name)

            for sig in (signal.SIGTERM, signal.SIGINT):
                self.old[sig] = signal.signal(sig, handler)
        return self

    def __exit__(self, *exc):
        import signal

        for sig, old in self.old.items():
            signal.signal(sig, old)
        return False


def _train_one(cfg: CompareConfig, m: str, env: Env, corpus, report: dict, batch: int, micro, policy, wire,
               quiet) -> None:
    """Train mode ``m`` into report["modes"], or name its failure in report["failed"] (out of memory, or a
    one-line ValueError) and go on with the next mode."""
    mc = cfg.model
    quiet(mode_line(m, cfg.steps, batch, mc.seq, micro, policy, cfg.storage, wire), flush=True)
    try:
        row = train_mode(replace(cfg, recompute=policy, plan=False), m, env, corpus, batch, quiet, micro_batch=micro)
    except torch.OutOfMemoryError:
        _free(env)
        why = (f"batch {batch} x {mc.seq} does not fit on {report['meta']['device']} in mode {m} (out of memory). "
               f"Lower --batch, or find the largest with --max-batch GIB")
        report["failed"][m] = why
        quiet(f"  {m} failed: {why}", flush=True)
        return
    except ValueError as e:
        _free(env)
        report["failed"][m] = str(e)
        quiet(f"  {m} failed: {e}", flush=True)
        return
    report["modes"][m] = row
    budget = cfg.max_batch_gib if cfg.max_batch_gib is not None else cfg.budget_gib
    row["recompute"] = policy
    if m == "fp4":
        row["storage"] = cfg.storage
    peak = row["peak_bytes"]
    if budget is not None and peak is not None and peak > budget * GiB:
        report["notes"].append(f"{m}: the training run peaked at {peak / GiB:.2f} GiB, above the {budget:g} GiB "
                               f"budget its batch was chosen for")
    quiet("  " + done_line(row, env.world), flush=True)


def _probes(found: dict) -> str:
    return ", ".join(f"{k}: {gib_digits(v) + ' GiB' if math.isfinite(v) else 'out of memory'}"
                     for k, v in found["probe"].items())


def _batches_per_mode(cfg: CompareConfig, env: Env, corpus, report: dict, log) -> tuple[dict, dict, dict]:
    """Each mode's batch per rank, micro-batch (None: one pass) and recomputation policy: as given, or
    planned (``plan``), checked against ``budget_gib``, or searched (``max_batch_gib``). Fills the
    report's "plans" and "max_batch"."""
    mc = cfg.model
    batch = {m: cfg.batch for m in cfg.modes}
    policy = {m: cfg.recompute for m in cfg.modes}
    micro = {m: None for m in cfg.modes}
    if cfg.plan:
        per_rank = per_rank_batch(cfg.global_batch, env.world)
        report["plans"] = {}
        for m in cfg.modes:
            log(f"[{m}] planning {per_rank} sequences per rank per step in {cfg.budget_gib:g} GiB per device",
                flush=True)
            try:
                chosen = plan_mode(cfg, m, env, corpus, per_rank, log)
            except NothingFits as e:
                # This mode is not trained; the others are planned and trained (nothing lost).
                report["failed"][m] = f"mode {m}: {e}"
                log(f"  {m} failed: {report['failed'][m]}", flush=True)
                continue
            report["plans"][m] = asdict(chosen)
            log("  " + plan_table(report["plans"][m]).replace("\n", "\n  "), flush=True)
            batch[m], micro[m], policy[m] = per_rank, chosen.micro_batch, chosen.policy
    elif cfg.budget_gib is not None and cfg.max_batch_gib is None:
        budget = cfg.budget_gib * GiB
        for m in cfg.modes:
            fit = step_bytes(cfg, m, env, corpus, [max(1, cfg.batch // 2), cfg.batch])[cfg.batch]
            if fit > budget:
                needs = f"needs {gib_digits(fit)} GiB" if math.isfinite(fit) else "runs out of memory"
                # On CPU --max-batch is refused unless --allow-cpu-budget: advise what runs here.
                search = f"--max-batch {cfg.budget_gib:g}" + ("" if env.cuda else " --allow-cpu-budget")
                raise BatchDoesNotFit(
                    f"batch {cfg.batch} x {mc.seq} does not fit in {cfg.budget_gib:g} GiB per device in mode {m}: "
                    f"one step {needs}{'' if env.cuda else ' (estimated on CPU)'}. Lower --batch, or find the "
                    f"largest with {search}")
            log(f"[{m}] batch {cfg.batch} x {mc.seq}: {probe_verdict(fit, budget)}", flush=True)
    if cfg.max_batch_gib is not None:
        budget = cfg.max_batch_gib * GiB
        for m in cfg.modes:
            log(f"[{m}] largest batch in {cfg.max_batch_gib:g} GiB per device", flush=True)
            # With a global batch the micro-batch must fit an accumulated step: a later pass holds the
            # earlier passes' gradients, so it peaks above the first, unless the rank's whole batch
            # fits in one pass (which that search, on the two-pass curve, would not see).
            if cfg.global_batch is not None:
                found = largest_accumulated_batch(cfg, m, env, corpus, budget,
                                                  per_rank_batch(cfg.global_batch, env.world), log)
            else:
                found = largest_batch(cfg, m, env, corpus, budget, log)
            report["max_batch"][m] = found
            if found["batch_max"] == 0:
                # This mode is not trained; the others are (nothing lost).
                report["failed"][m] = (f"mode {m}: not even one sequence of {mc.seq} fits in "
                                       f"{cfg.max_batch_gib:g} GiB per device (probes: {_probes(found)})")
                log(f"  {m} failed: {report['failed'][m]}", flush=True)
                continue
            batch[m] = found["batch_max"]
    if cfg.global_batch is not None and not cfg.plan:
        per_rank = per_rank_batch(cfg.global_batch, env.world)
        for m in cfg.modes:
            micro[m] = micro_batch(per_rank, batch[m])
            batch[m] = per_rank
    return batch, micro, policy


__all__ = ["BatchDoesNotFit", "CompareConfig", "Env", "Trainer", "check_ep", "largest_batch", "measure_steps",
           "micro_batch", "per_rank_batch", "plan_mode", "ratios", "run", "search_largest_batch", "table",
           "train_mode", "wire_meta"]
