"""Run a function on N spawned CPU processes joined by a gloo group, with a bounded time.

``run_ranks(fn, world, *args)`` starts ``world`` processes (spawn context, a free localhost port),
each calling ``fn(rank, world, *args)`` after ``init_process_group("gloo")`` (or ``backend="nccl"``:
one GPU per rank, for the GPU tests) with a collective timeout, and returns the per-rank results in rank
order. Any exception on any rank fails the caller with that rank's traceback; a run past ``timeout``
seconds is killed and fails as a hang.
``fn`` must be a module-level function of an importable module (spawn pickles it by name).

The ranks run moe_fp4's pure-torch reference conversions, not the Triton kernels under the
interpreter (``TRITON_INTERPRET=0`` in each child, so import moe_fp4 inside ``fn``, not at the top of
its module): these tests are about what moves where, the kernels are checked bit for bit against
the same references in test_kernels.py, and the interpreter would make every collective test
minutes long on a 2-core CPU.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60
RUN_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, results, backend, args):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRITON_INTERPRET="0")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            results.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout: float = RUN_TIMEOUT_S, backend: str = "gloo"):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, backend, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got, failures = {}, []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(got) + len(failures) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout} s "
                                   f"(finished: {sorted(got)}; a hang in a collective?)")
            try:
                rank, ok, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise RuntimeError(f"{fn.__name__}: rank(s) {dead} died (exit codes "
                                       f"{[procs[r].exitcode for r in dead]})") from None
                continue
            if ok:
                got[rank] = payload
            else:
                failures.append((rank, payload))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if failures:
        rank, tb = sorted(failures)[0]
        raise AssertionError(f"{fn.__name__} failed on rank {rank} ({len(failures)} of {world} ranks failed):\n{tb}")
    return [got[r] for r in range(world)]
