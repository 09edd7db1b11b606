"""The fp4 vs fp8 comparison from Python: moe_fp4.compare.runner.run on one device (or under torchrun).

    python examples/throughput_vs_fp8.py                      # GPU: small preset; CPU: tiny (timings mean nothing)
    python examples/throughput_vs_fp8.py --preset small --steps 300 --batch 32
    torchrun --nproc-per-node 2 examples/throughput_vs_fp8.py  # expert parallelism over 2 GPUs (or 2 CPU ranks)

Trains the same model (same weights, same batches) with FP8 expert GEMMs and FP8 saved activations (the
DeepSeek-V3 baseline) and with MXFP4 saved activations and MXFP4 dispatch (fp4), then prints what fp4
buys: tokens/s, peak and activation memory against fp8, and the loss difference. `moe-fp4 compare` is
the same run with bf16 too, plots and the largest-batch search.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from moe_fp4.compare import CompareConfig, Env, run, table
from moe_fp4.exchange.ep import EPConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=None, help="tiny | small | dsv3-layers (default: small on a GPU, tiny on CPU)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="sequences per rank")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if "RANK" not in os.environ:
        print(f"not launched by torchrun: one process on {'cuda' if cuda else 'cpu'} (world size 1, no expert "
              "parallelism); for EP over 2 ranks: torchrun --nproc-per-node 2 examples/throughput_vs_fp8.py")
        world = 1
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    cfg = CompareConfig(preset=a.preset or ("small" if cuda else "tiny"), modes=("fp8", "fp4"),
                        steps=a.steps or (200 if cuda else 6), warmup=2 if not cuda else 20,
                        batch=a.batch or (16 if cuda else 4), progress=False)
    env = Env(device, dist.get_rank() if world > 1 else 0, world, EPConfig() if world > 1 else None)
    report = run(cfg, env, log=print if env.lead else lambda *a, **k: None)
    if env.lead:
        print(table(report))
        fp8, fp4 = report["modes"]["fp8"], report["modes"]["fp4"]
        r = report["ratios"]["fp4"]
        print(f"fp4 vs fp8: tokens/s {r['tokens_per_s_per_gpu_vs_fp8']:.3f}x, "
              f"activation memory {1 - r['activation_bytes_vs_fp8']:.1%} lower, "
              f"held-out loss {fp4['loss_eval']:.4f} vs {fp8['loss_eval']:.4f} "
              f"({r['loss_eval_delta_pct_vs_fp8']:+.2f}%)")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
