"""Recomputation that does not repeat what must run once: :func:`checkpoint` (torch's non-reentrant
checkpoint) records the results of each :func:`once` call in its region's first run, the routing's host
sync and, under expert parallelism, the count exchange, the dispatch and the combine, and hands them back
in the recomputation instead of running them again (:mod:`moe_fp4.model.moe`, :mod:`moe_fp4.model.routing`)."""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.utils.checkpoint

from moe_fp4.saved.hook import as_current, current_compression


class _Replay:
    """One checkpointed region's results of the steps that must not run twice (host syncs, collectives),
    in the order the first run produced them; the recomputation takes them back in the same order."""

    def __init__(self):
        self.results: list = []
        self.recorded = False
        self.pos = 0
        self.scope = None   # the compression scope the first run saw (moe_fp4.saved.hook.current_compression)

    def once(self, compute):
        if not self.recorded:
            out = compute()
            self.results.append(out)
            return out
        if self.pos >= len(self.results):
            raise RuntimeError("moe_fp4.model.moe.checkpoint: the recomputation ran more MoE exchanges than the "
                               f"forward ({len(self.results)}); the checkpointed function must run the same layers "
                               "each time")
        out = self.results[self.pos]
        self.pos += 1
        return out


_REPLAY: contextvars.ContextVar[_Replay | None] = contextvars.ContextVar("moe_fp4_replay", default=None)


def once(compute):
    """compute() once: inside :func:`checkpoint`, the first run records the result and the
    recomputation returns it without running compute again; elsewhere just compute()."""
    rep = _REPLAY.get()
    return compute() if rep is None else rep.once(compute)


def checkpoint(fn, *args, **kwargs):
    """``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)`` whose recomputation
    does not repeat the MoE layers' host syncs and exchanges (:func:`once`): the first run records
    their results, the recomputation reuses them. Works with the saved-tensor hook like any
    non-reentrant checkpoint (see :mod:`moe_fp4.saved.hook`). ``kwargs`` go to torch's checkpoint
    (``preserve_rng_state``, ``determinism_check``, ...); pass fn's keyword arguments through a closure."""
    rep = _Replay()

    def run(*a):
        token = _REPLAY.set(rep)
        rep.pos = 0
        if not rep.recorded:
            rep.scope = current_compression()
        # The recomputation (in backward, maybe on autograd's device thread) sees the compression scope
        # the first run saw, so it keeps the same formats (checkpoint compares what both runs save).
        scope = as_current(rep.scope) if rep.recorded else contextlib.nullcontext()
        try:
            with scope:
                return fn(*a)
        finally:
            _REPLAY.reset(token)
            rep.recorded = True

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)


__all__ = ["checkpoint", "once"]
