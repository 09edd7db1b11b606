"""Where a MoE layer step spends GPU time: torch.profiler over fwd+bwd, top kernels per precision.

    python bench/profile_moe.py --config dsv3 --precisions fp8 fp4 [--top 25]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from moe_layer import CONFIGS  # the benchmark's shapes (this directory is on sys.path when run as a script)
from moe_fp4.nn import MoE, MoEConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="dsv3", choices=list(CONFIGS))
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp8", "fp4"])
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    shape, tokens = CONFIGS[a.config]
    cfg = MoEConfig(**shape)
    torch.manual_seed(0)
    m = MoE(cfg, "bf16", device="cuda")
    x = torch.randn(tokens, cfg.hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    g = torch.randn(tokens, cfg.hidden, dtype=torch.bfloat16, device="cuda")
    for prec in a.precisions:
        m.precision = prec
        for _ in range(2):
            m(x).backward(g)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            m(x).backward(g)
            torch.cuda.synchronize()
        print(f"\n=== {a.config} {prec} ===", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.top, max_name_column_width=70))


if __name__ == "__main__":
    main()
