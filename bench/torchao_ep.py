"""torchao FP8 MoE training with moe_fp4's hook and MXFP4 dispatch, expert parallel over the GPUs of one host.

    torchrun --nproc-per-node 2 bench/torchao_ep.py --json torchao_ep.json     # 2 sm90 GPUs (NCCL)

One MoE block (router + routed SwiGLU experts, E experts over the ranks, top-k), forward + backward
with a fixed output gradient, the weights' versions bumped before every step as an optimizer step
would (so FP8 weight copies are made every step in every variant), in these variants, the same
tokens per rank:

- ``torch bf16``: examples/torchao_fp8_plus_mxfp4.py's EP block (torchtitan's way: every (token, expert)
  pair sent with torch's ``all_to_all_single_autograd``, ``torch._grouped_mm`` experts), bf16;
- ``torchao fp8``: the same block with the experts converted by torchao (row-wise FP8 grouped GEMMs);
- ``torchao fp8 + hook``: plus ``moe_fp4.register_activation_compression`` (saved activations in MXFP4);
- ``torchao fp8 + hook + mxfp4 dispatch``: plus ``moe_fp4.swap_all_to_all`` (dispatch MXFP4, combine bf16);
- ``moe_fp4 fp8`` / ``moe_fp4 fp4``: :class:`moe_fp4.model.moe.MoE` with :class:`moe_fp4.exchange.ep.EPConfig`
  (each token sent once per rank; blockwise FP8 GEMMs; fp4: MXFP4 dispatch and MXFP4-stored activations).

Columns: median ms of forward + backward over --iters (CUDA events, the slowest rank's), tokens/s per
GPU, the ratio to ``torch bf16``, and the peak memory the step adds over what was allocated before
(MiB, the largest rank's). Shapes: dsv3 (H 7168, F 2048, 64 experts, top-8, 4096 tokens per rank: about
1024 rows per local expert) and small (H 2048, F 1408, 128 experts, top-8, 6144 tokens per rank).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/, for experts.py and harness.py (python -P too)
from experts import timed_step  # noqa: E402  (bench/experts.py: fwd + bwd with the weights' versions bumped)
from harness import log, sm90_run, write_results  # noqa: E402  (bench/harness.py: run record, JSON)
from torchao_fp8_plus_mxfp4 import EPBlock, build, fp8_ready  # noqa: E402  (the example's EP block)

from moe_fp4.exchange.ep import EPConfig  # noqa: E402
from moe_fp4.model.moe import MoE, MoEConfig  # noqa: E402

SHAPES = {"dsv3": (7168, 2048, 64, 8, 4096), "small": (2048, 1408, 128, 8, 6144)}   # H, F, E, k, tokens/rank


def variants(shape: str, device, fp8: bool):
    h, f, e, k, _ = SHAPES[shape]
    group = dist.group.WORLD
    out = []
    block = EPBlock(h, f, e, k, group, device)
    out.append(("torch bf16", block, None))
    if fp8:
        for name in ("torchao", "torchao + hook", "torchao + hook + mxfp4 dispatch"):
            blk, scope, _ = build(name, h, f, e, k, group, device, fp8=True)
            out.append((name.replace("torchao", "torchao fp8"), blk, scope))
    for precision in ("fp8", "fp4"):
        moe = MoE(MoEConfig(hidden=h, ffn=f, num_experts=e, top_k=k), precision=precision, device=device,
                  ep=EPConfig())
        out.append((f"moe_fp4 {precision}", moe, None))
    return out


def run_shape(shape: str, args, device, rank: int, world: int) -> list[dict]:
    h, f, e, k, tokens = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(100 + rank)
    x = torch.randn(tokens, h, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    gy = torch.randn(tokens, h, device=device, generator=g).to(torch.bfloat16)   # d(loss)/d(output)
    fp8 = fp8_ready(device)
    if rank == 0:
        log(f"\n{shape}: H {h}, F {f}, {e} experts over {world} ranks, top-{k}, {tokens} tokens per rank"
            + ("" if fp8 else " (no sm90: torchao rows skipped)"))
        log("| variant | fwd+bwd ms | tokens/s/GPU | / torch bf16 | peak MiB |")
        log("| --- | ---: | ---: | ---: | ---: |")
    rows, base = [], None
    for name, module, scope in variants(shape, device, fp8):
        err = None
        try:
            with (scope() if scope else contextlib.nullcontext()):
                dist.barrier()
                # Each step bumps the weights' versions as an optimizer step would: moe_fp4's FP8 weight
                # copies are made again every step, as torchao's are.
                ms, mib = timed_step(lambda module=module: module(x), list(module.parameters()), x, gy,
                                     args.warmup, args.iters)
        except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
            err, ms, mib = str(exc).splitlines()[0][:200], float("nan"), float("nan")
        both = torch.tensor([ms, mib], device=device, dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)    # the slowest rank's time, the largest rank's peak
        ms, mib = both.tolist()
        base = base if base is not None and base == base else ms   # the first variant that ran
        row = {"shape": shape, "variant": name, "ms": ms, "tokens_per_s_per_gpu": tokens / ms * 1e3,
               "vs_torch_bf16": ms / base, "peak_mib": mib, "world": world}
        if err:
            row["error"] = err
        rows.append(row)
        if rank == 0:
            log(f"| {name} | failed on rank {rank}: {err} | | | |" if err else
                f"| {name} | {ms:.2f} | {row['tokens_per_s_per_gpu']:.0f} | {ms / base:.3f} | {mib:.0f} |")
        del module
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", help="write the results here (rank 0)")
    args = p.parse_args()
    if "RANK" not in os.environ or not torch.cuda.is_available():
        raise SystemExit("run it on GPUs with torchrun: torchrun --nproc-per-node 2 bench/torchao_ep.py")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local)
    head = sm90_run("bench/torchao_ep.py") if rank == 0 else None
    results = []
    for shape in args.shape:
        results += run_shape(shape, args, device, rank, world)
    if rank == 0:
        write_results(args.json, head, results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
