"""Memory into speed: choose the (micro-batch, recomputation policy) with the highest measured tokens/s
that fits a memory budget. ``moe_fp4.plan`` for any model; ``moe-fp4 compare --plan auto``
runs the same choice per precision mode.

The rule, per policy in order of cost (none, swiglu, moe, layer: each recomputes more than the one
before, so it fits at least as large a micro-batch):

1. measure the whole batch in one pass; if it does not fit, the exact largest micro-batch below it
   (:func:`search_largest_batch`, every candidate one measured step) in an accumulated step of two
   passes: a later pass holds the earlier passes' gradients, so two passes of b need more memory than
   one pass of b, and the one-pass step is not on the same curve;
2. split the step's batch into the fewest near-equal micro-batches of at most that size
   (:func:`micro_batch`);
3. time that split, unless a cheaper policy already runs the same number of passes (same launches,
   less recomputation: it is faster); a split whose timed steps peak above the budget is no plan (the
   probes measure a fresh model's second step, later steps can need more), so the next smaller split is
   timed instead, at most ``MAX_SIZES_DOWN`` times per policy; stop after the first policy whose whole
   batch runs in one pass within the budget (no later policy can take fewer).

The plan is the timed candidate with the highest tokens/s; every candidate, timed or not and why, is
in ``Plan.candidates``. Probing trains the model it measures: plan on a copy, or reload the weights.
"""

from __future__ import annotations

import gc
import math
import statistics
from dataclasses import dataclass, field

import torch

from moe_fp4.model.moe import MoE, Recompute, same_policy

GiB = 2**30
# Steps per timed candidate: untimed first (kernels compile, the allocator settles), then timed (median).
# A host-bound step varies from step to step: the median of a few timed steps after one warmup can misorder two
# modes, so each candidate takes two warmups and six timed steps.
PLAN_WARMUP_STEPS = 2
PLAN_TIMED_STEPS = 6
# A timed split that peaked above the budget is retimed at most this many micro-batch sizes down per policy.
MAX_SIZES_DOWN = 3
OVER_BUDGET = "over the budget in its timed steps"


def gib_digits(v: float) -> str:
    """Bytes -> GiB with four significant digits ("0.01502", "11.89", "77.70"): a budget of 0.015 GiB
    and a probe of 0.0149 GiB must not both read "0.01"."""
    return f"{v / GiB:#.4g}".rstrip(".")


def probe_verdict(used: float, budget: float) -> str:
    """A probe's outcome: "0.04623 GiB, fits in the 0.05 GiB budget" / "does not fit ..." / "out of
    memory, does not fit"."""
    if not math.isfinite(used):
        return "out of memory, does not fit"
    return f"{gib_digits(used)} GiB, {'fits' if used <= budget else 'does not fit'} in the {budget / GiB:g} GiB budget"


def micro_batch(per_rank: int, cap: int) -> int:
    """The micro-batch for ``per_rank`` sequences a step when at most ``cap`` fit in one pass (the mode's
    batch, or its largest that fits): the fewest passes, ceil(per_rank / cap), of near-equal size, so
    the largest is ceil(per_rank / passes) <= cap (88 at cap 31: 3 passes of 30, 29, 29 -> 30).
    :class:`moe_fp4.compare.runner.Trainer` splits a step the same way (``torch.tensor_split``)."""
    if cap < 1:
        raise ValueError("no micro-batch fits: not even one sequence")
    passes = -(-per_rank // cap)
    return -(-per_rank // passes)


MAX_SEARCH_PROBES = 24   # bisection over batches up to 2^20 needs about 20 after the first three
# Without a floor per sequence (min_step) a fitted prediction is capped at this many times the largest batch
# measured to fit: a line through two probes that barely differ (weights and optimizer state dominate)
# predicts absurd batches (millions of sequences). With the floor, such a line is not fitted, and a batch the
# floor already rules out is not measured.
PREDICTION_CAP = 4


def search_largest_batch(measure, budget: float, first: int, max_probes: int = MAX_SEARCH_PROBES,
                         log=None, most: int | None = None, min_step: float | None = None,
                         log_probes: bool = True) -> dict:
    """The exact largest batch b >= 0 with measure(b) <= budget, for a measure that does not decrease
    with the batch. measure(b) -> bytes (inf: does not fit, e.g. out of memory); every candidate is
    measured, none is predicted.

    Probes ``first`` and ``2 * first``, fits peak = fixed + slope * batch through them and measures the
    prediction (without ``min_step``: at most PREDICTION_CAP times the largest batch that fit) and its
    neighbour, then brackets (doubling past the largest fit while everything fits) and bisects between the largest
    batch that fits and the smallest that does not. ``min_step``: bytes one more sequence adds at least
    (e.g. each layer's bf16 input): two probes closer than that per sequence are not fitted (the search
    steps up geometrically instead), and a batch whose bytes must exceed the budget by that floor, from the
    largest measured fit, is not measured (no memory proportional to an absurd batch is ever asked for),
    except the one just above the answer, measured to make it exact. At most ``max_probes`` measurements:
    a search that runs out says so through ``log`` and returns the largest batch that fit (``log_probes``
    False: ``log`` gets those lines but not each measurement's, which ``measure`` prints). -> {"batch_max",
    "probe": {str(batch): bytes}, "bytes_per_sequence", "fixed_bytes", "exact": whether batch_max + 1 was
    measured not to fit, or is above ``most`` (False only when max_probes ran out), "skipped": {str(batch):
    the floor that ruled it out}}. ``most``: no batch above it is wanted (the search returns at most ``most``)."""
    probe: dict[int, float] = {}
    skipped: dict[int, float] = {}
    log = log or (lambda *a, **k: None)
    def fits(b: int, bound: bool = True) -> bool:
        if most is not None and b > most:
            return False                                # above the cap: never measured
        if b not in probe:
            # The floor counts from the largest batch measured to fit (none yet: no floor).
            lo = max((k for k, v in probe.items() if v <= budget), default=None)
            floor = probe[lo] + (b - lo) * min_step if min_step and lo is not None else None
            if bound and floor is not None and floor > budget:
                skipped[b] = floor
                log(f"  batch {b}: does not fit, not measured: at least {gib_digits(floor)} GiB (batch {lo}'s "
                    f"{gib_digits(probe[lo])} GiB + {gib_digits(min_step)} GiB a sequence)", flush=True)
                return False
            if len(probe) >= max_probes:
                return False
            probe[b] = float(measure(b))
            if log_probes:
                log(f"  batch {b}: {probe_verdict(probe[b], budget)}", flush=True)
        return probe[b] <= budget

    def spent() -> bool:
        return len(probe) >= max_probes

    first = max(1, int(first))
    lo, hi = 0, None                                    # lo fits (0 always does), hi does not
    for b in (first, 2 * first):
        if fits(b):
            lo = b
        else:
            hi = b
            break
    slope = fixed = None
    p1, p2 = probe.get(first, math.inf), probe.get(2 * first, math.inf)
    if math.isfinite(p1) and math.isfinite(p2) and p2 > p1:
        slope = (p2 - p1) / first
        fixed = p1 - slope * first
    if slope is not None and min_step and slope < min_step:
        log(f"  batches {first} and {2 * first} differ by {gib_digits(slope)} GiB a sequence, less than one adds "
            f"({gib_digits(min_step)} GiB): stepping up from batch {lo} instead of predicting", flush=True)
    elif slope is not None and hi is None:
        guess = int((budget - fixed) // slope)
        if not min_step:
            guess = min(guess, PREDICTION_CAP * max(lo, 1))
        for b in (guess, guess + 1):                    # the prediction and its neighbour bracket it when exact
            if b > lo and (hi is None or b < hi) and not spent():
                if fits(b):
                    lo = b
                else:
                    hi = b
                    break
    while hi is None and not spent():                   # everything fitted so far: double until it does not
        b = max(2 * lo, lo + 1)
        if fits(b):
            lo = b
        else:
            hi = b
    while hi is not None and hi - lo > 1 and not spent():
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    if hi == lo + 1 and hi in skipped and not spent():  # ruled out by the floor: measure it, for an exact answer
        if fits(hi, bound=False):
            raise ValueError(f"search_largest_batch: batch {hi} fits ({gib_digits(probe[hi])} GiB) although "
                             f"min_step put it at {gib_digits(skipped[hi])} GiB or more: min_step is not a floor")
    exact = hi == lo + 1 and (hi in probe or (most is not None and hi > most))
    if not exact and spent():
        log(f"  the search stopped at its bound of {max_probes} probes: batch {lo} fits, "
            f"{'nothing above it was measured not to fit' if hi is None else f'batch {hi} does not'}", flush=True)
    return {"batch_max": lo, "probe": {str(k): v for k, v in sorted(probe.items())}, "bytes_per_sequence": slope,
            "fixed_bytes": fixed, "exact": exact, "skipped": {str(k): v for k, v in sorted(skipped.items())}}


def largest_micro_batch(measure, budget: float, batch: int, first: int, log=None,
                        min_step: float | None = None, log_probes: bool = True) -> dict:
    """The largest micro-batch of a step of ``batch`` sequences that fits ``budget``. measure(b, passes) ->
    bytes of a step of ``passes`` micro-batches of b. The whole batch in one pass is measured first; if
    it does not fit, :func:`search_largest_batch` finds the exact largest b < batch of an accumulated
    step of two passes (a later pass holds the earlier passes' gradients, so that curve lies above the
    one-pass step: not one monotone function). ``min_step``: bytes one more sequence adds at least to a pass
    (search_largest_batch's; one pass's activations are alive at a time, so the same floor holds for two
    passes of b). -> search_largest_batch's dict, "probe" keyed
    "B in one pass" for the one-pass measurement, and "one_pass": whether the whole batch fit."""
    log = log or (lambda *a, **k: None)
    whole = float(measure(batch, 1))
    if log_probes:
        log(f"  the whole batch of {batch} in one pass: {probe_verdict(whole, budget)}", flush=True)
    key = f"{batch} in one pass"
    if whole <= budget or batch == 1:
        fits = whole <= budget
        return {"batch_max": batch if fits else 0, "probe": {key: whole}, "bytes_per_sequence": None,
                "fixed_bytes": None, "exact": True, "one_pass": fits, "skipped": {}}
    found = search_largest_batch(lambda b: measure(b, 2), budget, min(max(1, first), batch - 1), most=batch - 1,
                                 log=lambda msg, **k: log("  two passes:" + msg[1:], **k),
                                 min_step=min_step, log_probes=log_probes)
    return {**found, "probe": {key: whole, **found["probe"]}, "one_pass": False}


@dataclass(frozen=True)
class Candidate:
    """One policy's measured outcome. largest: the largest micro-batch that fits (0: none does; for a split
    sized after one that ran over the budget, the cap it was sized from: one less than that split's);
    micro_batch / passes: the split of the step's batch it runs; peak_bytes: the step's measured peak at
    that split; tokens_per_s: measured (None: not timed, ``why`` says why); a timed candidate with a
    ``why`` ran over the budget in its timed steps and is not chosen; probes: {micro-batch: peak bytes
    (inf: out of memory)} of the search."""

    policy: str
    largest: int
    micro_batch: int = 0
    passes: int = 0
    peak_bytes: float | None = None
    tokens_per_s: float | None = None
    why: str = ""
    probes: dict = field(default_factory=dict)   # {"B in one pass": bytes, "b": bytes of two passes of b}


@dataclass(frozen=True)
class Plan:
    """The chosen policy and split (``policy``, ``micro_batch``, ``passes``), its measured tokens/s and
    peak, and every candidate considered."""

    policy: str
    micro_batch: int
    passes: int
    tokens_per_s: float
    peak_bytes: float | None
    budget_bytes: float
    batch: int
    candidates: tuple[Candidate, ...]

    def table(self) -> str:
        """The candidates as text, the chosen one marked."""
        rows = [f"{'policy':<8} {'largest':>9} {'micro x passes':>15} {'peak':>11} {'tokens/s':>12}  note"]
        for c in self.candidates:
            split = f"{c.micro_batch} x {c.passes}" if c.passes else "-"
            peak = "-" if c.peak_bytes is None else f"{gib_digits(c.peak_bytes)} GiB"
            tps = "-" if c.tokens_per_s is None else f"{c.tokens_per_s:,.0f}"
            chosen = (c.policy, c.micro_batch, c.passes) == (self.policy, self.micro_batch, self.passes)
            mark = "  <- chosen" if chosen and c.tokens_per_s is not None and not c.why else ""
            # an untried policy has no largest micro-batch (its 0 would read as "nothing fits")
            largest = "not tried" if c.why.startswith("not tried") else str(c.largest)
            rows.append(f"{c.policy:<8} {largest:>9} {split:>15} {peak:>11} {tps:>12}  {c.why}{mark}")
        return "\n".join(rows)


class NothingFits(ValueError):
    """Not even one sequence fits the budget under any policy."""


def kept_alike(precision, policies) -> dict[str, str]:
    """{policy: the cheaper policy of ``policies`` that keeps exactly what it keeps in ``precision``}
    (:func:`moe_fp4.model.moe.same_policy`): what :func:`choose` need not measure."""
    same = {p: same_policy(precision, p) for p in policies}
    return {p: q.value for p, q in same.items() if q is not None and q.value in policies}


def choose(policies, measure, timed, batch: int, budget_bytes: float, log=None, same=None) -> Plan:
    """The planning rule over measurements supplied by the caller.

    policies: names in order of cost. measure(policy, micro_batch, passes) -> peak bytes of one optimizer
    step of ``passes`` micro-batches (inf: out of memory). timed(policy, micro_batch, passes) ->
    (tokens/s, peak bytes; inf: out of memory). batch: sequences per step (per rank). same: {policy: a cheaper
    policy that keeps exactly what it keeps} (:func:`moe_fp4.model.moe.same_policy`): not measured, listed as
    not tried. -> :class:`Plan`.

    Per policy: the whole batch in one pass is measured first; if it does not fit, the largest
    micro-batch of an accumulated step (two passes, which hold the first pass's gradients: more memory
    than one pass of the same size, so the one-pass step is not on the same curve) is searched exactly
    below it (:func:`search_largest_batch`)."""
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    log = log or (lambda *a, **k: None)
    out: list[Candidate] = []
    by_passes: dict[int, str] = {}
    first = max(1, batch // 4)
    done = None
    same = same or {}
    for policy in policies:
        if done is not None:
            out.append(Candidate(policy, 0, why=f"not tried: {done} already takes the batch in one pass"))
            continue
        if policy in same:
            out.append(Candidate(policy, 0, why=f"not tried: it keeps what {same[policy]} keeps"))
            continue
        found = largest_micro_batch(lambda b, passes: measure(policy, b, passes), budget_bytes, batch, first,
                                    log=lambda msg, **k: log(f"  {policy}" + msg[1:], **k))
        cap, probes = found["batch_max"], found["probe"]
        if cap < 1:
            out.append(Candidate(policy, 0, why="not even one sequence fits", probes=probes))
            continue
        first = cap   # a costlier policy fits at least this much
        micro = micro_batch(batch, cap)
        passes = -(-batch // micro)
        for size_down in range(MAX_SIZES_DOWN + 1):
            if passes in by_passes:
                out.append(Candidate(policy, cap, micro, passes, why=f"not timed: same passes as "
                                     f"{by_passes[passes]}, which recomputes less", probes=probes))
                break
            tps, peak = timed(policy, micro, passes)
            if peak is None or math.isfinite(peak):
                log(f"  {policy}: micro-batch {micro} x {passes} passes (largest {cap}), {tps:,.0f} tokens/s"
                    + ("" if peak is None else f", peak {peak / GiB:.2f} GiB"), flush=True)
            if peak is None or peak <= budget_bytes:
                by_passes[passes] = policy
                out.append(Candidate(policy, cap, micro, passes, peak, tps, probes=probes))
                break
            # The probes measure a fresh model's second step; the timed steps come after it, and under expert
            # parallelism a rank's rows follow the routing, which drifts from its first balance, so a timed
            # step can peak above its probe. A split that ran over the budget is no plan: the next smaller one,
            # timed again.
            last = size_down == MAX_SIZES_DOWN or micro == 1
            out.append(Candidate(policy, cap, micro, passes, peak, tps, probes=probes,
                                 why=OVER_BUDGET + ("" if not last else "; no smaller split tried")))
            over = f"{peak / GiB:.2f} GiB" if math.isfinite(peak) else "out of memory"
            log(f"  {policy}: {OVER_BUDGET} ({over})" + ("" if last else ": one micro-batch size down"), flush=True)
            if last:
                break
            cap = micro - 1
            micro = micro_batch(batch, cap)
            passes = -(-batch // micro)
        fitted = out[-1].tokens_per_s is not None and not out[-1].why
        if fitted and out[-1].passes == 1:
            done = policy
    timed_ = [c for c in out if c.tokens_per_s is not None and not c.why]
    if not timed_:
        over = [c for c in out if c.why.startswith(OVER_BUDGET)]
        raise NothingFits(f"not even one sequence fits in {budget_bytes / GiB:g} GiB under any recomputation policy "
                          f"({', '.join(dict.fromkeys(c.policy for c in out))})"
                          + ("" if not over else f"; {len(over)} split(s) fit the probes but ran over the budget "
                             f"in their timed steps"))
    best = max(timed_, key=lambda c: c.tokens_per_s)
    return Plan(best.policy, best.micro_batch, best.passes, best.tokens_per_s, best.peak_bytes, budget_bytes, batch,
                tuple(out))


def _default_apply(model: torch.nn.Module, policy: Recompute) -> None:
    if hasattr(model, "recompute"):
        model.recompute = policy
        return
    for m in model.modules():
        if isinstance(m, MoE):
            m.recompute = policy


def _policies_for(model: torch.nn.Module) -> tuple[str, ...]:
    """Every policy for a model that applies recompute itself (moe_fp4.model.decoder.DecoderLM); without that,
    those of its moe_fp4.model.moe.MoE layers (a layer checkpoint is the model's to apply)."""
    if hasattr(model, "recompute"):
        return tuple(p.value for p in Recompute)
    if not any(isinstance(m, MoE) for m in model.modules()):
        raise ValueError("moe_fp4.plan: the model has no moe_fp4.model.MoE layer and no `recompute` attribute; "
                         "pass policies and apply")
    return (Recompute.NONE.value, Recompute.SWIGLU.value, Recompute.MOE.value)


def _free(model: torch.nn.Module) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()


def plan(model: torch.nn.Module, step, *, budget_gib: float, batch: int, seq: int = 1, policies=None, apply=None,
         warmup_steps: int = PLAN_WARMUP_STEPS, timed_steps: int = PLAN_TIMED_STEPS, device=None,
         log=None) -> Plan:
    """Choose the recomputation policy and micro-batch with the highest measured tokens/s that fits
    ``budget_gib`` GiB on this CUDA device (the module docstring gives the rule).

    model: the model to plan for (its policy is set through ``apply``; default: ``model.recompute``
        where it has one, else every ``moe_fp4.model.moe.MoE`` layer's ``recompute``). It is trained by the probes.
    step(micro_batch, passes): one optimizer step over ``passes`` micro-batches of ``micro_batch``
        sequences each, their gradients accumulated (what the training loop will run).
    batch: sequences per optimizer step on this device. seq: tokens per sequence (for tokens/s).
    policies: names in order of cost (default: every policy the model supports).
    -> :class:`Plan`; the model is left with the chosen policy applied."""
    if not torch.cuda.is_available():
        raise RuntimeError("moe_fp4.plan measures memory and time with CUDA: it needs a GPU")
    if not budget_gib > 0:
        raise ValueError(f"budget_gib must be positive, got {budget_gib}")
    for name, v in (("batch", batch), ("seq", seq), ("timed_steps", timed_steps)):
        if v < 1:
            raise ValueError(f"{name} must be positive, got {v}")
    device = torch.device(device or torch.cuda.current_device())
    policies = tuple(Recompute(p).value for p in (policies or _policies_for(model)))
    apply = apply or _default_apply
    budget = budget_gib * GiB

    def peak_of(micro: int, passes: int) -> float:
        _free(model)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            step(micro, passes)
            torch.cuda.synchronize(device)
            return float(torch.cuda.max_memory_allocated(device))
        except torch.OutOfMemoryError:
            return math.inf
        finally:
            _free(model)

    def measure(policy: str, micro: int, passes: int) -> float:
        apply(model, Recompute(policy))
        return peak_of(micro, passes)

    def timed(policy: str, micro: int, passes: int) -> tuple[float, float]:
        apply(model, Recompute(policy))
        _free(model)
        torch.cuda.reset_peak_memory_stats(device)
        times = []
        try:
            for _ in range(warmup_steps):
                step(micro, passes)
            for _ in range(timed_steps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step(micro, passes)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
        except torch.OutOfMemoryError:
            return 0.0, math.inf          # fit its probe, not its timed steps: choose() steps down
        finally:
            _free(model)
        return micro * passes * seq / statistics.median(times), float(torch.cuda.max_memory_allocated(device))

    precisions = {m.precision for m in model.modules() if isinstance(m, MoE)}
    same = kept_alike(precisions.pop(), policies) if len(precisions) == 1 else {}
    result = choose(policies, measure, timed, batch, budget, log, same)
    apply(model, Recompute(result.policy))
    return result


__all__ = ["MAX_SEARCH_PROBES", "MAX_SIZES_DOWN", "OVER_BUDGET", "PLAN_TIMED_STEPS", "PLAN_WARMUP_STEPS", "Candidate",
           "NothingFits", "Plan", "choose", "kept_alike", "largest_micro_batch", "micro_batch", "plan",
           "search_largest_batch"]
