"""Memory against a budget: :func:`step_bytes` (one training step's memory per device, probed on a
freshly built model), :func:`largest_batch` (the exact largest batch in a budget), :func:`measure_steps`
(a split's tokens/s and peak) and :func:`plan_mode` (:func:`moe_fp4.model.planner.choose` for one mode),
and the probe lines they print (:func:`probe_verdict`: the bytes with enough digits, and whether they fit).

On CUDA a probe's memory is the allocator's peak; on CPU it is estimated (parameters, gradients,
optimizer state and saved activations; there is no allocator to ask), so CPU budgets are for tests.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import replace

import torch

from moe_fp4.compare.config import CompareConfig, Env, GiB
from moe_fp4.compare.train import Trainer, _batches, _free, _max_over_ranks, _sync, activation_bytes, build
from moe_fp4.model.moe import Recompute
from moe_fp4.model.planner import PLAN_TIMED_STEPS, PLAN_WARMUP_STEPS, gib_digits, probe_verdict, search_largest_batch


def logged(measure, budget: float, name, log):
    """``measure`` that also prints each probe: "  <name(*args)>: <probe_verdict>"."""
    def probe(*args):
        used = measure(*args)
        log(f"  {name(*args)}: {probe_verdict(used, budget)}", flush=True)
        return used
    return probe


def _passes(mode: str, batch: int, passes: int) -> str:
    return f"{mode}: the whole batch of {batch} in one pass" if passes == 1 else \
        f"{mode}: {passes} passes of {batch}"


# The caching allocator's setting for every run that measures memory against a budget, unless the user set one.
# With fixed-size segments a dsv3-layers step fragments: a probe whose peak allocation is well below the card's
# memory goes out of memory one sequence later, and a batch the search measured to fit can go out of memory in
# training. Expandable segments grow one mapping instead, so what the allocator peaks at is what the card must
# hold.
ALLOC_CONF = "expandable_segments:True"


def prefer_expandable_segments() -> str:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to :data:`ALLOC_CONF` unless it is set -> its value. Call before the first
    CUDA allocation (the allocator reads it once); a value the user set is kept."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    return os.environ["PYTORCH_CUDA_ALLOC_CONF"]


def step_bytes(cfg: CompareConfig, mode: str, env: Env, corpus, batches: list[int], passes: int = 1) -> dict[int, int]:
    """Memory of one training step at each batch (per device, the largest rank): CUDA's peak
    allocation, or on CPU parameters + gradients + optimizer state + saved activations. With
    ``passes`` > 1 the step takes batch * passes sequences in micro-batches of ``batch``, gradients
    accumulated (a later pass runs with the earlier passes' gradients held: more than one pass of the
    same batch). Builds its own model (the probes train it) and frees it."""
    _free(env)   # every probe starts from the same state: nothing cached from the one before
    out = {}
    model = trainer = handle = None
    try:
        model, loss_fn, sharded, handle = build(cfg, mode, env)
        trainer = Trainer(model, loss_fn, env, cfg.lr, cfg.steps, sharded, optimizer=cfg.optimizer)
        data = _batches(cfg, env, corpus)
        trainer.micro_batch = batches[0]
        trainer.step(*data.next(batches[0] * passes))        # optimizer state exists from here on
        for b in batches:
            trainer.micro_batch = b
            ids, targets = data.next(b * passes)
            if env.cuda:
                _sync(env)
                torch.cuda.reset_peak_memory_stats(env.device)
                try:
                    trainer.step(ids, targets)
                    _sync(env)
                    used = torch.cuda.max_memory_allocated(env.device)
                except torch.OutOfMemoryError:
                    trainer.opt.zero_grad(set_to_none=True)
                    used = float("inf")
            else:
                static = sum(t.numel() * t.element_size() for p in model.parameters()
                             for t in (p, *trainer.opt.state[p].values()) if isinstance(t, torch.Tensor))
                act = activation_bytes(trainer, ids[:b], targets[:b], handle)["saved_bytes"]
                used = static + sum(p.numel() * p.element_size() for p in model.parameters()) + act
            out[b] = _max_over_ranks(used, env)
    except torch.OutOfMemoryError:
        # Out of memory building the model or in its first step: none of the batches fits. (An
        # exception raised on some ranks only would leave the others in a collective; a probe's
        # memory is the same on every rank up to routing, which the search's margin does not rely on.)
        out.update({b: float("inf") for b in batches if b not in out})
    finally:
        if handle is not None:
            handle.remove()
        del model, trainer
        _free(env)
    return out


def sequence_floor_bytes(cfg: CompareConfig) -> float:
    """Bytes one more sequence adds to a training step at least, in any mode and recomputation policy: each
    decoder layer keeps its bf16 input [seq, hidden] for backward (the largest-batch search's floor)."""
    mc = cfg.model
    return float(mc.seq * mc.hidden * 2 * mc.layers)


def largest_batch(cfg: CompareConfig, mode: str, env: Env, corpus, budget: float, log=print) -> dict:
    """The exact largest batch whose training step fits ``budget`` bytes per device
    (:func:`search_largest_batch`; each candidate one probe from a freshly built model: step_bytes),
    each probe printed through ``log``. With a global batch, :func:`largest_accumulated_batch` instead."""
    measure = logged(lambda b: step_bytes(cfg, mode, env, corpus, [b])[b], budget, lambda b: f"{mode}: batch {b}",
                     log)
    return search_largest_batch(measure, budget, max(1, cfg.batch // 2), min_step=sequence_floor_bytes(cfg),
                                log=lambda msg, **k: log(f"  {mode}:{msg[1:]}", **k), log_probes=False)


def largest_accumulated_batch(cfg: CompareConfig, mode: str, env: Env, corpus, budget: float, per_rank: int,
                              log=print) -> dict:
    """:func:`moe_fp4.model.planner.largest_micro_batch` for one mode: the largest micro-batch of an
    accumulated step of ``per_rank`` sequences within ``budget`` bytes, each probe printed through ``log``."""
    from moe_fp4.model.planner import largest_micro_batch as search

    measure = logged(lambda b, passes: step_bytes(cfg, mode, env, corpus, [b], passes)[b], budget,
                     lambda b, passes: _passes(mode, b, passes), log)
    return search(measure, budget, per_rank, max(1, cfg.batch // 2), min_step=sequence_floor_bytes(cfg),
                  log=lambda msg, **k: log(f"  {mode}:{msg[1:]}", **k), log_probes=False)


def measure_steps(cfg: CompareConfig, mode: str, env: Env, corpus, batch: int, micro: int,
                  warmup: int = PLAN_WARMUP_STEPS, steps: int = PLAN_TIMED_STEPS) -> tuple[float, float | None]:
    """Time ``steps`` training steps of ``batch`` sequences per rank in micro-batches of at most ``micro``
    (after ``warmup`` untimed ones) on a freshly built model -> (tokens/s per GPU of the slowest rank,
    peak bytes of the largest rank; None on CPU), or (0.0, inf) when the steps run out of memory (a split that
    fit its probe: the planner takes it as over the budget and steps down). The model is freed afterwards."""
    _free(env)
    model, loss_fn, sharded, handle = build(cfg, mode, env)
    trainer = Trainer(model, loss_fn, env, cfg.lr, cfg.steps, sharded, micro_batch=micro,
                      optimizer=cfg.optimizer)
    data = _batches(cfg, env, corpus)
    try:
        for _ in range(warmup):
            trainer.step(*data.next(batch))
        _sync(env)
        if env.cuda:
            torch.cuda.reset_peak_memory_stats(env.device)
        times = []
        for _ in range(steps):
            ids, targets = data.next(batch)
            _sync(env)
            t0 = time.perf_counter()
            trainer.step(ids, targets)
            _sync(env)
            times.append(time.perf_counter() - t0)
        peak = _max_over_ranks(torch.cuda.max_memory_allocated(env.device), env) if env.cuda else None
        step_s = _max_over_ranks(statistics.median(times), env)
    except torch.OutOfMemoryError:
        # (As in step_bytes: an out-of-memory on some ranks only would leave the others in a collective.)
        return 0.0, math.inf
    finally:
        if handle is not None:
            handle.remove()
        del model, trainer
        _free(env)
    return batch * cfg.model.seq / step_s, peak


def plan_mode(cfg: CompareConfig, mode: str, env: Env, corpus, per_rank: int, log=print,
              warmup_steps: int = PLAN_WARMUP_STEPS, timed_steps: int = PLAN_TIMED_STEPS):
    """:func:`moe_fp4.model.planner.choose` for one mode: each policy's exact largest micro-batch in
    ``cfg.budget_gib`` (every probe a fresh model, :func:`step_bytes`), each distinct split timed by
    :func:`measure_steps` -> the Plan."""
    from moe_fp4.model.planner import choose, kept_alike

    budget = cfg.budget_gib * GiB

    def measure(policy: str, micro: int, passes: int) -> float:
        return step_bytes(replace(cfg, recompute=policy, plan=False), mode, env, corpus, [micro], passes)[micro]

    measure = logged(measure, budget, lambda policy, b, passes: _passes(f"{mode} {policy}", b, passes), log)

    def timed(policy: str, micro: int, passes: int) -> tuple[float, float | None]:
        return measure_steps(replace(cfg, recompute=policy, plan=False), mode, env, corpus, per_rank, micro,
                             warmup_steps, timed_steps)

    def planner_line(msg: str, **k) -> None:
        # The planner's own probe lines (each ending in planner.probe_verdict's "... GiB budget" or "out of
        # memory, does not fit") repeat what `measure` above prints with the mode and policy; its other
        # lines (each timed split) pass.
        if not msg.rstrip().endswith((" GiB budget", "out of memory, does not fit")):
            log(f"  {mode}" + msg[1:], **k)

    policies = [p.value for p in Recompute]
    return choose(policies, measure, timed, per_rank, budget, planner_line, kept_alike(mode, policies))


__all__ = ["gib_digits", "largest_accumulated_batch", "largest_batch", "measure_steps", "plan_mode", "probe_verdict",
           "step_bytes"]
