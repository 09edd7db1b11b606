"""Where a training step of the compare model spends its GPU time, by phase, per mode and policy.

Runs ``moe-fp4 compare``'s model and trainer (moe_fp4.compare.train.build / Trainer) at a given batch, split and
recomputation policy, profiles ``--steps`` steps after ``--warmup`` with torch.profiler and sums the CUDA
kernels' time per step into phases by kernel name: expert GEMMs (moe_fp4's grouped FP8 engines, torch's
grouped BF16), dense GEMMs (cuBLAS: attention projections, dense MLP, head), conversions+SwiGLU (moe_fp4's
quantize / MXFP4 / cast-transpose / SwiGLU kernels), attention (SDPA), optimizer (fused AdamW, foreach),
communication (NCCL), and the rest (elementwise, copies, gathers, reductions). The step time is CUDA
events around the same steps; its excess over the kernel sum is GPU idle time (host-bound launches,
syncs).

    python bench/tools/step_phases.py --preset small --batch 64 --micro 22 --modes fp8 fp4
    python bench/tools/step_phases.py --preset dsv3-layers --batch 16 --micro 4 --policies none moe

The recomputation's cost is the difference between a policy's phases and none's at the same split.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/, for harness
from harness import chained_times, write_json  # noqa: E402

PHASES = [  # (phase, kernel-name pattern), first match wins
    ("communication", r"nccl"),
    ("expert GEMMs", r"grouped_mm|_gluon_grouped|grouped_gemm|cutlass.*grouped|GroupedGemm"),
    ("conversions+SwiGLU", r"quantize|mxfp4|fp8|cast_transpose|swiglu|_colwise|e2m1|e8m0"),
    ("attention", r"sdpa|flash|fmha|attention"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("dense GEMMs", r"nvjet|gemm|sm90_xmma|cublas|wgmma"),
]


def phase_of(name: str) -> str:
    for phase, pattern in PHASES:
        if re.search(pattern, name, re.IGNORECASE):
            return phase
    return "other"


def measure(cfg, mode: str, env, batch: int, micro: int, warmup: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from moe_fp4.compare.quiet import quiet_kineto
    from moe_fp4.compare.train import Trainer, _batches, _free, build

    model, loss_fn, sharded, handle = build(cfg, mode, env)
    trainer = Trainer(model, loss_fn, env, cfg.lr, cfg.steps, sharded, micro_batch=micro)
    data = _batches(cfg, env, None)
    for _ in range(warmup):
        trainer.step(*data.next(batch))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with quiet_kineto(), profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        step_ms = statistics.median(chained_times(lambda t=trainer: t.step(*data.next(batch)), steps))
    phases: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        if t and e.device_type == torch.autograd.DeviceType.CUDA:
            phases[phase_of(e.key)] = phases.get(phase_of(e.key), 0.0) + t / 1e3 / steps
    peak = torch.cuda.max_memory_allocated()
    del model, trainer
    _free(env)
    return {"mode": mode, "policy": cfg.recompute, "batch": batch, "micro": micro, "step_ms": step_ms,
            "kernel_ms": sum(phases.values()), "phases": phases, "peak_gib": peak / 2**30,
            "tokens_per_s": batch * cfg.model.seq / step_ms * 1e3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--micro", type=int, default=None, help="micro-batch (default: the batch, one pass)")
    p.add_argument("--modes", nargs="+", default=["fp8", "fp4"])
    p.add_argument("--policies", nargs="+", default=["none"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("step_phases.py profiles CUDA kernels: it needs a GPU", file=sys.stderr)
        return 2
    from moe_fp4.compare.config import CompareConfig, Env
    from moe_fp4.compare.origin import describe, provenance
    from moe_fp4.compare.train import _free

    env = Env(torch.device("cuda"))
    meta = describe(env)
    print(f"{meta['device']} | torch {meta['torch']} | {provenance(meta)} | {meta['date']}")
    rows = []
    for policy in a.policies:
        for mode in a.modes:
            cfg = CompareConfig(preset=a.preset, modes=(mode,), data="random", recompute=policy, progress=False)
            oom = False
            try:
                rows.append(measure(cfg, mode, env, a.batch, a.micro or a.batch, a.warmup, a.steps))
            except torch.OutOfMemoryError:
                oom = True
            if oom:   # outside the except block: its traceback no longer holds the model
                _free(env)
                print(f"{mode} {policy}: out of memory at batch {a.batch} in micro-batches of {a.micro or a.batch} "
                      f"({torch.cuda.get_device_name()})", flush=True)
    names = [ph for ph, _ in PHASES] + ["other"]
    print(f"preset {a.preset}, batch {a.batch} in micro-batches of {a.micro or a.batch}; ms per step")
    print(f"{'mode':<5} {'policy':<7} {'step':>7} {'kernels':>8} " + " ".join(f"{n[:13]:>13}" for n in names)
          + f" {'peak GiB':>8} {'tokens/s':>10}")
    for r in rows:
        print(f"{r['mode']:<5} {r['policy']:<7} {r['step_ms']:>7.1f} {r['kernel_ms']:>8.1f} "
              + " ".join(f"{r['phases'].get(n, 0.0):>13.1f}" for n in names)
              + f" {r['peak_gib']:>8.2f} {r['tokens_per_s']:>10,.0f}")
    write_json(a.json, {"meta": meta, "args": vars(a), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
