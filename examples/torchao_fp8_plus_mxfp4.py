"""torchao's FP8 MoE training with moe_fp4's saved-activation hook and MXFP4 dispatch, expert parallel.

    torchrun --nproc-per-node 2 examples/torchao_fp8_plus_mxfp4.py     # 2 GPUs (NCCL), or 2 CPU ranks (gloo)

An expert-parallel MoE block written the way torchtitan's token dispatcher does it: a router picks
each token's top-k experts, every (token, expert) pair goes to its expert's rank with torch's
``all_to_all_single_autograd``, the rank's experts run ``torch._grouped_mm`` (groups padded to 16
rows, as torchao's FP8 grouped GEMM needs), and the outputs come back the same way. The experts'
weights are converted by torchao (0.18: ``quantize_(experts, Float8TrainingOpConfig())``), so every
grouped GEMM runs row-wise FP8 on an sm90 GPU. moe_fp4 adds, without touching that code:

- ``moe_fp4.register_activation_compression(block)``: what the block saves for backward in MXFP4;
- ``moe_fp4.swap_all_to_all(dispatch="mxfp4", combine="bf16")``: the dispatch sent in MXFP4 (the two
  exchanges are marked with ``moe_fp4.exchange_role``, a no-op outside the swap).

It runs one forward + backward per variant on the same weights and tokens and prints the loss, the
gradients' SQNR against the first variant, what the hook compressed and the bytes sent per role.
Without an sm90 GPU torchao's FP8 grouped GEMM cannot run: the experts stay bf16 and it says so.
``bench/torchao_ep.py`` times the same variants on GPUs.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import moe_fp4
from moe_fp4.compare.quiet import quiet_third_party
from moe_fp4.formats.metrics import sqnr_db

ALIGN = 16   # rows per expert group: torchao's FP8 grouped GEMM needs multiples of 16


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if hasattr(t, "wait") else t


class Experts(torch.nn.Module):
    """This rank's experts: w13 [E_local, 2F, H] (gate | up), w2 [E_local, H, F]; forward(x [R, H] grouped
    by expert, offs int32 [E_local] group ends) -> [R, H] = SwiGLU experts by torch._grouped_mm."""

    def __init__(self, num_local: int, hidden: int, ffn: int, device, seed: int):
        super().__init__()
        g = torch.Generator(device=device).manual_seed(seed)
        self.w13 = torch.nn.Parameter((torch.randn(num_local, 2 * ffn, hidden, device=device, generator=g)
                                       * hidden ** -0.5).to(torch.bfloat16))
        self.w2 = torch.nn.Parameter((torch.randn(num_local, hidden, ffn, device=device, generator=g)
                                      * ffn ** -0.5).to(torch.bfloat16))

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        gate, up = torch._grouped_mm(x, self.w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(-2, -1), offs=offs)


class EPBlock(torch.nn.Module):
    """Router + expert-parallel experts. forward: x bf16 [T, H] -> bf16 [T, H], the weighted sum of each
    token's top-k experts' outputs (E experts over the group's ranks, E / world each)."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, group, device, seed: int = 0):
        super().__init__()
        self.group, self.top_k, self.num_experts = group, top_k, num_experts
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        g = torch.Generator(device=device).manual_seed(seed)
        self.router = torch.nn.Parameter((torch.randn(num_experts, hidden, device=device, generator=g)
                                          * hidden ** -0.5).to(torch.bfloat16))
        self.experts = Experts(num_experts // world, hidden, ffn, device, seed=seed + 1 + rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, k, e = x.shape[0], self.top_k, self.num_experts
        world = dist.get_world_size(self.group)
        local = e // world
        weights, ids = F.linear(x, self.router).float().softmax(-1).topk(k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)                    # pairs by expert: by rank, then expert
        counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        got = _wait(funcol.all_to_all_single(counts, None, None, self.group))   # [world * local] by source
        send = counts.view(world, local).sum(1).tolist()
        got_host = got.view(world, local).tolist()
        recv = [sum(row) for row in got_host]
        with moe_fp4.exchange_role("dispatch"):
            rows = _wait(funcol.all_to_all_single_autograd(x[order // k], recv, send, self.group))
        # The received rows come by source rank, then expert: regroup by expert, each group padded to 16.
        per_expert = [sum(got_host[s][j] for s in range(world)) for j in range(local)]
        padded = [-(-c // ALIGN) * ALIGN for c in per_expert]
        expert_of_row = torch.arange(local, device=x.device).repeat(world).repeat_interleave(got.view(-1))
        perm = torch.argsort(expert_of_row, stable=True)
        start = torch.tensor([0] + per_expert, device=x.device).cumsum(0)[:-1]
        pstart = torch.tensor([0] + padded, device=x.device).cumsum(0)[:-1]
        e_sorted = expert_of_row[perm]
        pos = pstart[e_sorted] + torch.arange(perm.numel(), device=x.device) - start[e_sorted]
        h = rows.new_zeros(sum(padded), rows.shape[1]).index_copy(0, pos, rows[perm])
        offs = torch.tensor(padded, device=x.device).cumsum(0).to(torch.int32)
        out = self.experts(h, offs)
        back_rows = torch.empty_like(rows).index_copy(0, perm, out[pos])
        with moe_fp4.exchange_role("combine"):
            back = _wait(funcol.all_to_all_single_autograd(back_rows, send, recv, self.group))
        y = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        y = y.index_add(0, order // k, back.float() * weights.flatten()[order, None])
        return y.to(x.dtype)


def fp8_ready(device: torch.device) -> bool:
    """torchao's FP8 grouped GEMM runs on sm90 (Hopper) and newer only."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def to_torchao_fp8(block: EPBlock) -> EPBlock:
    """Wrap the experts' weights with torchao's FP8 training config (row-wise FP8 grouped GEMMs)."""
    # torchao reports the prebuilt extensions it cannot load here and its enums' pytree registration when
    # imported: known-harmless lines, dropped (nothing else is).
    with quiet_third_party():
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_

    quantize_(block.experts, Float8TrainingOpConfig(), filter_fn=lambda mod, fqn: isinstance(mod, Experts))
    return block


VARIANTS = ("torchao", "torchao + hook", "torchao + hook + mxfp4 dispatch")


def build(variant: str, hidden: int, ffn: int, num_experts: int, top_k: int, group, device, fp8: bool):
    """-> (block, context manager for its steps, the hook's handle or None) for one of VARIANTS."""
    block = EPBlock(hidden, ffn, num_experts, top_k, group, device)
    if fp8:
        to_torchao_fp8(block)
    handle = moe_fp4.register_activation_compression(block) if "hook" in variant else None
    scope = (lambda: moe_fp4.swap_all_to_all(dispatch="mxfp4", combine="bf16")) if "mxfp4" in variant \
        else contextlib.nullcontext
    return block, scope, handle


def main() -> None:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > local
    if "RANK" not in os.environ:
        raise SystemExit("run it with 2 ranks: torchrun --nproc-per-node 2 examples/torchao_fp8_plus_mxfp4.py")
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    fp8 = fp8_ready(device)
    hidden, ffn, num_experts, top_k, tokens = 256, 128, 8, 2, 256
    x = torch.randn(tokens, hidden, device=device, generator=torch.Generator(device=device).manual_seed(100 + rank))
    x = x.to(torch.bfloat16)
    if rank == 0:
        print(f"{world} ranks on {device.type}: experts "
              + ("in row-wise FP8 (torchao)" if fp8 else "in bf16 (torchao's FP8 grouped GEMM needs an sm90 GPU)"),
              flush=True)
    results = {}
    for variant in VARIANTS:
        block, scope, handle = build(variant, hidden, ffn, num_experts, top_k, dist.group.WORLD, device, fp8)
        xi = x.clone().requires_grad_()
        with scope() as cfg:
            loss = block(xi).float().square().mean()
            loss.backward()                        # the gradients' exchanges too, in their role's format
        grads = [xi.grad] + [p.grad for p in block.parameters()]
        results[variant] = (loss.detach(), grads)
        ref_loss, ref_grads = results[VARIANTS[0]]
        worst = min(sqnr_db(a.float(), b.float()) for a, b in zip(ref_grads, grads))
        line = f"  rank {rank} {variant:>32}: loss {loss.item():.5f}"
        if variant != VARIANTS[0]:
            line += f", gradients SQNR >= {worst:.1f} dB"
        if handle is not None:
            stats = handle.stats.total
            line += f"; hook: {stats.compressed} tensors compressed, {stats.bytes_before} -> {stats.bytes_after} B"
            handle.remove()
        if cfg is not None:
            line += "; sent " + ", ".join(f"{r} {d} {f} {n} B" for (r, d, f), n in sorted(cfg.wire.items()))
        every = [None] * world
        dist.all_gather_object(every, line)   # rank 0 prints every rank's line, in order
        if rank == 0:
            print("\n".join(every), flush=True)
    dist.barrier()   # no rank tears its process groups down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The run is over: exiting here skips the interpreter's teardown of torch's gloo state, which now and
    # then aborts ("terminate called without an active exception") after every rank has finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
