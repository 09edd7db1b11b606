"""Experts only, forward + backward: moe_fp4's grouped SwiGLU experts against BF16 and torchao FP8 experts.

At the dsv3 (32 experts x 1024 rows, H 7168, F 2048) and small (64 x 768, H 2048, F 1408) shapes, one
run, the same bf16 input, weights and output gradient for every variant:

- ``torch bf16``: gate_up = torch._grouped_mm(x, W13^T), silu(gate) * up, torch._grouped_mm(a, W2^T)
  (the BF16 baseline; autograd through torch's grouped GEMM);
- ``torchao fp8``: the same function with W13 and W2 wrapped by torchao's
  ``quantize_(experts, Float8TrainingOpConfig())``, so every torch._grouped_mm runs row-wise FP8
  (torchao's MoE training recipe; skipped with a line when torchao does not import);
- ``... + moe_fp4 hook``: the same module with ``register_activation_compression`` (what it saves for
  backward stored in MXFP4);
- ``moe_fp4 bf16 / fp8 / fp4``: :func:`moe_fp4.model.experts.grouped_swiglu_experts` (fp8: the DeepSeek-V3
  blockwise recipe on the grouped FP8 GEMM engine; fp4: the same GEMMs with MXFP4-stored activations);
- ``moe_fp4 fp8 / fp4, FP8 weights from AdamWFP8Weights``: the same, with the weights' versions left alone,
  so forward and backward find the FP8 pairs in the cache, as moe_fp4.model.optim.AdamWFP8Weights leaves them
  after its step (which writes them in its own update pass: ``--optimizer`` times whole steps with it).

Before every step (but for the rows just named) the weights' versions are bumped, as torch's optimizer
step would (the FP8 weight cache quantizes them again). With ``--micro-batches M`` they are bumped (and
the gradients reset) once per M forward + backward passes, as under gradient accumulation over M
micro-batches: the other passes reuse the cached FP8 weights and add their weight gradients into
``.grad``; the time is per pass (one timed
unit of M passes / M). Columns: median ms of forward + backward over --iters (CUDA events), the ratio
to ``torch bf16``, and the peak memory the step adds over its inputs (MiB). The variants take their
timed steps in --rounds rounds (default 5), the order rotated each round, one untimed step at each
switch (bench/harness.py): the step time drifts within a process, and timed one after the other the later
variants would pay for it (bench/RESULTS.md).

With ``--optimizer`` a timed unit is a whole training step instead: the passes, then AdamW (torch's
fused AdamW, or moe_fp4.model.optim.AdamWFP8Weights, which writes the FP8 weight pair in its own update pass),
each variant on its own copy of the weights; ``--param-dtype float32`` keeps float32 master weights.
Those variants run one after the other, baseline first (each copy of the weights and optimizer state
is freed before the next: at dsv3 with float32 weights they would not fit together).

    python bench/experts.py --json experts.json     # GPU (sm90)
    python bench/experts.py --optimizer --json experts_train.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from moe_fp4.gemm.engines import grouped_gemm_backend
from moe_fp4.model.experts import grouped_swiglu_experts
from moe_fp4.saved.hook import register_activation_compression

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/, also under python -P
from harness import interleaved, log, sm90_run, timed, write_results  # noqa: E402

SHAPES = {"dsv3": (32, 1024, 7168, 2048), "small": (64, 768, 2048, 1408)}   # experts, rows each, hidden, ffn


def torch_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x bf16 [R, H] grouped by expert, w13 [E, 2F, H], w2 [E, H, F], offs int32 [E] group ends -> [R, H]."""
    gate, up = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)


class Experts(torch.nn.Module):
    """W13 [E, 2F, H] and W2 [E, H, F] as parameters; forward = :func:`torch_experts` (an expert module the
    saved-activation hook selects by default: two 3-D parameters sharing the expert count)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w13 = torch.nn.Parameter(w13.clone())
        self.w2 = torch.nn.Parameter(w2.clone())

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch_experts(x, self.w13, self.w2, offs)


def torchao_experts(w13: torch.Tensor, w2: torch.Tensor):
    """-> an Experts module whose weights torchao wrapped for FP8 grouped GEMMs, or the reason it cannot."""
    try:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_
    except Exception as exc:  # noqa: BLE001 - torchao is optional: the row says why it is missing
        return f"torchao does not import: {str(exc).splitlines()[0][:120]}"
    m = Experts(w13, w2)
    quantize_(m, Float8TrainingOpConfig(), filter_fn=lambda mod, fqn: isinstance(mod, Experts))
    return m


def pass_unit(fn, params, x, g, micro_batches: int = 1, bump: bool = True):
    """-> a callable running one timed unit, an optimizer step's worth: the weights' versions bumped
    (unless ``bump`` is False: the FP8 pairs are then found in the cache, as AdamWFP8Weights leaves them)
    and their gradients reset, then ``micro_batches`` forward + backward passes accumulating into ``.grad``."""
    def step():
        for p in params:
            if bump:
                torch.autograd.graph.increment_version(p)   # as an optimizer step would
            p.grad = None
        for _ in range(micro_batches):
            x.grad = None
            fn().backward(g)
    return step


def timed_step(fn, params, x, g, warmup: int, iters: int, micro_batches: int = 1,
               bump: bool = True) -> tuple[float, float]:
    """-> (median ms per forward + backward of fn(), peak MiB above what was allocated before), one
    :func:`pass_unit` after another with nothing between (bench/torchao_ep.py times one variant per
    process this way)."""
    ms, mib = measured(pass_unit(fn, params, x, g, micro_batches, bump), warmup, iters)
    return ms / micro_batches, mib


def peak_mib(step) -> float:
    """Peak MiB one run of step() adds above what was allocated before it (after a run to warm up)."""
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def timed_train_step(fn, opt, x, g, warmup: int, iters: int, micro_batches: int) -> tuple[float, float]:
    """-> (median ms of one training step, peak MiB above what was allocated before): ``micro_batches``
    forward + backward passes accumulating into ``.grad``, then ``opt.step()`` and ``opt.zero_grad()``
    (the weights really change: no version bump needed)."""
    def step():
        for _ in range(micro_batches):
            x.grad = None
            fn().backward(g)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return measured(step, warmup, iters)


def measured(step, warmup: int, iters: int) -> tuple[float, float]:
    """-> (median ms of step() over iters after warmup, peak MiB it adds above what was allocated before)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = timed(step, 0, iters)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def run_train_steps(shape: str, args) -> list[dict]:
    """--optimizer: whole training steps (forward + backward + AdamW), each variant on its own copy of the
    weights and its own optimizer state. torch's AdamW is the fused one (its fastest); moe_fp4's precisions
    run with it (their FP8 weight pairs made in the next forward) and with moe_fp4.model.optim.AdamWFP8Weights
    (the pairs made by the optimizer's own pass)."""
    from moe_fp4.model.optim import AdamWFP8Weights

    e, rows, h, f = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = [rows] * e
    r = sum(counts)
    x = torch.randn(r, h, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    g = torch.randn(r, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    dtype = getattr(torch, args.param_dtype)
    w13 = (torch.randn(e, 2 * f, h, device="cuda", generator=gen) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, f, device="cuda", generator=gen) * f ** -0.5).to(dtype)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    hp = dict(lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torch_adamw = lambda ps: torch.optim.AdamW(ps, fused=True, **hp)              # noqa: E731
    ours_adamw = lambda ps: AdamWFP8Weights(ps, fused=True, **hp)                 # noqa: E731

    def torch_module(m):
        if dtype == torch.bfloat16:
            return lambda: m(x, offs)
        # float32 master weights: torch's experts compute in bf16, from a bf16 copy made each step (what
        # autocast would do; torch._grouped_mm needs one dtype)
        return lambda: torch_experts(x, m.w13.to(torch.bfloat16), m.w2.to(torch.bfloat16), offs)

    variants = [("torch bf16 + AdamW", torch_module, torch_adamw)]
    probe = torchao_experts(w13[:1, :128, :128].contiguous(), w2[:1, :128, :128].contiguous())
    if isinstance(probe, str):
        log(f"  torchao fp8: skipped ({probe})")
    else:
        variants.append(("torchao fp8 + AdamW", "torchao", torch_adamw))
    for p in ("fp8", "fp4"):
        run = lambda m, p=p: (lambda: grouped_swiglu_experts(x, m.w13, m.w2, counts, p))   # noqa: E731
        variants += [(f"moe_fp4 {p} + AdamW", run, torch_adamw),
                     (f"moe_fp4 {p} + AdamWFP8Weights", run, ours_adamw)]
    log(f"\n{shape}, training steps: {e} experts x {rows} rows, H {h}, F {f}, {args.param_dtype} weights, "
        f"{args.micro_batches} micro-batch(es) per step (grouped GEMM engine: {grouped_gemm_backend(x.device).value})")
    log("| variant | step ms | / torch bf16 | peak MiB |")
    log("| --- | ---: | ---: | ---: |")
    out, base_ms = [], None
    for name, make, make_opt in variants:
        module = torchao_experts(w13, w2) if make == "torchao" else Experts(w13, w2)
        fn = (lambda: module(x, offs)) if make == "torchao" else make(module)
        opt = make_opt(list(module.parameters()))
        try:
            ms, mib = timed_train_step(fn, opt, x, g, args.warmup, args.iters, args.micro_batches)
        except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
            log(f"| {name} | failed: {str(exc).splitlines()[0][:140]} | | |")
            out.append({"shape": shape, "variant": name, "error": str(exc).splitlines()[0][:300]})
            ms = None
        opt = fn = module = None      # this variant's weights and state go before the next
        torch.cuda.empty_cache()
        if ms is None:
            continue
        base_ms = base_ms or ms
        log(f"| {name} | {ms:.3f} | {ms / base_ms:.3f} | {mib:.0f} |")
        out.append({"shape": shape, "variant": name, "ms": ms, "vs_torch_bf16": ms / base_ms, "peak_mib": mib,
                    "micro_batches": args.micro_batches, "param_dtype": args.param_dtype, "optimizer": True})
    return out


def run_shape(shape: str, args) -> list[dict]:
    e, rows, h, f = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = [rows] * e
    r = sum(counts)
    x = torch.randn(r, h, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    g = torch.randn(r, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13 = (torch.randn(e, 2 * f, h, device="cuda", generator=gen) * h ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, f, device="cuda", generator=gen) * f ** -0.5).to(torch.bfloat16)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    ours = Experts(w13, w2)
    hooked = Experts(w13, w2)
    register_activation_compression(hooked)   # the saved activations in MXFP4 (moe_fp4's hook)
    variants = [("torch bf16", lambda: ours(x, offs), list(ours.parameters())),
                ("torch bf16 + moe_fp4 hook", lambda: hooked(x, offs), list(hooked.parameters()))]
    ao, ao_hooked = torchao_experts(w13, w2), torchao_experts(w13, w2)
    if isinstance(ao, str):
        log(f"  torchao fp8: skipped ({ao})")
    else:
        register_activation_compression(ao_hooked)
        variants += [("torchao fp8", lambda: ao(x, offs), list(ao.parameters())),
                     ("torchao fp8 + moe_fp4 hook", lambda: ao_hooked(x, offs), list(ao_hooked.parameters()))]
    for p in ("bf16", "fp8", "fp4"):
        variants.append((f"moe_fp4 {p}", lambda p=p: grouped_swiglu_experts(x, ours.w13, ours.w2, counts, p),
                         list(ours.parameters())))
    for p in ("fp8", "fp4"):
        # The pairs made by the optimizer (moe_fp4.model.optim.AdamWFP8Weights writes them in its update pass,
        # which bench/tools/adamw_fp8.py times against torch's fused AdamW): forward + backward find them.
        variants.append((f"moe_fp4 {p}, FP8 weights from AdamWFP8Weights",
                         lambda p=p: grouped_swiglu_experts(x, ours.w13, ours.w2, counts, p),
                         list(ours.parameters()), False))
    log(f"\n{shape}: {e} experts x {rows} rows, H {h}, F {f} (grouped GEMM engine: "
        f"{grouped_gemm_backend(x.device).value}; weights updated every {args.micro_batches} step(s))")
    log("| variant | fwd+bwd ms | / torch bf16 | peak MiB |")
    log("| --- | ---: | ---: | ---: |")
    out, units, mibs = [], {}, {}
    for name, fn, params, *bump in variants:
        unit = pass_unit(fn, params, x, g, args.micro_batches, *bump)
        try:
            mibs[name] = peak_mib(unit)      # also checks that the variant runs before it is timed
            units[name] = unit
        except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
            log(f"| {name} | failed: {str(exc).splitlines()[0][:140]} | | |")
            out.append({"shape": shape, "variant": name, "error": str(exc).splitlines()[0][:300]})
    base_ms = None
    for name, rounds in interleaved(units, args.warmup, args.iters, args.rounds).items():
        ms = statistics.median([t for r in rounds for t in r]) / args.micro_batches
        base_ms = base_ms or ms
        log(f"| {name} | {ms:.3f} | {ms / base_ms:.3f} | {mibs[name]:.0f} |")
        out.append({"shape": shape, "variant": name, "ms": ms, "vs_torch_bf16": ms / base_ms, "peak_mib": mibs[name],
                    "micro_batches": args.micro_batches, "rounds": args.rounds})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5,
                   help="forward + backward mode: the variants' timed steps in this many rounds, the order "
                        "rotated each round (1: one variant after the other)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="bump the weights' versions every M-th step only (gradient accumulation; default 1)")
    p.add_argument("--optimizer", action="store_true",
                   help="time whole training steps (forward + backward + AdamW) instead: torch's fused AdamW "
                        "against moe_fp4.model.optim.AdamWFP8Weights")
    p.add_argument("--param-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="with --optimizer: the weights' dtype (float32: master weights; torch's experts "
                        "multiply a bf16 copy made each step)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.micro_batches < 1 or args.rounds < 1:
        p.error(f"--micro-batches and --rounds must be >= 1, got {args.micro_batches} and {args.rounds}")
    head = sm90_run("bench/experts.py")
    results = []
    for shape in args.shape:
        results += run_train_steps(shape, args) if args.optimizer else run_shape(shape, args)
    write_results(args.json, head, results)


if __name__ == "__main__":
    main()
