"""Where a MoE layer step spends GPU time: torch.profiler over fwd+bwd, top kernels per precision,
and how many CUDA kernels one step launches.

    python bench/tools/profile_moe.py --config dsv3 --precisions fp8 fp4 [--top 25] [--bench-step]

By default the profiled step is a later micro-batch's: the weights' FP8 copies cached, the weight
gradients added into the existing ``.grad`` (the ``aten::add_`` rows). ``--bench-step`` profiles the
step bench/moe_layer.py times instead: gradients set to None and the FP8 weights made again.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/, for moe_layer

import torch  # noqa: E402
from moe_layer import CONFIGS  # noqa: E402  (bench/moe_layer.py: the benchmark's shapes)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from moe_fp4.model.moe import MoE, MoEConfig  # noqa: E402


def layer_args(description: str, top: int) -> argparse.ArgumentParser:
    """The command line shared with host_bound.py: --config, --precisions, --top."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", default="dsv3", choices=list(CONFIGS))
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp8", "fp4"])
    p.add_argument("--top", type=int, default=top)
    return p


def make_layer(config: str):
    """-> (MoE layer on the GPU, its config, input x bf16 [T, H] wanting its gradient, output grad g)."""
    shape, tokens = CONFIGS[config]
    cfg = MoEConfig(**shape)
    torch.manual_seed(0)
    m = MoE(cfg, "bf16", device="cuda")
    x = torch.randn(tokens, cfg.hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    g = torch.randn(tokens, cfg.hidden, dtype=torch.bfloat16, device="cuda")
    return m, cfg, x, g


def layer_step(m: MoE, x: torch.Tensor, g: torch.Tensor, new_weights: bool = False) -> None:
    """One forward + backward of the layer with the gradients set to None first (as bench/moe_layer.py
    steps); new_weights: bump the weights' versions too, as an optimizer step would, so the step makes
    its FP8 weights again (moe_layer.py's step) instead of reusing a micro-batch's cached ones."""
    m.zero_grad(set_to_none=True)
    x.grad = None
    if new_weights:
        for p in m.parameters():
            torch.autograd.graph.increment_version(p)
    m(x).backward(g)


def main() -> None:
    p = layer_args(__doc__.splitlines()[0], 25)
    p.add_argument("--bench-step", action="store_true",
                   help="gradients set to None and the FP8 weights made again (bench/moe_layer.py's step)")
    a = p.parse_args()
    m, _, x, g = make_layer(a.config)
    tokens = x.shape[0]

    def step():
        if a.bench_step:
            layer_step(m, x, g, new_weights=True)
        else:
            m(x).backward(g)

    for prec in a.precisions:
        m.precision = prec
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"\n=== {a.config} {prec} ===", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.top, max_name_column_width=70))
        gpu = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        copies = sum(n.startswith(("Memcpy", "Memset")) for n in gpu)
        print(f"{a.config} {prec}: one step (forward + backward, {tokens} tokens) is {len(gpu) - copies} CUDA kernels "
              f"and {copies} memcpy / memset", flush=True)


if __name__ == "__main__":
    main()
