"""``moe-fp4`` (also ``python -m moe_fp4``): the command line.

    moe-fp4 compare                                    # one GPU (or a tiny CPU run): bf16 vs fp8 vs fp4
    torchrun --nproc-per-node 2 -m moe_fp4 compare     # expert parallelism over 2 GPUs
    moe-fp4 compare --max-batch 60                     # each mode at its largest batch in 60 GiB
    moe-fp4 compare --steps 1000 --data stdlib         # convergence on the stdlib's source text
    moe-fp4 compare --hook                             # a Hugging Face MoE model with and without the hook

Prints a table (tokens/s per GPU, step time, peak and activation memory, all-to-all share, loss,
ratios against fp8), writes ``<out>/compare.json`` and, with matplotlib (``pip install
"moe_fp4[plot]"``), ``throughput.png``, ``memory.png`` and ``loss.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from moe_fp4.model import PRESETS

# Sequences per rank. small: 64 x 1024 tokens keep an H200 busy; at 16 the step is bound by the host
# (kernel launches), which hides what the modes change.
PRESET_BATCH = {"tiny": 4, "small": 64, "dsv3-layers": 2}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-fp4", description="MXFP4 storage and transport for FP8 MoE training")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="train a small DeepSeek-V3-style model in bf16, fp8 and fp4 and compare",
                       description=__doc__.split("\n\n")[2].replace("\n", " "))
    c.add_argument("--preset", choices=list(PRESETS), default=None,
                   help="model size (default: small on a GPU, tiny on CPU)")
    c.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                   help="bf16 fp8 fp4 (default: all three; with --hook: hf hf+hook)")
    c.add_argument("--steps", type=int, default=None, help="training steps per mode (default 200 on GPU, 8 on CPU)")
    c.add_argument("--warmup", type=int, default=None, help="untimed first steps (default steps // 5, at most 20)")
    c.add_argument("--batch", type=int, default=None,
                   help=f"sequences per rank (default per preset: {PRESET_BATCH})")
    c.add_argument("--seq", type=int, default=None, help="sequence length (default per preset)")
    c.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (default per preset)")
    c.add_argument("--layers", type=int, default=None, help="decoder layers, the first one dense (default per preset)")
    c.add_argument("--lr", type=float, default=1e-3)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--data", choices=["stdlib", "random"], default="stdlib",
                   help="stdlib: byte tokens of the Python standard library's source (default); random: noise")
    c.add_argument("--max-batch", type=float, default=None, metavar="GIB",
                   help="find each mode's largest batch within GIB per device and train each at its own")
    c.add_argument("--budget-gib", type=float, default=None, metavar="GIB",
                   help="fail early, with the memory it needs, if --batch does not fit in GIB per device")
    c.add_argument("--slow-link", action="store_true",
                   help="NCCL_P2P_DISABLE=1: NCCL through host shared memory (~24 GB/s), standing in for a network")
    c.add_argument("--hook", action="store_true",
                   help="compare a Hugging Face MoE model (from a config) with and without "
                        "register_activation_compression")
    c.add_argument("--out", default="moe_fp4_compare", help="directory for compare.json and the plots")
    c.add_argument("--no-plots", action="store_true")
    c.add_argument("--no-progress", action="store_true")
    c.add_argument("--profile-steps", type=int, default=3, help="profiled steps for the all-to-all share (EP)")
    c.add_argument("--profile", action="store_true",
                   help="also write the profiler's table of those steps to <out>/profile_<mode>.txt (rank 0)")
    return p


def _distributed(slow_link: bool):
    """-> (device, rank, world) after init_process_group when launched by torchrun with > 1 process."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} GPUs are visible")
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if world == 1:
        return device, 0, 1
    if slow_link:
        os.environ["NCCL_P2P_DISABLE"] = "1"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=10),
                            device_id=device if cuda else None)
    return device, dist.get_rank(), dist.get_world_size()


def compare(a: argparse.Namespace, err) -> int:
    import torch

    from moe_fp4.compare import CompareConfig, Env, check_ep, run, table
    from moe_fp4.ep import EPConfig

    cuda = torch.cuda.is_available()
    preset = a.preset or ("small" if cuda else "tiny")
    steps = a.steps if a.steps is not None else (200 if cuda else 8)
    modes = tuple(a.modes) if a.modes else (("hf", "hf+hook") if a.hook else ("bf16", "fp8", "fp4"))
    try:
        cfg = CompareConfig(preset=preset, modes=modes, steps=steps,
                            warmup=a.warmup if a.warmup is not None else min(20, steps // 5),
                            batch=a.batch if a.batch is not None else PRESET_BATCH[preset],
                            seq=a.seq, experts=a.experts, layers=a.layers,
                            lr=a.lr, seed=a.seed, data=a.data, max_batch_gib=a.max_batch, budget_gib=a.budget_gib,
                            profile_steps=a.profile_steps, profile=a.profile, hook=a.hook, progress=not a.no_progress)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            if a.hook:
                raise ValueError("--hook compares a Hugging Face model on one device; run it without torchrun")
            check_ep(cfg.model, world)
    except ValueError as e:
        err(str(e))
        return 2
    if a.slow_link and world == 1:
        print("note: --slow-link changes only NCCL between processes; it has no effect on one process", flush=True)
    device, rank, world = _distributed(a.slow_link)
    env = Env(device, rank, world, EPConfig() if world > 1 else None)
    try:
        report = run(cfg, env)
    except ValueError as e:
        err(str(e))
        return 2
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    report["meta"]["slow_link"] = bool(a.slow_link and world > 1)
    if rank == 0:
        print(table(report))
        os.makedirs(a.out, exist_ok=True)
        written = []
        for mode, row in report["modes"].items():
            if "profile_table" in row:
                written.append(os.path.join(a.out, f"profile_{mode.replace('+', '_')}.txt"))
                with open(written[-1], "w") as f:
                    f.write(row.pop("profile_table"))
        path = os.path.join(a.out, "compare.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
        written.insert(0, path)
        if not a.no_plots:
            try:
                from moe_fp4.plots import write_plots

                written += write_plots(report, a.out)
            except ImportError:
                print('plots: matplotlib is not installed (pip install "moe_fp4[plot]")', flush=True)
        print("wrote " + ", ".join(written), flush=True)
    return 0


def main(argv=None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    sub = p._subparsers._group_actions[0].choices[a.command]

    def err(msg: str) -> None:
        print(f"{sub.prog}: error: {msg}", file=sys.stderr, flush=True)

    return compare(a, err)


if __name__ == "__main__":
    raise SystemExit(main())
