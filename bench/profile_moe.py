"""Where a MoE layer step spends GPU time: torch.profiler over fwd+bwd, top kernels per precision.

    python bench/profile_moe.py --config dsv3 --precisions fp8 fp4 [--top 25]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from moe_fp4.nn import MoE, MoEConfig

CONFIGS = {"dsv3": (MoEConfig(hidden=7168, ffn=2048, num_experts=32, top_k=8), 4096),
           "small": (MoEConfig(hidden=2048, ffn=1408, num_experts=64, top_k=6), 8192)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="dsv3", choices=list(CONFIGS))
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp8", "fp4"])
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    cfg, tokens = CONFIGS[a.config]
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
