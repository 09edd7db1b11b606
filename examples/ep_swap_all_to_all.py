"""An expert-parallel loop written with torch's all_to_all_single, switched to MXFP4 with one line.

    torchrun --nproc-per-node 2 examples/ep_swap_all_to_all.py            # CPU (gloo) or one GPU per rank (NCCL)
    python examples/ep_swap_all_to_all.py                                  # one process: the exchange is with itself

Each rank holds tokens and one expert (a linear layer); tokens go to the rank of their expert and
back, exactly as a hand-written EP dispatcher does it with
``torch.distributed._functional_collectives.all_to_all_single_autograd``. The dispatch and the combine
are marked with ``moe_fp4.exchange_role`` (a no-op outside the swap), so inside
``moe_fp4.swap_all_to_all()`` the same code sends the tokens as MXFP4 rows, the expert outputs back
in bf16 and both gradients in bf16 (the defaults; each is a keyword of the swap). The example prints
the bytes each exchange put on the wire and how far the output and the gradients move (rank 0 prints
every rank's lines, in rank order). Without torchrun it runs as one process (world size 1): every token
stays on its rank, but it still crosses the all-to-all in the wire format.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import moe_fp4
from moe_fp4.formats.metrics import sqnr_db


def ep_step(x: torch.Tensor, dest: torch.Tensor, expert: torch.nn.Linear, group) -> torch.Tensor:
    """x [T, H] bf16, dest int64 [T] (the rank of each token's expert) -> [T, H]: expert(x) on that rank."""
    world = dist.get_world_size(group)
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = funcol.all_to_all_single(send_counts, None, None, group)   # int64: passes through unchanged
    send, recv = send_counts.tolist(), recv_counts.tolist()
    with moe_fp4.exchange_role("dispatch"):                                  # MXFP4 inside the swap
        tokens = funcol.all_to_all_single_autograd(x[order], recv, send, group)
    out = expert(tokens)
    with moe_fp4.exchange_role("combine"):                                   # bf16 inside the swap
        back = funcol.all_to_all_single_autograd(out, send, recv, group)
    return torch.empty_like(back).index_copy(0, order, back)


def main() -> None:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > local
    if cuda:
        torch.cuda.set_device(local)
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:   # launched by torchrun
        dist.init_process_group(backend)
    else:
        print(f"not launched by torchrun: one process ({backend}, world size 1); for 2 ranks: "
              "torchrun --nproc-per-node 2 examples/ep_swap_all_to_all.py")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    group = dist.group.WORLD
    torch.manual_seed(rank)
    hidden, tokens = 256, 64
    expert = torch.nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16, device=device)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    dest = torch.randint(0, world, (tokens,), device=device)

    results = {}
    for name in ("bf16 (torch)", "mxfp4 (swapped)"):
        xi = x.clone().requires_grad_()
        expert.zero_grad()
        if name == "bf16 (torch)":
            y = ep_step(xi, dest, expert, group)
        else:
            with moe_fp4.swap_all_to_all(dispatch="mxfp4", combine="bf16") as cfg:
                y = ep_step(xi, dest, expert, group)
        y.float().square().sum().backward()           # the gradients' exchanges run here, in their role's format
        results[name] = (y.detach(), xi.grad, expert.weight.grad.clone())
    ref, got = results["bf16 (torch)"], results["mxfp4 (swapped)"]
    sent = ", ".join(f"{role} {direction} {fmt} {n} B" for (role, direction, fmt), n in sorted(cfg.wire.items()))
    lines = [f"  rank {rank} sent: {sent}"]
    for name, a, b in zip(("output", "input grad", "expert grad"), ref, got):
        lines.append(f"  rank {rank} {name:>11}: SQNR {sqnr_db(a.float(), b.float()):5.1f} dB")
    # Every rank's lines go to rank 0, which prints them after the header in rank order: ranks printing
    # for themselves interleave under torchrun.
    every = [None] * world if rank == 0 else None
    dist.gather_object(lines, every, dst=0, group=group)
    if rank == 0:
        print(f"{world} rank{'s' if world > 1 else ''} on {device.type}: "
              "MXFP4 dispatch, bf16 combine vs torch's bf16 all-to-all")
        print("\n".join(line for rank_lines in every for line in rank_lines), flush=True)
    dist.barrier()   # no rank tears its process groups down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The run is over: exiting here skips the interpreter's teardown of torch's gloo state, which now and
    # then aborts ("terminate called without an active exception") after every rank has finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
